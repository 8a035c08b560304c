"""What tree trainers do with the ``TrainingArguments`` fields that change the loss or the inputs.

Each such field is honoured exactly as ``transformers.Trainer`` honours it on the branches run as ordinary sequences,
or refused with a ``ValueError`` naming the field, the value and the fix, or warned about when it has no effect on
tree batches. The table in docs/training.md lists every field; tests/test_training_arguments.py checks each.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import datasets
from transformers import TrainingArguments

logger = logging.getLogger("hf_tree")

# The switch of activation checkpointing: transformers 5.16 names it gradient_checkpointing; later releases
# activation_checkpointing, the old name a deprecated alias that counts only while the new one is unset.
CHECKPOINTING = next(
    (f.name for f in dataclasses.fields(TrainingArguments) if f.name == "activation_checkpointing"),
    "gradient_checkpointing",
)
# Samplers that order rows by a length: Trainer infers it from an ``input_ids`` column, which tree rows lack.
LENGTH_SAMPLING_STRATEGIES = ("group_by_length", "batch_rebalance")


def refuse_neftune(args: TrainingArguments) -> None:
    """``ValueError`` when ``neftune_noise_alpha`` is set.

    NEFTune's hook scales its noise by ``1/sqrt(seq_len * dim)`` with the length of the tensor it sees: a packed row
    (several trees, padding included) instead of each branch, so the noise is several times weaker than per-branch
    training's, and a token shared by several branches gets one noise draw where per-branch training draws one per
    branch. Neither can be made per-branch exact on a packed row.
    """
    if args.neftune_noise_alpha is not None:
        raise ValueError(
            f"neftune_noise_alpha={args.neftune_noise_alpha} cannot apply to packed trees: NEFTune scales its noise by "
            "the length of the packed row instead of each branch's and draws one noise per shared token instead of "
            "one per branch. Set neftune_noise_alpha=None (for the TRL tree trainers, or tree_forward=False to "
            "run TRL's own passes)."
        )


def check_tree_trainer_arguments(args: TrainingArguments) -> None:
    """Refuse or warn about the fields a ``TreeTrainer``/``TreeSFTTrainer`` cannot honour as ``Trainer`` does.

    Raises:
        ValueError: for ``neftune_noise_alpha`` and ``use_liger_kernel``.
    """
    refuse_neftune(args)
    if args.use_liger_kernel:
        # Liger swaps the model's RMSNorm/RoPE/SwiGLU for Triton kernels and its loss for a fused cross-entropy on
        # labels; the tree loss never passes labels and the swapped kernels are not checked against tree batches.
        raise ValueError(
            "use_liger_kernel=True is not supported by tree trainers: the tree loss computes its own chunked head "
            "(Liger's fused cross-entropy would not run) and Liger's kernels are untested on packed trees. Set "
            "use_liger_kernel=False."
        )
    if args.label_names is not None:
        logger.warning(
            "label_names=%r has no effect on tree trainers: tree batches carry no labels (loss_targets and "
            "loss_weights come from the tree collator), and evaluation always computes the tree loss.",
            args.label_names,
        )
    if args.include_num_input_tokens_seen == "all":
        logger.warning(
            "include_num_input_tokens_seen='all' counts the tokens the model forwards (packed rows, shared prefixes "
            "once, padding included; depth-first trees' tokens once each), not the branches' tokens; 'non_padding' "
            "counts the branches' tokens, as Trainer does on the branches."
        )


def refuse_metrics_callables(compute_metrics: Any, preprocess_logits_for_metrics: Any) -> None:
    """``ValueError`` for metric callables: tree evaluation returns no logits (a tree position has several
    children), so Trainer would silently never call them."""
    for name, value in (
        ("compute_metrics", compute_metrics),
        ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
    ):
        if value is not None:
            raise ValueError(
                f"{name} is not supported by tree trainers: tree evaluation returns the tree loss and no logits (a "
                f"tree position predicts several children), so {name} would never be called. Remove it; eval_loss is "
                "the exact per-branch loss over the whole evaluation set."
            )


def check_length_column(args: TrainingArguments, train_dataset: Any, eval_dataset: Any) -> None:
    """``ValueError`` when ``train_sampling_strategy`` orders rows by length and a tree dataset it samples has no
    ``length_column_name`` column: Trainer would infer lengths from ``input_ids``, which tree rows do not have. With
    the column, Trainer's sampler orders the tree rows exactly as it orders the same rows of branches."""
    if args.train_sampling_strategy not in LENGTH_SAMPLING_STRATEGIES:
        return
    named = [("train", train_dataset)]
    if args.train_sampling_strategy == "group_by_length":  # Trainer's eval sampler groups by length for this one only
        evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)]
        named += [(f"eval {key}" if key != "eval" else key, dataset) for key, dataset in evals]
    for name, dataset in named:
        if isinstance(dataset, datasets.Dataset) and args.length_column_name not in dataset.column_names:
            raise ValueError(
                f"train_sampling_strategy={args.train_sampling_strategy!r} needs each tree row's length, and the "
                f"{name} dataset has no length_column_name={args.length_column_name!r} column (tree rows have no "
                "input_ids to infer it from). Add that column (e.g. the branch tokens of each row), or set "
                "train_sampling_strategy='random'."
            )
