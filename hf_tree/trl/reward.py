"""``TreeRewardTrainer``: TRL's ``RewardTrainer`` with chosen and rejected sharing one prompt node.

TRL's reward trainer runs the sequence-classification model on ``[chosen; rejected]`` (prompt + response each), so
every prompt is computed twice per pair, and once more for every other pair of the same prompt in the batch. Here
the model's forward packs the rows into trees (``hf_tree.trl.reward_head``: rows are grouped by their tokens, so pairs
that share a prompt or a system prompt share it) and scores each branch at the token the model itself pools. The
one-line swap::

    from hf_tree.trl.reward import TreeRewardConfig, TreeRewardTrainer  # instead of trl's RewardConfig, RewardTrainer

Data handling, the loss (margins and ``center_rewards_coefficient`` included) and metrics are TRL's own; the scores
equal TRL's (tests/test_reward.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import RewardConfig, RewardTrainer

from hf_tree.models.check import self_check_setting
from hf_tree.models.check_guard import keep_training_kernels
from hf_tree.models.dropout import warn_if_dropout
from hf_tree.models.introspection import causal_lm_of
from hf_tree.models.quantization import log_quantized_base
from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl.arguments import InBatchMergeArguments, TreeTRLArguments, deprecated_switch_field
from hf_tree.trl.glue import log_tree_stats, prepare_trl_args
from hf_tree.trl.reward_head import TreeRewardForward, add_tree_reward_forward
from hf_tree.versions import require_tested_trl

require_tested_trl("TreeRewardTrainer")  # the TRL versions its overrides were tested with (hf_tree.versions)


@dataclass
class TreeRewardConfig(TreeTRLArguments, InBatchMergeArguments, RewardConfig):
    """``RewardConfig`` plus the tree fields (``hf_tree.trl.arguments``): ``tree_forward``, ``max_packed_tokens``,
    ``tree_self_check`` and ``merge_in_batch``. With ``tree_forward=True``, a model given by name is loaded with
    ``attn_implementation="tree_flash"`` (another name in ``model_init_kwargs`` is replaced with a warning)."""

    tree_rewards: bool | None = deprecated_switch_field()


class TreeRewardTrainer(FSDPFullSaveMixin, RewardTrainer):
    """``RewardTrainer`` whose rewards come from packed prompt trees.

    Accepts exactly ``RewardTrainer``'s arguments with ``args`` a ``TreeRewardConfig``. The model is put on
    ``tree_flash`` as ``TreeSFTTrainer`` does (a name loads with it, an instance on ``sdpa``/``eager`` is switched
    with a warning). Raises ``ValueError`` for a plain ``RewardConfig``, ``neftune_noise_alpha``, a model that is not
    a transformers ``GenericForSequenceClassification`` or cannot be switched, and (at the first batch) models that
    fail hf_tree's self-check.

    Attributes:
        tree_head: the tree forward installed on the model (its ``layout_stats`` are logged); ``None`` with
            ``tree_forward=False``.
    """

    tree_head: TreeRewardForward | None = None

    def __init__(self, model: Any, args: TreeRewardConfig | None = None, *rest: Any, **kwargs: Any) -> None:
        args = prepare_trl_args(args, TreeRewardConfig, model, "Reward")
        super().__init__(model, args, *rest, **kwargs)
        log_quantized_base(self.model)
        if not self.args.tree_forward:
            return
        base = causal_lm_of(self.model)
        self.tree_head = add_tree_reward_forward(
            base,
            self.args.max_packed_tokens,
            self_check_setting(self.args.tree_self_check),
            merge_in_batch=self.args.merge_in_batch,
        )
        keep_training_kernels(base)  # evaluation's no-grad passes must not repack 4-bit weights
        warn_if_dropout(self.model, "keep disable_dropout=True (RewardConfig's default)")

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        log_tree_stats(self)
        return loss
