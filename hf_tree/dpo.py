"""``TreeDPOTrainer``: TRL's ``DPOTrainer`` with chosen and rejected sharing one prompt node.

TRL's DPO concatenates ``[chosen; rejected]`` into one padded batch and scores it through the fused LM head (policy,
and reference unless precomputed), so every prompt is computed twice per pass. Here the fused head of the policy
and reference models packs each pair into a tree (prompt node, chosen and rejected leaves; rows are grouped by
their tokens, so pairs or batches that share a prompt or a system prompt share more) and runs the model once on
it. The one-line swap::

    from hf_tree.dpo import TreeDPOConfig, TreeDPOTrainer  # instead of trl's DPOConfig, DPOTrainer

Losses, metrics and data handling are TRL's own; the per-token values equal TRL's (tests/test_dpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from hf_tree.dropout import warn_if_dropout
from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trainer import use_tree_attention
from hf_tree.trl_glue import TreeLogProbArguments, install_tree_heads, log_tree_stats, prepare_trl_args

# Per-token fields TRL's DPO reads from the policy's fused head (``DPOTrainer.__init__``); the reference needs only
# ``log_probs``.
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


@dataclass
class TreeDPOConfig(TreeLogProbArguments, DPOConfig):
    """``DPOConfig`` plus ``tree_logprobs`` and ``max_packed_tokens`` (see ``TreeLogProbArguments``)."""


class TreeDPOTrainer(FSDPFullSaveMixin, DPOTrainer):
    """``DPOTrainer`` whose policy and reference log-probs come from packed prompt trees.

    Accepts exactly ``DPOTrainer``'s arguments with ``args`` a ``TreeDPOConfig``. Raises ``ValueError`` for what
    the tree passes do not support: a model (or ``ref_model``) that cannot be switched to ``tree_flash`` (an
    instance on ``sdpa``/``eager`` is switched with a warning, a name is loaded with it),
    vision datasets and vision-language models, MoE router auxiliary losses, and configs that rescale logits.
    """

    def __init__(self, model: Any, ref_model: Any = None, args: TreeDPOConfig | None = None, **kwargs: Any) -> None:
        args = prepare_trl_args(args, TreeDPOConfig, model, "DPO")
        if args.tree_logprobs and ref_model is not None and not isinstance(ref_model, str):
            use_tree_attention(ref_model, "ref_model")
        self._tree_heads_ready = False
        super().__init__(model, ref_model, args, **kwargs)
        self._install_tree_heads()
        if self.args.tree_logprobs:
            warn_if_dropout(self.model, "keep disable_dropout=True (DPOConfig's default)")

    def _install_tree_heads(self) -> None:
        """Put the tree fused head on the policy (and reference); runs before the first log-prob pass, which may
        be the reference precompute inside ``DPOTrainer.__init__``."""
        if self._tree_heads_ready or not self.args.tree_logprobs:
            return
        if self._is_vision_dataset:
            raise ValueError(
                "tree log-probs support text datasets only (this one has images); set tree_logprobs=False."
            )
        config = self.model.config
        if config.get_text_config() is not config:  # hf_tree.vision's models are tested with GRPO and SFT, not DPO
            raise ValueError(
                f"TreeDPOTrainer's tree log-probs support text-only causal LMs; {type(self.model).__name__} is a "
                "vision-language model (hf_tree.vision covers GRPO and SFT). Set tree_logprobs=False."
            )
        install_tree_heads(self, POLICY_OUTPUTS + (("log_sum_sq_probs",) if self.use_weighting else ()))
        self._tree_heads_ready = True

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.args.tree_logprobs:
            log_tree_stats(self, model)
        return loss

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        self._install_tree_heads()
        return super()._precompute_ref_logps(dataset, name, batch_size)
