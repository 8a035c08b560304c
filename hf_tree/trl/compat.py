"""What differs between the TRL versions of ``hf_tree.versions.TESTED_TRL`` (1.9 to 1.16) in the TRL internals the
tree trainers use, at the point of use, so that each TRL-based module imports on every version of the range.

- ``SFTConfig.loss_type``: TRL 1.9 defaults it to ``"chunked_nll"`` (``"nll"`` with the head applied to the trained
  tokens only, in chunks: the same objective), which TRL 1.16 turns into ``"nll"``; its ``"dft"`` and label
  smoothing are refused there (``sft_loss_type``).
- TRL's fused LM head (``add_fused_lm_head``, ``FusedCausalLMOutput`` in ``trl.trainer.utils``,
  ``trl.kernels.ChunkedLogProbFunction``) exists from 1.16 on (``FUSED_HEAD_TRL``, ``has_fused_lm_head``). Before it:

  - GRPO and RLOO score through ``_get_per_token_logps_and_entropies`` on both versions, which the tree trainers
    override with a call of the tree fused head: its output is ``TreeFusedCausalLMOutput`` (TRL's fields), its kernel
    the plain-torch ``hf_tree.trl.plain_logprobs.plain_log_prob_values`` (TRL 1.9 computes full logits too), and a
    call that scores nothing runs the model's own forward for a zero connected to it (``unscored_fused_output``).
  - DPO and KTO read ``model(...).logits`` in TRL's own code: the tree head answers those plain calls with the
    logits of the packed trees gathered back to the padded rows (``TreeHeadSettings.logits_forward``).

  Where TRL 1.9 scores a completion's padding (from the padding), the tree passes give zero, as TRL 1.16 does: its
  loss masks those values out. GRPO's, RLOO's, DPO's and KTO's configs have no field that only TRL 1.9 has; the
  defaults that differ (``router_aux_loss_coef``, GRPO's ``use_bias_correction_kl``) are read by TRL's own loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from transformers.utils import ModelOutput

from hf_tree.trl.plain_logprobs import plain_log_prob_values
from hf_tree.versions import FUSED_HEAD_TRL


def has_fused_lm_head() -> bool:
    """Whether the installed TRL has its fused LM head (``FUSED_HEAD_TRL``: 1.16 on)."""
    import trl

    return Version(trl.__version__) >= FUSED_HEAD_TRL[0]


@dataclass
class TreeFusedCausalLMOutput(ModelOutput):
    """TRL 1.16's ``FusedCausalLMOutput`` fields, for a TRL without it: per-token fields ``[B, T - 1]``, zero where
    the label is ``-100`` (``None`` when not computed); ``loss`` and ``aux_loss`` 0-dim."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_causal_lm_output(**fields: Any) -> Any:
    """What ``model(..., fused_lm_head=True)`` returns: TRL's ``FusedCausalLMOutput(**fields)``, or its fields in a
    ``TreeFusedCausalLMOutput`` on a TRL without one."""
    if not has_fused_lm_head():
        return TreeFusedCausalLMOutput(**fields)
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput(**fields)


def chunked_log_prob_values(*args: Any) -> tuple[torch.Tensor | None, ...]:
    """TRL's chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction.apply(*args)``: hidden ``[M, D]``, head
    weight and bias, targets ``[M]``, temperature, vocabulary chunk, softcap, scale, outputs), or its plain-torch
    equivalent (``plain_log_prob_values``) on a TRL without it: ``(log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1)``, each ``[M]`` or ``None`` when not asked for."""
    if not has_fused_lm_head():
        return plain_log_prob_values(*args)
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(*args)


def unscored_fused_output(
    forward: Callable[..., Any],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    outputs: Sequence[str],
    router_inputs: dict[str, Any],
) -> Any:
    """The fused-head output of a call that scores no token (every label ``-100``), from the model's own
    ``forward``, so that the zero loss stays connected to the model (DDP/FSDP expect every parameter in the graph):
    TRL's fused head where it exists, else zeros ``[B, T - 1]`` for ``outputs`` plus ``0 * logits.sum()``."""
    if has_fused_lm_head():
        return forward(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, **router_inputs
        )
    plain = forward(input_ids=input_ids, attention_mask=attention_mask, **router_inputs)
    zero = plain.logits.sum() * 0
    zeros = zero.float() + torch.zeros(labels[:, 1:].shape, device=zero.device)
    per_token = {name: zeros.bool() if name == "is_top1" else zeros for name in outputs}
    return TreeFusedCausalLMOutput(
        loss=zero, label_mask=labels[:, 1:] != -100, aux_loss=getattr(plain, "aux_loss", None), **per_token
    )


def sft_loss_type(loss_type: str | None, label_smoothing_factor: float) -> str | None:
    """The SFT loss type of ``hf_tree.sft_losses`` that trains TRL's ``loss_type`` on the installed TRL: TRL 1.9's
    ``"chunked_nll"`` is ``"nll"``.

    Raises:
        ValueError: for ``loss_type="dft"`` or ``label_smoothing_factor`` on a TRL older than 1.16, whose SFTTrainer's
            DFT (a ``compute_loss_func`` there) and smoothing (beside its chunked loss) hf_tree was not tested against.
    """
    import trl

    if Version(trl.__version__) >= FUSED_HEAD_TRL[0]:
        return loss_type
    if loss_type == "dft":  # TRL 1.9 passes it as compute_loss_func, which the tree loss replaces
        raise ValueError(
            f"loss_type='dft' with trl {trl.__version__}: TreeSFTTrainer's DFT loss was tested against TRL from "
            f"{FUSED_HEAD_TRL[0]} on. Set loss_type='nll', or upgrade: pip install "
            f"'trl>={FUSED_HEAD_TRL[0]},<{FUSED_HEAD_TRL[1]}'."
        )
    if label_smoothing_factor:
        raise ValueError(
            f"label_smoothing_factor={label_smoothing_factor} with trl {trl.__version__}: TreeSFTTrainer's label "
            f"smoothing was tested against TRL from {FUSED_HEAD_TRL[0]} on. Set label_smoothing_factor=0.0, or "
            f"upgrade: pip install 'trl>={FUSED_HEAD_TRL[0]},<{FUSED_HEAD_TRL[1]}'."
        )
    return "nll" if loss_type == "chunked_nll" else loss_type
