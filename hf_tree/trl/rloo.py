"""``TreeRLOOTrainer``: TRL's ``RLOOTrainer`` computing each prompt once per group in its log-prob passes.

RLOO samples and scores groups exactly like GRPO (G completions of one prompt; old policy, reference and policy
passes through ``_get_per_token_logps_and_entropies``), so it shares ``TreeGRPOTrainer``'s pass
(``hf_tree.trl.rollout_logprobs``). The one-line swap::

    from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer  # instead of trl's RLOOConfig, RLOOTrainer

Generation prefills each distinct prompt once (``hf_tree.trl.group_generation``, as ``TreeGRPOTrainer``). Rewards
(with the KL penalty of ``beta``), leave-one-out advantages and the sequence-level clipped loss are TRL's own; the
log-probs equal TRL's (tests/test_rloo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import RLOOConfig, RLOOTrainer

from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl.glue import prepare_trl_args
from hf_tree.trl.group_generation import GroupPrefillGenerationMixin
from hf_tree.trl.rollout_logprobs import TreeRolloutLogProbsMixin
from hf_tree.trl.shared_prompts import TreeRolloutArguments
from hf_tree.versions import require_tested_trl

require_tested_trl("TreeRLOOTrainer")  # the TRL versions its overrides were tested with (hf_tree.versions)


@dataclass
class TreeRLOOConfig(TreeRolloutArguments, RLOOConfig):
    """``RLOOConfig`` plus the tree fields (``hf_tree.trl.arguments``): ``tree_forward``, ``max_packed_tokens``,
    ``tree_self_check``, ``tree_share_across_microbatches`` and ``tree_prefill_once_per_group``."""


class TreeRLOOTrainer(FSDPFullSaveMixin, TreeRolloutLogProbsMixin, GroupPrefillGenerationMixin, RLOOTrainer):
    """``RLOOTrainer`` whose per-token log-probs and entropies come from packed prompt trees.

    Accepts exactly ``RLOOTrainer``'s arguments with ``args`` a ``TreeRLOOConfig``; the model is put on
    ``tree_flash`` and unsupported setups are refused as in ``TreeGRPOTrainer`` (a model that cannot be switched,
    vision-language models and image inputs, configs that rescale logits). An MoE model's router loss is TRL's,
    computed on the trees (as ``TreeGRPOTrainer``).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: TreeRLOOConfig | None = None, **kwargs: Any) -> None:
        args = prepare_trl_args(args, TreeRLOOConfig, model, "RLOO")
        super().__init__(model, reward_funcs, args, **kwargs)
        self._install_rollout_tree_passes()  # RLOO's fused head has no cast_lm_head_to_fp32
