"""``TreeDPOTrainer``: TRL's ``DPOTrainer`` with chosen and rejected sharing one prompt node.

TRL's DPO concatenates ``[chosen; rejected]`` into one padded batch and scores it through the fused LM head (policy,
and reference unless precomputed), so every prompt is computed twice per pass. Here the fused head of the policy
and reference models packs each pair into a tree (prompt node, chosen and rejected leaves; rows are grouped by
their tokens, so pairs or batches that share a prompt or a system prompt share more) and runs the model once on
it. The one-line swap::

    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer  # instead of trl's DPOConfig, DPOTrainer

Losses, metrics and data handling are TRL's own; the per-token values equal TRL's (tests/test_dpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig, DPOTrainer

from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl.arguments import InBatchMergeArguments, TreeLogProbArguments
from hf_tree.trl.preference_logprobs import TreePreferenceLogProbsMixin
from hf_tree.versions import require_tested_trl

require_tested_trl("TreeDPOTrainer")  # the TRL versions its overrides were tested with (hf_tree.versions)

# Per-token fields TRL's DPO reads from the policy's fused head (``DPOTrainer.__init__``); the reference needs only
# ``log_probs``.
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


@dataclass
class TreeDPOConfig(TreeLogProbArguments, InBatchMergeArguments, DPOConfig):
    """``DPOConfig`` plus the tree fields (``hf_tree.trl.arguments``): ``tree_forward``, ``max_packed_tokens``,
    ``tree_self_check`` and ``merge_in_batch``."""


class TreeDPOTrainer(FSDPFullSaveMixin, TreePreferenceLogProbsMixin, DPOTrainer):
    """``DPOTrainer`` whose policy and reference log-probs come from packed prompt trees.

    Accepts exactly ``DPOTrainer``'s arguments with ``args`` a ``TreeDPOConfig``. Raises ``ValueError`` for what
    the tree passes do not support: a model (or ``ref_model``) that cannot be switched to ``tree_flash`` (an
    instance on ``sdpa``/``eager`` is switched with a warning, a name is loaded with it),
    vision-language families outside ``hf_tree.vision.rows.ROW_FAMILIES`` (image prompts of those go through the
    tree head of GRPO: each distinct image encoded once per pass), and configs that rescale logits. An MoE model's
    router load-balancing loss is TRL's, computed on the trees.
    """

    tree_config_class = TreeDPOConfig
    trl_name = "DPO"

    def _tree_policy_outputs(self) -> tuple[str, ...]:
        return POLICY_OUTPUTS + (("log_sum_sq_probs",) if self.use_weighting else ())
