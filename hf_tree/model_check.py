"""First-use self-check: no model reaches tree training silently wrong.

Before the first tree batch reaches a model (``tree_causal_lm_loss``, the TRL log-prob heads, and so every trainer
and context parallel), ``check_model_for_trees`` runs, once per model instance:

1. name-based refusals (fast, clear): modules of a class in ``NOT_TREE_AWARE_MODULES`` (token mixers that run over
   the packed row as one sequence) and MoE router auxiliary losses;
2. ``detect_logit_head`` (hf_tree.head): the tree passes must reproduce the model's own logits;
3. a probe through the real model: a three-branch tree of a few dozen tokens, run once packed (``kv_end``, depth
   positions) and once branch by branch with the model's own attention (``sdpa``, or ``eager`` where the model
   refuses ``sdpa``), in the model's dtype, forward only. Every decoder layer's output must agree at every branch
   token within a tolerance fitted to the dtype; otherwise a ``ValueError`` names the model class, the first
   layer (and its submodules) that mixes branches, and the largest difference.

Opt out (for people who know their model is tree-aware) with ``self_check=False`` on ``tree_causal_lm_loss``, the
``tree_self_check`` training argument, or ``HF_TREE_SELF_CHECK=0``: steps 1 and 3 are skipped (step 2 is not a
check but how the loss computes logits).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from dataclasses import field
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.head import (
    LogitHead,
    backbone_of,
    causal_lm_of,
    detect_logit_head,
    eval_mode_no_grad,
    own_attention,
    probe_ids,
    raised_by_hf_tree,
)
from hf_tree.packing import pack_and_place
from hf_tree.parallel.context import suspend_context_parallel
from hf_tree.tree import Tree

SELF_CHECK_ENV_VAR = "HF_TREE_SELF_CHECK"

# Module classes known to mix the tokens of a packed row regardless of kv_end, with why. The fast first line of
# refusal (the probe would catch them too, with a less specific message). Drop a class once it is made tree-aware.
NOT_TREE_AWARE_MODULES: dict[str, str] = {
    **dict.fromkeys(("KimiDeltaAttention",), "Kimi delta attention: a recurrent state runs over the packed row"),
    **dict.fromkeys(
        ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"),
        "Mamba (selective scan) mixer: a causal conv and a scan run over the packed row",
    ),
    # Mamba2ForCausalLM does not pass the model's keyword arguments (kv_end) to its backbone, so the tree-aware
    # Mamba2 scan of hf_tree.mixers never sees the tree (the hybrids' Mamba2 mixers, which do, are exact).
    **dict.fromkeys(("Mamba2Mixer",), "Mamba2ForCausalLM does not pass kv_end to its mixers"),
    **dict.fromkeys(("RwkvSelfAttention", "RwkvFeedForward"), "RWKV time mixing: a recurrent state over the row"),
    **dict.fromkeys(("RecurrentGemmaRecurrentBlock",), "RG-LRU recurrence and conv over the packed row"),
    **dict.fromkeys(("MiniMaxLightningAttention",), "lightning (linear) attention: a running state over the row"),
}

# Largest accepted ``max |tree - per-branch| / max |per-branch|`` of a layer's output, per dtype. Exact
# implementations differ by rounding only (float64 models keep some float32 internals, e.g. HF's RMSNorm); a token
# seeing a sibling branch is off by O(1e-2) or more.
PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# The probe tree: a shared prefix and three branches, 26 packed tokens, 38 branch tokens.
PROBE_PREFIX = 6
PROBE_SUFFIXES = (8, 5, 7)

_checked: weakref.WeakKeyDictionary[PreTrainedModel, tuple[LogitHead, bool]] = weakref.WeakKeyDictionary()


def tree_self_check_field() -> Any:
    """The ``tree_self_check`` dataclass field of the tree training configs (``TreeArguments``,
    ``TreeLogProbArguments``)."""
    return field(
        default=True,
        metadata={
            "help": "Before the first tree batch, refuse models with known non-tree-aware layers and probe the real "
            "model with a tiny 3-branch tree against its branches run alone (hf_tree.model_check; once per model). "
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


def refuse_known_unsupported(model: PreTrainedModel) -> None:
    """The name-based first line: ``ValueError`` for modules in ``NOT_TREE_AWARE_MODULES`` and MoE aux losses."""
    found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in NOT_TREE_AWARE_MODULES})
    if found:
        reasons = "; ".join(f"{name}: {NOT_TREE_AWARE_MODULES[name]}" for name in found)
        raise ValueError(
            f"{type(model).__name__} has token mixers that are not tree-aware ({reasons}); sibling branches of a "
            "packed tree would leak into each other. This model cannot be trained on trees yet; train it on flat "
            "sequences instead."
        )
    config = model.config.get_text_config()
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0):
        raise ValueError(
            f"{type(model).__name__}'s config sets output_router_logits=True with router_aux_loss_coef="
            f"{config.router_aux_loss_coef}: the MoE load-balancing loss is not part of the tree loss (and packed rows "
            "change which tokens the routers see). Set config.output_router_logits=False (or router_aux_loss_coef=0)."
        )


def _decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The decoder layers: the longest ``nn.ModuleList`` of the backbone (empty if there is none)."""
    lists = [m for m in backbone_of(model).modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


@contextlib.contextmanager
def _recording(modules: dict[str, torch.nn.Module]) -> Iterator[dict[str, tuple[torch.Tensor | None, torch.Tensor]]]:
    """Record ``name -> (first input tensor, first output tensor)`` of each module's last call."""
    records: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            out = _first_tensor(output)
            if out is not None:
                inp = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
                records[name] = (inp, out)

        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def _compare(tree_out: torch.Tensor, branch_outs: list[torch.Tensor], index: list[torch.Tensor]) -> float:
    """Relative max difference between the tree's ``[1, N, ...]`` output at each branch's tokens and the branch's."""
    got = torch.cat([tree_out[0, i] for i in index]).double()
    expected = torch.cat([out[0] for out in branch_outs]).double()
    if got.shape != expected.shape:
        return float("inf")
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _run_probe(model, causal_lm: PreTrainedModel, modules: dict[str, torch.nn.Module]):
    """Forward the probe tree packed and its branches alone; ``(records of the tree run, of each branch run,
    per-branch packed indices, the autocast dtype the backbone ran under or None)``."""
    config = causal_lm.config.get_text_config()
    device = causal_lm.get_input_embeddings().weight.device
    prefix = probe_ids(config.vocab_size, PROBE_PREFIX, seed=1, device=torch.device("cpu")).tolist()
    branches = [
        prefix + probe_ids(config.vocab_size, n, seed=2 + i, device=torch.device("cpu")).tolist()
        for i, n in enumerate(PROBE_SUFFIXES)
    ]
    tree = Tree.from_sequences(branches)
    batch, _, parts, _ = pack_and_place([tree], max_packed_tokens=tree.num_tokens)
    index = [torch.as_tensor(parts[0].branch_flat_indices(b), device=device) for b in range(len(branches))]

    def record_precision(module, args):  # a trainer's autocast may be entered inside the (wrapped) forward
        if torch.is_autocast_enabled(device.type):
            precision.append(torch.get_autocast_dtype(device.type))

    precision: list[torch.dtype] = []
    hook = backbone_of(causal_lm).register_forward_pre_hook(record_precision)
    try:
        tree_records, branch_records = _forward_probe(model, branches, batch, device, causal_lm, modules)
    finally:
        hook.remove()
    return tree_records, branch_records, index, precision[0] if precision else None


def _forward_probe(model, branches, batch, device, causal_lm, modules):
    """The tree forward (``kv_end``, depth positions) and one forward per branch with the model's own attention."""
    with _recording(modules) as tree_records:
        model(
            input_ids=batch["input_ids"].to(device),
            position_ids=batch["position_ids"].to(device),
            kv_end=batch["kv_end"].to(device),
            use_cache=False,
        )
    branch_records = []
    with own_attention(causal_lm):
        for branch in branches:
            with _recording(modules) as records:
                model(input_ids=torch.tensor([branch], device=device), use_cache=False)
            branch_records.append(records)
    return tree_records, branch_records


def probe_tree_exactness(model: torch.nn.Module, forward=None) -> float:
    """Run the probe (see the module docstring) and return the largest relative difference of the final layer.

    ``forward``: what to call instead of ``model`` (see ``detect_logit_head``).

    Raises:
        ValueError: when some decoder layer's output differs beyond ``PROBE_TOLERANCE`` for the model's dtype,
            naming the model class, the first such layer and its submodules that mix branches, and the difference.
    """
    causal_lm = causal_lm_of(model)
    layers = _decoder_layers(causal_lm)
    modules = {f"layer {i}": layer for i, layer in enumerate(layers)}
    modules["backbone"] = backbone_of(causal_lm)
    dtype = causal_lm.get_input_embeddings().weight.dtype
    tolerance = PROBE_TOLERANCE.get(dtype, 5e-2)
    with eval_mode_no_grad(model), suspend_context_parallel():  # the probe runs whole on every rank
        try:
            tree_records, branch_records, index, autocast = _run_probe(forward or model, causal_lm, modules)
        except Exception as error:
            if isinstance(error, ValueError) and raised_by_hf_tree(error):
                raise  # hf_tree's own refusals say what is wrong already
            raise ValueError(
                f"{type(causal_lm).__name__} failed hf_tree's first-use probe (a tiny tree under "
                f"{TREE_ATTENTION_NAME}, then its branches with the model's own attention): {type(error).__name__}: "
                f"{error}. This model cannot be trained on trees."
            ) from error
    if autocast is not None:  # the layers ran in the autocast dtype: fit the tolerance to it
        dtype = autocast
        tolerance = max(tolerance, PROBE_TOLERANCE.get(dtype, 5e-2))
    names = [n for n in modules if n in tree_records and all(n in r for r in branch_records)]
    differences = {n: _compare(tree_records[n][1], [r[n][1] for r in branch_records], index) for n in names}
    if "backbone" not in differences:
        raise ValueError(f"{type(causal_lm).__name__}: the self-check could not read the backbone's last hidden state.")
    worst = max(differences.values())
    if worst <= tolerance:
        return differences["backbone"]
    first = next(n for n in names if differences[n] > tolerance)
    culprit = modules[first]
    leaking = _leaking_submodules(model, forward or model, causal_lm, culprit)
    if worst == float("inf"):
        leaking += " (the packed and the per-branch outputs have different shapes: the model adds or drops positions)"
    raise ValueError(
        f"{type(causal_lm).__name__} is not tree-exact under {TREE_ATTENTION_NAME}: a 3-branch probe tree differs "
        f"from its branches run alone with the model's own attention by up to {worst:.2e} (relative, tolerance "
        f"{tolerance:.0e} for {dtype}); the first layer that differs is {first} ({type(culprit).__name__}), where "
        f"{leaking} mix sibling branches. Training it on trees would be silently wrong. If you know better, opt "
        f"out with self_check=False / tree_self_check=False / {SELF_CHECK_ENV_VAR}=0."
    )


def _leaking_submodules(model: torch.nn.Module, forward, causal_lm: PreTrainedModel, layer: torch.nn.Module) -> str:
    """Submodule types of ``layer`` whose input agrees between the two runs but whose output does not."""
    modules = {n or type(layer).__name__: m for n, m in layer.named_modules()}
    dtype = causal_lm.get_input_embeddings().weight.dtype
    tolerance = PROBE_TOLERANCE.get(dtype, 5e-2)
    with eval_mode_no_grad(model), suspend_context_parallel():  # the probe runs whole on every rank
        tree_records, branch_records, index, autocast = _run_probe(forward, causal_lm, modules)
    if autocast is not None:
        tolerance = max(tolerance, PROBE_TOLERANCE.get(autocast, 5e-2))
    leaking = []
    for name, (tree_in, tree_out) in tree_records.items():
        if not all(name in r for r in branch_records) or tree_out.dim() < 2 or tree_in is None or tree_in.dim() < 2:
            continue
        try:
            out_diff = _compare(tree_out, [r[name][1] for r in branch_records], index)
            in_diff = _compare(tree_in, [r[name][0] for r in branch_records], index)
        except (IndexError, RuntimeError):  # not sequence-shaped
            continue
        if out_diff > tolerance and in_diff <= tolerance:
            leaking.append(f"{name} ({type(modules[name]).__name__})")
    inner = [entry for entry in leaking if not entry.startswith(f"{type(layer).__name__} (")]  # not the layer itself
    return ", ".join(inner) if inner else "its own computations (no single submodule located)"


def check_model_for_trees(model: torch.nn.Module, self_check: bool | None = None, forward=None) -> LogitHead:
    """Everything a model must pass before its first tree batch; cached per model instance.

    Args:
        model: a causal LM on ``tree_flash`` (may be PEFT-, DDP- or FSDP2-wrapped).
        self_check: run the name-based refusals and the probe (default: ``HF_TREE_SELF_CHECK``, on).
        forward: what to call instead of ``model`` (see ``detect_logit_head``).

    Returns:
        The model's ``LogitHead`` (how the tree passes score hidden states).

    Raises:
        ValueError: see ``refuse_known_unsupported``, ``detect_logit_head`` and ``probe_tree_exactness``.
    """
    causal_lm = causal_lm_of(model)
    enabled = self_check_enabled(self_check)
    if causal_lm in _checked and (_checked[causal_lm][1] or not enabled):
        return _checked[causal_lm][0]
    if enabled:
        refuse_known_unsupported(causal_lm)
    head = detect_logit_head(model, forward)
    if enabled:
        probe_tree_exactness(model, forward)
    _checked[causal_lm] = (head, enabled)
    return head
