"""What ``TreeDPOTrainer`` and ``TreeKTOTrainer`` share: TRL's offline preference trainers run every log-prob pass
(policy, reference, the precomputed reference, KTO's KL pass) through the fused LM head that their ``__init__``
installs, so the tree trainers only replace that head (``hf_tree.trl.glue.install_tree_heads``) before the first
pass, and log the packing of the policy pass.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

from hf_tree.models.dropout import warn_if_dropout
from hf_tree.models.quantization import log_quantized_base
from hf_tree.trainer import use_tree_attention
from hf_tree.trl.compat import has_fused_lm_head
from hf_tree.trl.glue import TreeFusedHead, install_tree_heads, log_tree_stats, prepare_trl_args


class TreePreferenceLogProbsMixin:
    """Placed before TRL's ``DPOTrainer``/``KTOTrainer`` in the bases. The subclass names its tree config
    (``tree_config_class``, TRL's config plus ``TreeLogProbArguments``), TRL's name of the method (``trl_name``, for
    the default output folder) and the policy's fused-head fields (``_tree_policy_outputs``).

    Attributes:
        tree_head: the policy's tree fused head (its ``layout_stats`` are logged); ``None`` until it is installed and
            with ``tree_forward=False``.
    """

    tree_config_class: type
    trl_name: str
    tree_head: TreeFusedHead | None = None

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, **kwargs: Any) -> None:
        """TRL's arguments; ``args`` must be a ``tree_config_class``. The model (and a ``ref_model`` instance) is put
        on ``tree_flash`` as ``TreeSFTTrainer`` does (a name loads with it, an instance is switched with a warning)."""
        args = prepare_trl_args(args, self.tree_config_class, model, self.trl_name)
        if args.tree_forward and ref_model is not None and not isinstance(ref_model, str):
            use_tree_attention(ref_model, "ref_model")
        super().__init__(model, ref_model, args, **kwargs)
        self._install_tree_heads()
        log_quantized_base(self.model)
        if self.args.tree_forward:
            warn_if_dropout(self.model, f"keep disable_dropout=True ({self.trl_name}Config's default)")

    def _tree_policy_outputs(self) -> tuple[str, ...]:
        """The per-token fields TRL's trainer reads from the policy's fused head (the reference reads
        ``log_probs``)."""
        raise NotImplementedError

    def _install_tree_heads(self) -> None:
        """Put the tree fused head on the policy (and reference); runs before the first log-prob pass, which may
        be the reference precompute inside TRL's ``__init__``."""
        if self.tree_head is not None or not self.args.tree_forward:
            return
        # Image prompts: the fused head splits TRL's image inputs per image (hf_tree.vision.rows) and refuses
        # families outside ROW_FAMILIES (check_tree_model) and image inputs it does not know, before any pass.
        # TRL 1.9 reads the logits of plain calls itself: the heads answer those from the trees (hf_tree.trl.compat)
        self.tree_head = install_tree_heads(self, self._tree_policy_outputs(), logits_forward=not has_fused_lm_head())

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        log_tree_stats(self)
        return loss

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        self._install_tree_heads()
        return super()._precompute_ref_logps(dataset, name, batch_size)
