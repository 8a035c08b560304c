"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` computing each prompt once per group in its log-prob passes.

GRPO scores the G completions of a prompt three times per step (old policy, reference, current policy), and TRL
runs the prompt once per completion each time. Here every log-prob pass packs the rows that share prompt tokens
into trees (one prompt node, one leaf per completion; rows are grouped by their tokens, so a micro-batch may hold
partial groups or several groups) and runs the model once on them. The one-line swap::

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer  # instead of trl's GRPOConfig, GRPOTrainer

Generation is TRL's own call with each distinct prompt prefilled once and its cache expanded to the group
(``hf_tree.trl.group_generation``, ``tree_prefill_once_per_group``: the same completions as TRL's). Rewards, advantages
and the loss are TRL's own, and the log-probs and entropies equal TRL's (see ``hf_tree.trl.logprobs`` and
tests/test_grpo.py). The reference pass works with a separate reference model and with a
disabled PEFT adapter alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import GRPOConfig, GRPOTrainer

from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl.glue import prepare_trl_args
from hf_tree.trl.group_generation import GroupPrefillGenerationMixin
from hf_tree.trl.rollout_logprobs import TreeRolloutLogProbsMixin
from hf_tree.trl.shared_prompts import TreeRolloutArguments
from hf_tree.versions import require_tested_trl

require_tested_trl("TreeGRPOTrainer")  # the TRL versions its overrides were tested with (hf_tree.versions)


@dataclass
class TreeGRPOConfig(TreeRolloutArguments, GRPOConfig):
    """``GRPOConfig`` plus the tree fields (``hf_tree.trl.arguments``): ``tree_forward``, ``max_packed_tokens``,
    ``tree_self_check``, ``tree_share_across_microbatches`` and ``tree_prefill_once_per_group``."""


class TreeGRPOTrainer(FSDPFullSaveMixin, TreeRolloutLogProbsMixin, GroupPrefillGenerationMixin, GRPOTrainer):
    """``GRPOTrainer`` whose per-token log-probs and entropies come from packed prompt trees.

    Accepts exactly ``GRPOTrainer``'s arguments with ``args`` a ``TreeGRPOConfig`` (a plain ``GRPOConfig`` is
    refused: it lacks the tree fields). The model is put on ``tree_flash`` as ``TreeSFTTrainer`` does (a name loads
    with it, an instance on ``sdpa``/``eager`` is switched with a warning). Raises ``ValueError`` for what the tree
    passes do not support: a model that cannot be switched, vision-language models and image inputs, and configs
    that rescale logits. An MoE model's router load-balancing loss is TRL's, computed on the trees.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: TreeGRPOConfig | None = None, **kwargs: Any) -> None:
        args = prepare_trl_args(args, TreeGRPOConfig, model, "GRPO")
        super().__init__(model, reward_funcs, args, **kwargs)
        self._install_rollout_tree_passes(cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
