"""What differs between the TRL versions of ``hf_tree.versions.TESTED_TRL`` (1.9 to 1.16) in the TRL internals the
tree trainers use, at the point of use, so that each TRL-based module imports on every version of the range.

- TRL's fused LM head (``FusedCausalLMOutput`` in ``trl.trainer.utils``, ``trl.kernels.ChunkedLogProbFunction``) exists
  from the newest end only (``FUSED_HEAD_TRL``): the trainers built on it (GRPO, RLOO, DPO, KTO) refuse older TRLs by
  name at import, and these accessors refuse them too for a direct use of the tree fused head.
"""

from __future__ import annotations

from typing import Any

from hf_tree.versions import require_tested_trl

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
