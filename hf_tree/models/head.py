"""The one "last hidden state -> scored logits" step shared by the tree loss and the tree log-prob heads.

The tree passes never call the model's own head on ``[B, N, vocab]``: they gather the hidden states that predict
scored tokens and apply the output embedding themselves. That is only right if it reproduces what the model's
``forward`` computes after its backbone, which differs between families: Cohere multiplies the logits by
``logit_scale``, Granite divides them by ``logits_scaling``, MiniCPM scales the hidden state, Gemma 2/3 soft-cap
them, BERT-style heads run a transform before the vocabulary projection. Rather than trusting a list of config
names, ``detect_logit_head`` runs the model's own forward on a tiny input once and checks that

    logits == softcap(scale * output_embedding(last_hidden_state))

with ``scale`` from the config (or, failing that, fitted) and ``softcap = final_logit_softcapping``. A model whose
logits are not of that form is refused with a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_tree.attention.mask import compute_dtype
from hf_tree.models.introspection import (
    backbone_of,
    causal_lm_of,
    eval_mode_no_grad,
    own_attention,
    probe_ids,
    raised_by_hf_tree,
    remember_backbone,
)

# Detection input: a few token ids (deterministic, no global RNG draw).
PROBE_LENGTH = 8
# Largest accepted ``max |reconstructed - model logits| / max |model logits|`` per dtype: the reconstruction runs
# the same matmul on the same tensor, so only the scale's rounding (or the model's low-precision product) differs.
# A head transform or a missing scale is off by O(1).
HEAD_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

_detected: weakref.WeakKeyDictionary[PreTrainedModel, LogitHead] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LogitHead:
    """How a causal LM scores its last hidden state: ``softcap * tanh(scale * E(h) / softcap)`` (``E`` = output
    embedding, looked up on each call because FSDP and PEFT replace modules)."""

    scale: float = 1.0
    softcap: float | None = None

    def logits(self, output_embedding: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, D]`` hidden states -> ``[M, vocab]`` logits (half precision promoted to float32).

        ``forward()``, not ``__call__``: under FSDP2 (accelerate 1.15, torch 2.13) the head is its own FSDP unit,
        kept unsharded by the model forward until backward; running its hooks a second time segfaulted in backward.
        ``forward()`` keeps PEFT/accelerate wrappers (they replace ``forward`` itself).
        """
        return self.scored(output_embedding.forward(head_input(output_embedding, hidden)))

    def scored(self, logits: torch.Tensor) -> torch.Tensor:
        """The output embedding's ``[M, vocab]`` output -> the model's logits (half precision promoted)."""
        logits = logits.to(compute_dtype(logits.dtype))  # the log-softmax over a large vocabulary needs float32
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def head_input(output_embedding: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the output embedding's floating weight dtype where they differ: Mamba and Falcon-Mamba keep their
    residual stream in float32 in a half-precision model (``residual_in_fp32``) and cast it so before their LM head (a
    Linear refuses mixed dtypes, and under autocast it casts both anyway: the same logits). Quantized weights
    (integer storage) are left to their layer."""
    weight = getattr(output_embedding, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and hidden.dtype != weight.dtype:
        return hidden.to(weight.dtype)
    return hidden


def _relative_max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


def _config_scales(config) -> list[float]:
    """Logit multipliers the installed transformers families read from their configs (TRL's list)."""
    scales = [1.0]
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if isinstance(getattr(config, name, None), int | float):
            scales.append(float(getattr(config, name)))
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, int | float) and divisor != 0:
        scales += [1.0 / divisor, float(divisor)]  # Granite/MiniCPM3 divide, HyperCLOVA X multiplies
    return scales


def gathered_head(head: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The head's weight (and bias) whole for a read outside its module's forward, as TRL's fused head reads it.

    Under DeepSpeed ZeRO-3 every parameter is an empty shard outside its module's forward; the tree loss and log-prob
    heads apply ``head.weight`` to gathered hidden states themselves, so they gather it for the duration (as TRL's
    ``maybe_gather_lm_head_ctx``, without needing TRL: a null context without ZeRO-3 or when the weight is already
    whole, e.g. tied to the embeddings, whose active-submodule tracking a re-partition on exit would break). Gradients
    computed inside reach ZeRO-3's reduction as a whole-parameter gradient.
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = (head.weight, getattr(head, "bias", None))
    partitioned = [p for p in params if p is not None and p.ds_status != ZeroParamStatus.AVAILABLE]
    return deepspeed.zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()


def forward_then_score(
    model: torch.nn.Module, causal_lm: PreTrainedModel, score: Callable[[Any], torch.Tensor], **inputs: Any
) -> tuple[Any, torch.Tensor]:
    """``outputs = model(**inputs)`` and ``score(outputs)``, a loss that applies the head to captured hidden states.

    Under DeepSpeed ZeRO-3 ``score`` runs inside ``causal_lm``'s forward (its ``forward`` redirected for the call, as
    TRL runs its fused head), with its result as the output's ``loss``: ZeRO-3 fetches and releases parameters through
    the model's forward hooks, and a head gathered after the forward returned left the next step's backward with
    released layer weights (a size-0 ``LinearFunctionForZeroStage3`` input). Elsewhere it runs after the forward.
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        outputs = model(**inputs)
        return outputs, score(outputs)
    own = vars(causal_lm).get("forward")  # an instance forward (e.g. a fused head's), else the class's
    original = causal_lm.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        outputs = original(*args, **kwargs)
        outputs["loss"] = score(outputs)  # an output: ZeRO-3's backward hooks see it
        return outputs

    causal_lm.forward = forward
    try:
        outputs = model(**inputs)
    finally:
        if own is None:
            del causal_lm.forward
        else:
            causal_lm.forward = own
    return outputs, outputs["loss"]


def detect_logit_head(model: torch.nn.Module, forward=None) -> LogitHead:
    """The ``LogitHead`` that reproduces ``model``'s logits from its backbone's last hidden state (cached per model).

    Runs the model's forward once on ``PROBE_LENGTH`` tokens (no grad, eval mode, RNG untouched) with hooks on the
    backbone (its ``last_hidden_state``) and on the output embedding (applied to that state while the forward holds
    the head's parameters, so FSDP2-sharded heads work).

    Args:
        model: the causal LM, possibly PEFT/DDP/FSDP-wrapped.
        forward: what to call instead of ``model`` (e.g. the original forward from inside a patched one, where
            calling the model again would rerun FSDP's root hooks); the default calls ``model``.

    Raises:
        ValueError: when no scale and the config's softcap reproduce the logits (a transform before or after the
            vocabulary projection), or the model has no output embedding.
    """
    causal_lm = causal_lm_of(model)
    if causal_lm in _detected:
        return _detected[causal_lm]
    name = type(causal_lm).__name__
    embedding = causal_lm.get_output_embeddings()
    if embedding is None or backbone_of(causal_lm) is causal_lm:
        raise ValueError(
            f"{name} has no separate output embedding (get_output_embeddings()); hf_tree scores the "
            "last hidden state with it, so it supports causal LMs of the form backbone + LM head."
        )
    weight = getattr(embedding, "weight", None)
    # ZeRO-3 keeps an empty local shard and the full shape in ds_shape
    if not isinstance(weight, torch.Tensor) or len(getattr(weight, "ds_shape", weight.shape)) != 2:
        raise ValueError(
            f"{name}'s output embedding is a {type(embedding).__name__} without one [vocab, hidden] weight (e.g. "
            "MusicGen's one head per codebook); hf_tree scores the last hidden state with a single vocabulary "
            "projection, so this model family is not supported by its tree passes."
        )
    text_config = causal_lm.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)

    captured: dict[str, Any] = {}

    def backbone_hook(module, args, output):  # any module returning a model output with a last hidden state
        if "raw" not in captured and isinstance(getattr(output, "last_hidden_state", None), torch.Tensor):
            captured["hidden"], captured["backbone"] = output.last_hidden_state, module

    def head_hook(module, args, output):
        if "hidden" in captured and "raw" not in captured:
            try:
                hidden = captured["hidden"].reshape(-1, captured["hidden"].shape[-1])
                captured["raw"] = module.forward(head_input(module, hidden))
            except RuntimeError as error:  # e.g. a projection to a smaller embedding size before the vocabulary one
                captured["error"] = error

    ids = probe_ids(text_config.vocab_size, PROBE_LENGTH, seed=0, device=causal_lm.get_input_embeddings().weight.device)
    handles = [embedding.register_forward_hook(head_hook)]
    handles += [m.register_forward_hook(backbone_hook) for m in causal_lm.modules() if m is not causal_lm]
    try:  # the model's own attention: the head does not depend on it, and dual mode may refuse some models
        with eval_mode_no_grad(model), own_attention(causal_lm):
            logits = (forward or model)(input_ids=ids[None], use_cache=False).logits
    except Exception as error:
        if isinstance(error, ValueError) and raised_by_hf_tree(error):
            raise
        raise ValueError(
            f"{name}'s own forward failed on a tiny input while hf_tree checked how it computes logits: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    if "error" in captured:
        raise ValueError(
            f"{name}'s output embedding {type(embedding).__name__} cannot be applied to its backbone's last hidden "
            f"state ({captured['error']}): the model transforms the hidden state before the vocabulary projection, "
            "which the tree loss and log-prob heads cannot reproduce. This model is not supported."
        )
    if "raw" not in captured:
        raise ValueError(
            f"{name}'s forward never called its output embedding on the backbone's output; hf_tree "
            "cannot reproduce its logits. This model is not supported."
        )
    # The head's output dtype is the precision it ran in (under a trainer's autocast, lower than the parameters');
    # logits cast to a narrower dtype (NemotronH's ``.float()`` in a float64 model) hold only that precision.
    precision = max((captured["raw"].dtype, logits.dtype), key=lambda dtype: torch.finfo(dtype).eps)
    tolerance = HEAD_TOLERANCE.get(precision, 2e-2)
    expected = logits.reshape(-1, logits.shape[-1]).double()
    raw = captured["raw"].double()
    # Undo the cap to fit a scale on the linear part: scale * raw == softcap * atanh(logits / softcap).
    uncapped = expected if softcap is None else softcap * torch.atanh((expected / softcap).clamp(-1 + 1e-12, 1 - 1e-12))
    fitted = float((uncapped * raw).sum() / (raw * raw).sum().clamp_min(1e-300))
    errors = {}
    for scale in [*_config_scales(text_config), fitted]:
        head = LogitHead(scale=scale, softcap=softcap)
        # The same step as LogitHead.logits, on the embedding output computed inside the model's forward (and so
        # under the same autocast and FSDP state as the model's own logits).
        errors[scale] = _relative_max_error(head.scored(captured["raw"]), expected)
        if errors[scale] <= tolerance:
            _detected[causal_lm] = head
            remember_backbone(causal_lm, captured["backbone"])
            return head
    raise ValueError(
        f"{name}'s forward does not compute its logits as softcap(scale * {type(embedding).__name__}(last hidden "
        f"state)) (best relative error {min(errors.values()):.2e} > {tolerance:.0e}; config softcap={softcap}): "
        "a transform before or after the vocabulary projection that the tree loss and log-prob heads cannot "
        "reproduce. This model family is not supported by hf_tree's tree passes."
    )
