"""What the Axolotl plugin (``hf_tree.integrations.axolotl``) hands Axolotl: its collator and its trainer class.

- ``AxolotlTreeCollator``: Axolotl's tokenized rows -> one packed tree batch (``TreeDataCollator``'s layout). Each row
  is one branch, its loss mask ``labels != -100`` (Axolotl's ``train_on_inputs`` and role masking as tokenized); the
  micro-batch's rows merge into tries by their tokens (``PackingConfig.merge_in_batch``).
- ``tree_trainer_class``: ``AxolotlTrainer`` with ``TreeTrainerMixin`` (tree loss, packing logs such as
  ``dedup_ratio``, tree evaluation loss) and the divisor Axolotl's trainer uses, so the update equals Axolotl's.
- ``install_dpo_tree_heads``: for ``rl: dpo``, Axolotl's own ``AxolotlDPOTrainer`` (TRL 1.9's ``DPOTrainer``) once
  created, with the tree head on its policy and reference: TRL's plain ``model(input_ids, attention_mask)`` calls
  are answered from packed trees (each pair's prompt computed once), TRL computes the loss and everything else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from hf_tree.collator import TreeDataCollator
from hf_tree.models.check import self_check_setting
from hf_tree.models.dropout import warn_if_dropout
from hf_tree.packing import PackingConfig
from hf_tree.sft_losses import sft_token_loss
from hf_tree.trainer import TreeTrainerMixin, pad_token_id_of, use_tree_attention
from hf_tree.tree import Tree

logger = logging.getLogger("hf_tree")

IGNORE_INDEX = -100  # Axolotl's (and HF's) label of a token out of the loss


def row_branch(row: dict[str, Any], index: int) -> tuple[np.ndarray, np.ndarray]:
    """One Axolotl row as ``(tokens [L], loss mask [L])``: token k is trained when ``labels[k] != -100`` (k >= 1; HF's
    shifted loss never predicts token 0).

    Raises:
        ValueError: when the row's ``labels`` do not match its ``input_ids`` (a label other than -100 or the token
            itself: a target the tree, whose edges predict the next token, cannot express), or it holds padding.
    """
    tokens = np.asarray(row["input_ids"], dtype=np.int64)
    labels = np.asarray(row["labels"], dtype=np.int64)
    if labels.shape != tokens.shape:
        raise ValueError(
            f"row {index}: labels has {labels.size} entries and input_ids {tokens.size}; the Axolotl plugin needs "
            "Axolotl's SFT rows (labels = input_ids with -100 for tokens out of the loss)."
        )
    mask = labels != IGNORE_INDEX
    wrong = np.flatnonzero(mask[1:] & (labels[1:] != tokens[1:])) + 1
    if wrong.size:
        k = int(wrong[0])
        raise ValueError(
            f"row {index}: labels[{k}]={int(labels[k])} differs from input_ids[{k}]={int(tokens[k])}; the tree loss "
            "trains each token to predict the next one (labels equal to input_ids, -100 out of the loss), as "
            "Axolotl's SFT datasets do. Remove the plugin for datasets with other targets."
        )
    attention_mask = row.get("attention_mask")
    if attention_mask is not None and not np.all(np.asarray(attention_mask)):
        raise ValueError(
            f"row {index} holds padding (attention_mask 0): the plugin takes Axolotl's unpadded rows. Set "
            "pad_to_sequence_len: false and sample_packing: false."
        )
    return tokens, mask.astype(np.int64)


class AxolotlTreeCollator(TreeDataCollator):
    """Axolotl's rows (``input_ids``, ``labels``) -> a ``TreeDataCollator`` batch: ``input_ids``, ``position_ids``,
    ``kv_end`` ``[B, N]``; ``loss_positions``, ``loss_targets``, ``loss_weights`` ``[M]``; ``num_loss_items``.

    Axolotl builds it as ``collator(tokenizer, padding=..., pad_to_multiple_of=..., return_tensors="pt", **plugin
    keywords)``: its padding keywords are for its own padded batches and do not apply (tree rows are laid out by
    ``packing``). A row with no trained token contributes nothing to Axolotl's loss either: it is left out and
    counted in ``num_dropped_trees`` (logged as a running total).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        packing: PackingConfig,
        padding: Any = True,
        pad_to_multiple_of: int | None = None,
        return_tensors: str = "pt",
    ) -> None:
        pad_token_id = pad_token_id_of(tokenizer)
        super().__init__(packing=packing, pad_token_id=0 if pad_token_id is None else pad_token_id)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        trees = []
        for index, row in enumerate(features):
            tokens, mask = row_branch(row, index)
            if mask[1:].any():
                trees.append(Tree.from_sequences([tokens.tolist()], [mask.tolist()]))
        batch = super().__call__(trees)
        batch["num_dropped_trees"] += len(features) - len(trees)
        return batch


