"""First-use self-check: no model reaches tree training silently wrong.

Before the first tree batch reaches a model (``tree_causal_lm_loss``, the TRL log-prob heads, and so every trainer
and context parallel), ``check_model_for_trees`` runs, once per model instance:

1. name-based refusals (fast, clear): modules of a class in ``NOT_TREE_AWARE_MODULES`` (token mixers that run over
   the packed row as one sequence) and MoE router losses the tree cannot weight by token multiplicity;
2. ``detect_logit_head`` (hf_tree.models.head): the tree passes must reproduce the model's own logits;
3. a probe through the real model (``hf_tree.models.probe``): a three-branch tree whose first sibling is longer than the
   farthest the model declares it reads back (and than ``DEFAULT_PROBE_REACH``), run packed (``kv_end``, depth
   positions), branch by branch with the model's own attention (``sdpa``, or ``eager`` where the model refuses
   ``sdpa``) and as a right-padded batch, in the model's dtype, forward only; then again with one sibling's tokens
   replaced. Every decoder layer's output must equal the branches alone within ``FLOOR_FACTOR`` times the rounding
   floor measured on the model (padded batch vs alone), and must not change at the other branches' tokens when a
   sibling's tokens change (beyond what the same change moves them in the padded batch); otherwise a
   ``ValueError`` names the model class, the first layer (and its submodules) that mixes branches, and the
   measurements.
4. on every later call (the result is cached), the guard of ``hf_tree.models.check_guard``: 4-bit weights repacked
   for bitsandbytes' inference kernel (which a no-grad pass after the check would do; the check keeps them off it) or
   hybrid mixer ops rebound since (a reloaded modeling module) are refused.

Opt out (for people who know their model is tree-aware) with ``self_check=False`` on ``tree_causal_lm_loss``, the
``tree_self_check`` training argument, or ``HF_TREE_SELF_CHECK=0``: steps 1, 3 and 4 are skipped (step 2 is not a
check but how the loss computes logits; 4-bit layers are still kept off the inference repack).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import field
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_tree.attention.families import refuse_family
from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.models.check_guard import CheckedModel, refuse_inference_packed_weights
from hf_tree.models.head import LogitHead, detect_logit_head
from hf_tree.models.introspection import causal_lm_of, raised_by_hf_tree
from hf_tree.models.length_rope import longest_exact_branch
from hf_tree.models.probe import (
    FLOOR_FACTOR,
    ProbeRun,
    ProbeShape,
    measure,
    probe_modules,
    probe_shape,
    routes_tokens,
    verdicts,
)
from hf_tree.models.router_loss import load_balancing_function, router_aux_loss_coef

SELF_CHECK_ENV_VAR = "HF_TREE_SELF_CHECK"

# Module classes known to mix the tokens of a packed row regardless of kv_end, with why. The fast first line of
# refusal (the probe would catch them too, with a less specific message). Drop a class once it is made tree-aware.
NOT_TREE_AWARE_MODULES: dict[str, str] = {
    **dict.fromkeys(("RwkvSelfAttention", "RwkvFeedForward"), "RWKV time mixing: a recurrent state over the row"),
    **dict.fromkeys(("RecurrentGemmaRecurrentBlock",), "RG-LRU recurrence and conv over the packed row"),
    **dict.fromkeys(("MiniMaxLightningAttention",), "lightning (linear) attention: a running state over the row"),
}

# per causal LM: its logit head, whether the self-check ran, and what the check verified that a later step could undo
_checked: weakref.WeakKeyDictionary[PreTrainedModel, tuple[LogitHead, bool, CheckedModel]] = weakref.WeakKeyDictionary()


def tree_self_check_field() -> Any:
    """The ``tree_self_check`` dataclass field of the tree training configs (``TreeArguments``,
    ``TreeLogProbArguments``)."""
    return field(
        default=True,
        metadata={
            "help": "Before the first tree batch, refuse models with known non-tree-aware layers and probe the real "
            "model with a tiny 3-branch tree against its branches run alone (hf_tree.models.check; once per model). "
            "A model that fails is refused with a ValueError instead of training silently wrong. False skips both "
            f"(so does the environment variable {SELF_CHECK_ENV_VAR}=0)."
        },
    )


def self_check_setting(tree_self_check: bool) -> bool | None:
    """A config's ``tree_self_check`` as the ``self_check`` argument: ``False`` turns the check off, ``True`` leaves
    it to ``HF_TREE_SELF_CHECK`` (on by default)."""
    return None if tree_self_check else False


def self_check_enabled(self_check: bool | None) -> bool:
    """``self_check`` if given, else ``HF_TREE_SELF_CHECK`` (on unless ``0``/``false``/``no``/``off``)."""
    if self_check is not None:
        return bool(self_check)
    return os.environ.get(SELF_CHECK_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def refuse_not_tree_aware(model: PreTrainedModel) -> None:
    """``ValueError`` naming the family and why for a model refused by name: a family of
    ``hf_tree.attention.families``, or modules in ``NOT_TREE_AWARE_MODULES``."""
    refuse_family(model.config, type(model).__name__)
    found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in NOT_TREE_AWARE_MODULES})
    if found:
        reasons = "; ".join(f"{name}: {NOT_TREE_AWARE_MODULES[name]}" for name in found)
        raise ValueError(
            f"{type(model).__name__} has token mixers that are not tree-aware ({reasons}); sibling branches of a "
            "packed tree would leak into each other. This model cannot be trained on trees yet; train it on flat "
            "sequences instead."
        )


def refuse_known_unsupported(model: PreTrainedModel) -> None:
    """The name-based first line: ``refuse_not_tree_aware``, MoE router losses of another form than transformers'
    ``load_balancing_loss_func`` (``hf_tree.models.router_loss``), and 4-bit weights repacked for inference
    (``hf_tree.models.check_guard.refuse_inference_packed_weights``)."""
    refuse_not_tree_aware(model)
    if router_aux_loss_coef(model):
        load_balancing_function(model)  # refuses a router loss the tree cannot weight by multiplicity
    refuse_inference_packed_weights(model)


def _dtypes_of(causal_lm: PreTrainedModel, run: ProbeRun) -> tuple[torch.dtype, torch.dtype]:
    """The dtype the layers computed in (the autocast dtype when the (wrapped) forward entered autocast, else the
    embedding's), and the coarsest dtype some part rounds to: that or a floating parameter's, e.g. LoRA adapters
    that TRL's QLoRA recipe keeps in bfloat16 on a float32 quantized base (PEFT rounds their inputs to it)."""
    dtype = run.autocast or causal_lm.get_input_embeddings().weight.dtype
    floating = {p.dtype for p in causal_lm.parameters() if p.dtype.is_floating_point}
    return dtype, max(floating | {dtype}, key=lambda d: torch.finfo(d).eps)


def probe_tree_exactness(model: torch.nn.Module, forward=None, length_limit: int | None = None) -> float:
    """Run the probe (``hf_tree.models.probe``) and return the final hidden state's per-token relative difference.

    Args:
        model: the causal LM (may be wrapped).
        forward: what to call instead of ``model`` (see ``detect_logit_head``).
        length_limit: the longest probe branch allowed (e.g. a RoPE length switch); the model's position table
            bounds it too.

    Raises:
        ValueError: when some decoder layer's output differs from its branches alone beyond the measured rounding
            floor, or changes when a sibling branch's tokens change; naming the model class, the first such layer,
            its submodules that mix branches, and the measurements.
    """
    causal_lm = causal_lm_of(model)
    modules = probe_modules(causal_lm)
    shape = probe_shape(causal_lm.config.get_text_config(), length_limit)
    try:
        run = measure(model, modules, shape, forward)
    except Exception as error:
        if isinstance(error, ValueError) and raised_by_hf_tree(error):
            raise  # hf_tree's own refusals say what is wrong already
        raise ValueError(
            f"{type(causal_lm).__name__} failed hf_tree's first-use probe (a tiny tree under "
            f"{TREE_ATTENTION_NAME}, then its branches with the model's own attention): {type(error).__name__}: "
            f"{error}. This model cannot be trained on trees."
        ) from error
    dtype, rounding = _dtypes_of(causal_lm, run)
    routed = routes_tokens(causal_lm.config)
    results = verdicts(run, [n for n in modules if n in run.tree and n in run.alone], dtype, routed, rounding=rounding)
    if "backbone" not in results:
        raise ValueError(f"{type(causal_lm).__name__}: the self-check could not read the backbone's last hidden state.")
    failing = [v for v in results.values() if not v.exact]
    if not failing:
        return results["backbone"].difference
    first = failing[0]
    culprit = modules[first.name]
    leaking = _leaking_submodules(model, forward or model, causal_lm, culprit, shape)
    if first.difference == float("inf"):
        leaking += " (the packed and the per-branch outputs have different shapes: the model adds or drops positions)"
    if not first.difference <= first.difference_bound:
        what = (
            f"differs from its branches run alone with the model's own attention by up to {first.difference:.2e} "
            f"(per-token relative; bound {first.difference_bound:.1e} = {FLOOR_FACTOR:g} x the largest rounding "
            f"floor measured for {rounding})"
        )
    else:
        what = (
            f"changes other branches' outputs by up to {first.invariance:.2e} when one sibling branch's tokens are "
            f"replaced (per-token relative; bound {first.invariance_bound:.1e} for {dtype}: the same change in a "
            "padded batch of the branches moves them by at most the rounding floor)"
        )
    raise ValueError(
        f"{type(causal_lm).__name__} is not tree-exact under {TREE_ATTENTION_NAME}: a 3-branch probe tree (siblings "
        f"of {', '.join(map(str, shape.suffixes))} tokens) {what}; the first layer that differs is {first.name} "
        f"({type(culprit).__name__}), where {leaking} mix sibling branches. Training it on trees would be silently "
        f"wrong. If you know better, opt out with self_check=False / tree_self_check=False / {SELF_CHECK_ENV_VAR}=0."
    )


def _leaking_submodules(
    model: torch.nn.Module, forward, causal_lm: PreTrainedModel, layer: torch.nn.Module, shape: ProbeShape
) -> str:
    """Submodule types of ``layer`` whose input agrees between the runs but whose output does not."""
    modules = {n or type(layer).__name__: m for n, m in layer.named_modules()}
    run = measure(model, modules, shape, forward)
    names = [n for n in modules if n in run.tree and n in run.alone]
    dtype, rounding = _dtypes_of(causal_lm, run)
    routed = routes_tokens(causal_lm.config)
    outputs = verdicts(run, names, dtype, routed, rounding=rounding)
    inputs = verdicts(run, names, dtype, routed, which=0, rounding=rounding)
    measured_inputs = [n for n in names if inputs[n].difference == inputs[n].difference]  # not nan
    leaking = [
        f"{name} ({type(modules[name]).__name__})"
        for name in measured_inputs
        if not outputs[name].exact and inputs[name].exact
    ]
    inner = [entry for entry in leaking if not entry.startswith(f"{type(layer).__name__} (")]  # not the layer itself
    return ", ".join(inner) if inner else "its own computations (no single submodule located)"


def check_model_for_trees(model: torch.nn.Module, self_check: bool | None = None, forward=None) -> LogitHead:
    """Everything a model must pass before its first tree batch; cached per model instance, and guarded on every
    later call against what could change underneath the cache (``hf_tree.models.check_guard``).

    Args:
        model: a causal LM on ``tree_flash`` (may be PEFT-, DDP- or FSDP2-wrapped).
        self_check: run the name-based refusals, the probe and the guard (default: ``HF_TREE_SELF_CHECK``, on).
        forward: what to call instead of ``model`` (see ``detect_logit_head``).

    Returns:
        The model's ``LogitHead`` (how the tree passes score hidden states).

    Raises:
        ValueError: see ``refuse_known_unsupported``, ``detect_logit_head``, ``probe_tree_exactness`` and, on a later
            call, ``CheckedModel.refuse_changes`` (4-bit weights repacked for inference, mixer ops no longer
            tree-aware).
    """
    causal_lm = causal_lm_of(model)
    enabled = self_check_enabled(self_check)
    if causal_lm in _checked and (_checked[causal_lm][1] or not enabled):
        head, _, checked = _checked[causal_lm]
        if enabled:
            checked.refuse_changes(causal_lm)
        return head
    if enabled:
        refuse_known_unsupported(causal_lm)
    checked = CheckedModel.of(causal_lm)  # from here on no no-grad pass repacks its 4-bit layers
    head = detect_logit_head(model, forward)
    if enabled:  # the probe stays within a RoPE length switch (batches past it are refused per batch)
        probe_tree_exactness(model, forward, length_limit=longest_exact_branch(causal_lm.config))
    _checked[causal_lm] = (head, enabled, checked)
    return head
