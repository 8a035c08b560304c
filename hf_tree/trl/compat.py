"""What differs between the TRL versions of ``hf_tree.versions.TESTED_TRL`` (1.9 to 1.16) in the TRL internals the
tree trainers use, at the point of use, so that each TRL-based module imports on every version of the range.

- ``SFTConfig.loss_type``: TRL 1.9 defaults it to ``"chunked_nll"`` (``"nll"`` with the head applied to the trained
  tokens only, in chunks: the same objective), which TRL 1.16 turns into ``"nll"``; its ``"dft"`` and label
  smoothing are refused there (``sft_loss_type``).
- TRL's fused LM head (``FusedCausalLMOutput`` in ``trl.trainer.utils``, ``trl.kernels.ChunkedLogProbFunction``) exists
  from the newest end only (``FUSED_HEAD_TRL``): the trainers built on it (GRPO, RLOO, DPO, KTO) refuse older TRLs by
  name at import, and these accessors refuse them too for a direct use of the tree fused head.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from hf_tree.versions import FUSED_HEAD_TRL, require_tested_trl

FUSED_HEAD_USER = "the tree fused LM head"


def fused_causal_lm_output(**fields: Any) -> Any:
    """TRL's ``FusedCausalLMOutput(**fields)``: what ``model(..., fused_lm_head=True)`` returns."""
    require_tested_trl(FUSED_HEAD_USER)
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput(**fields)


def chunked_log_prob_function() -> Any:
    """TRL's chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``, a ``torch.autograd.Function``)."""
    require_tested_trl(FUSED_HEAD_USER)
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction


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
