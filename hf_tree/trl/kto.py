"""``TreeKTOTrainer``: TRL's ``KTOTrainer`` with the rows of each log-prob pass that share prompt tokens packed into
trees.

KTO scores unpaired (prompt, completion, label) rows through the fused LM head: the policy pass, the reference pass
(or its precompute) and, for ``loss_type="kto"``, a no-grad KL pass on mismatched pairs (each prompt with the
previous row's completion). Here each of those calls packs its rows into trees, as ``TreeDPOTrainer`` does
(``hf_tree.trl.preference_logprobs``). What that saves depends on the data order, since KTO's KL estimate needs
``train_sampling_strategy="sequential"``: rows of one prompt listed together share it (2.1x fewer tokens per pass on
CHAMP's 4 answers per long few-shot prompt), rows in random order share only the chat template's system prompt
(1.03-1.05x); docs/grpo_dpo.md gives the measurements. The one-line swap::

    from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer  # instead of trl's KTOConfig, KTOTrainer

Losses, metrics and data handling are TRL's own; the per-token values equal TRL's (tests/test_kto.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import KTOConfig, KTOTrainer

from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl.arguments import InBatchMergeArguments, TreeLogProbArguments
from hf_tree.trl.preference_logprobs import TreePreferenceLogProbsMixin
from hf_tree.versions import require_tested_trl

require_tested_trl("TreeKTOTrainer")  # the TRL versions its overrides were tested with (hf_tree.versions)


@dataclass
class TreeKTOConfig(TreeLogProbArguments, InBatchMergeArguments, KTOConfig):
    """``KTOConfig`` plus the tree fields (``hf_tree.trl.arguments``): ``tree_forward``, ``max_packed_tokens``,
    ``tree_self_check`` and ``merge_in_batch``."""


class TreeKTOTrainer(FSDPFullSaveMixin, TreePreferenceLogProbsMixin, KTOTrainer):
    """``KTOTrainer`` whose policy, reference and KL log-probs come from packed prompt trees.

    Accepts exactly ``KTOTrainer``'s arguments with ``args`` a ``TreeKTOConfig``. Raises ``ValueError`` for what
    the tree passes do not support: a model (or ``ref_model``) that cannot be switched to ``tree_flash``,
    vision-language families outside ``hf_tree.vision.rows.ROW_FAMILIES`` (image prompts of those go through the tree
    head of GRPO and DPO), and configs that rescale logits. An MoE model's router loss is TRL's, computed on the
    trees.
    """

    tree_config_class = TreeKTOConfig
    trl_name = "KTO"

    def _tree_policy_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy", "mean_logits")  # what KTOTrainer.__init__ asks of its fused head
