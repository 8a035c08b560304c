"""What ``hf-tree sft`` trains on a dataset, for ``hf-tree stats``/``show``: the trainer's own code, not a copy.

- The trees are ``TreeSFTTrainer._prepare_dataset``'s (the method the trainer runs on its dataset: ShareGPT
  conversion, format detection, ``build_tree_dataset`` with the config's ``group_by``, ``messages_branches``,
  ``train_on``, ``assistant_only_loss``, ``dataset_text_field``, then ``completion_only_loss`` and
  ``shuffle_dataset``), given the tokenizer as TRL's ``SFTTrainer.__init__`` leaves it (``eos_token``; the training
  template ``assistant_only_loss`` swaps in).
- The packing options are the config's ``packing_config()`` (``max_branch_tokens`` derived from ``max_length``).
- The micro-batches are its ``TreeRowBatchSampler``'s (``hf_tree.stats.trainer_batches`` with ``trainer_batching``),
  with the batch slots of rows that train nothing (``tree_row_slots``) as the trainer deals them.

So every ``TreeSFTConfig`` default and every flag of ``hf-tree sft`` that changes what trains changes the report the
same way. One difference stays: ``tree_execution="auto"`` falls back to packed rows for a model that cannot run
depth-first (``DepthFirstRunner.plan`` needs the model); the report plans the trees as the config says.
"""

from __future__ import annotations

import copy
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from hf_tree.builders import TreeBuildStats
from hf_tree.stats import ModelShape, TrainerBatching
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer


def sft_config(**fields: Any) -> TreeSFTConfig:
    """``hf-tree sft``'s ``TreeSFTConfig`` with ``fields`` (the rest at their defaults), on the CPU and without
    reporting: what decides the trees and batches does not depend on the device.

    Raises:
        ValueError: as ``TreeSFTConfig`` (naming the field).
    """
    options = dict(use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False)  # none shapes the data
    return TreeSFTConfig(**{**options, **fields})


def sft_tree_rows(
    rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, chat_template: str | None, args: TreeSFTConfig
) -> tuple[datasets.Dataset, TreeBuildStats | None, list[int] | None]:
    """(the tree rows ``TreeSFTTrainer`` trains on ``rows``, what building them did (None for tree rows), its
    ``tree_row_slots``: TRL's rows when some train no token but take a batch slot, else None).

    A copy of ``tokenizer`` is set up as TRL's ``SFTTrainer.__init__`` sets it up before preparing the dataset:
    ``chat_template`` (the text of ``chat_template_path``; None keeps the tokenizer's), then ``eos_token``.

    Raises:
        ValueError: as the trainer (an unknown format, a bad option, an EOS token outside the vocabulary).
    """
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    tokenizer = copy.deepcopy(tokenizer)  # a cached tokenizer stays as it was
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if args.eos_token is not None:  # as SFTTrainer.__init__
        if args.eos_token not in tokenizer.get_vocab():
            raise ValueError(f"eos_token={args.eos_token!r} is not in the tokenizer's vocabulary; pass one that is.")
        tokenizer.eos_token = args.eos_token
    training_template = args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template)
    # the trainer's method reads only its chat_template (and sets tree_build_stats, tree_row_slots): a trainer object
    # without the model, optimizer and accelerator its __init__ would build
    trainer = TreeSFTTrainer.__new__(TreeSFTTrainer)
    trainer.chat_template = get_training_chat_template(tokenizer) if training_template else None
    trees = TreeSFTTrainer._prepare_dataset(trainer, rows, tokenizer, args, args.packing, None, "train")
    return trees, trainer.tree_build_stats, trainer.tree_row_slots


def trainer_batching(args: TreeSFTConfig, slot_trees: list[int] | None = None) -> TrainerBatching:
    """How ``TreeSFTTrainer.get_train_dataloader`` deals ``args``'s rows (``batch_unit="rows"``, one process), with
    ``slot_trees`` its ``tree_row_slots`` (``sft_tree_rows``)."""
    if args.batch_unit != "rows":
        raise ValueError(f"batch_unit={args.batch_unit!r}: hf-tree stats plans batch_unit='rows' (TRL's unit) only.")
    return TrainerBatching(
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        shuffle=args.train_sampling_strategy == "random",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        slot_trees=None if slot_trees is None else tuple(slot_trees),
    )


def model_shape(name: str) -> tuple[ModelShape, str]:
    """(the FLOP estimate's dimensions of model ``name``'s config, where they come from); SmolLM2-135M's when
    ``name`` has no model config (e.g. a tokenizer folder), said in the second item."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:160]
        return ModelShape(), f"SmolLM2-135M's shape: no model config at {name!r} ({reason})"
    return ModelShape.of_config(config), f"{name}'s config"