class AxolotlTreeTrainerMixin:
    """The Axolotl side of the tree trainer: accepts Axolotl's arguments with the plugin's collator, and divides the
    loss as Axolotl's trainer does.

    ``AxolotlTrainer`` turns ``model_accepts_loss_kwargs`` off for models whose ``forward`` does not name
    ``num_items_in_batch`` (Llama, Qwen, ...): each micro-batch's loss is then its own token mean, divided by the
    gradient accumulation steps (and averaged over ranks by DDP). The tree loss takes the same divisor (the
    micro-batch's trained tokens, ``num_loss_items``); with ``model_accepts_loss_kwargs`` on, the step's global count,
    as Trainer passes it to the model.
    """

    tree_options_self_check: bool = True

    def _tree_training_arguments(self, model: Any, args: Any, data_collator: Any, kwargs: dict[str, Any]) -> Any:
        if not isinstance(data_collator, AxolotlTreeCollator):
            raise ValueError(
                f"the data collator is a {type(data_collator).__name__}, not the hf_tree plugin's: another plugin "
                "listed before hf_tree.integrations.axolotl.TreePlugin supplies the collator. Remove it, or list the "
                "tree plugin first."
            )
        return args

    @property
    def tree_self_check(self) -> bool | None:
        return self_check_setting(self.tree_options_self_check)

    def _init_tree_training(self) -> None:
        self.tree_token_loss = sft_token_loss("nll", self.args.label_smoothing_factor)  # Trainer's LabelSmoother
        warn_if_dropout(self.model, "set lora_dropout: 0 (and the model's dropout probabilities to 0)")
        # Trainer divides a loss not scaled for the whole step by the accumulation steps (transformers >= 5.17 reads
        # this attribute; 5.16 decides by model_accepts_loss_kwargs alone, the same way)
        self.loss_is_scaled_for_ga = self.model_accepts_loss_kwargs
        if not self.model_accepts_loss_kwargs:
            logger.info(
                "hf_tree: the loss of each micro-batch is divided by its own trained tokens, then by "
                "gradient_accumulation_steps, as Axolotl's trainer does for this model (model_accepts_loss_kwargs="
                "False); eval_loss is the token mean over the whole evaluation set."
            )
        super()._init_tree_training()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The tree loss over Axolotl's divisor (see the class docstring)."""
        divisor = num_items_in_batch if self.model_accepts_loss_kwargs else None
        return super().compute_loss(model, inputs, return_outputs, divisor)


def tree_trainer_class(self_check: bool = True) -> type:
    """``AxolotlTrainer`` with the tree loss, as the plugin's ``get_trainer_cls`` returns it (``self_check``: the
    ``tree_self_check`` YAML key)."""
    from axolotl.core.trainers import AxolotlTrainer  # here: the collator above needs no Axolotl

    return type(
        "AxolotlTreeTrainer",
        (AxolotlTreeTrainerMixin, TreeTrainerMixin, AxolotlTrainer),
        {"tree_options_self_check": self_check, "__module__": __name__},
    )


@dataclass(frozen=True)
class TreeDPOHeadArguments:
    """The plugin's YAML keys as ``install_tree_heads`` reads them from a tree trainer's ``args``."""

    max_packed_tokens: int | None
    tree_self_check: bool
    merge_in_batch: bool


@dataclass(frozen=True)
class TreeDPOHeadHost:
    """What ``install_tree_heads`` reads of a trainer: Axolotl's DPO trainer's models with the plugin's settings (its
    ``AxolotlDPOConfig`` has no tree fields)."""

    model: Any
    ref_model: Any
    args: TreeDPOHeadArguments


class TreeStatsCallback(TrainerCallback):
    """Appends the policy head's packing (``tree/dedup_ratio``) to the DPO trainer's metrics after each micro-batch,
    as ``TreeDPOTrainer.compute_loss`` does (TRL's ``log`` averages them over the logging window)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.log_packing()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.log_packing()

    def log_packing(self) -> None:
        from hf_tree.trl.glue import log_tree_stats  # here: the collator above needs no TRL

        log_tree_stats(self.trainer)


def install_dpo_tree_heads(trainer: Any, cfg: Any) -> Any:
    """Put Axolotl's DPO trainer's policy and reference model (a PEFT policy's disabled-adapter pass needs none) on
    ``tree_flash`` and install the tree head answering TRL 1.9's plain calls with tree logits; log its packing.

    Runs after the trainer is created (the plugin's ``post_trainer_create``): a reference precomputed inside TRL's
    ``__init__`` (``precompute_ref_log_probs``) was scored by the model's own forward, which gives the same values.

    Returns:
        The policy's ``hf_tree.trl.glue.TreeFusedHead`` (also ``trainer.tree_head``).
    """
    from hf_tree.trl.glue import install_tree_heads

    use_tree_attention(trainer.model)
    if trainer.ref_model is not None:
        use_tree_attention(trainer.ref_model, "ref_model")
    arguments = TreeDPOHeadArguments(
        max_packed_tokens=cfg.tree_max_packed_tokens,
        tree_self_check=cfg.tree_self_check is not False,
        merge_in_batch=cfg.tree_merge_in_batch is not False,
    )
    host = TreeDPOHeadHost(model=trainer.model, ref_model=trainer.ref_model, args=arguments)
    # TRL 1.9's DPO computes every per-token field from the logits itself: no fused outputs beyond the default
    trainer.tree_head = install_tree_heads(host, ("log_probs",), logits_forward=True)
    trainer.add_callback(TreeStatsCallback(trainer))
    warn_if_dropout(trainer.model, "keep Axolotl's DPO default (dropout disabled) and set lora_dropout: 0")
    return trainer.tree_head
