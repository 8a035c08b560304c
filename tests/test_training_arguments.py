"""Every ``TrainingArguments`` field that changes the loss or the inputs, through ``TreeTrainer`` (issue 25).

Each field is honoured exactly as ``transformers.Trainer`` honours it on the branches run as ordinary sequences
(same seed and settings, float64 tiny Llama, 2 SGD steps of 2 accumulated micro-batches, then one evaluation), or
refused with a ``ValueError`` naming the field and the value, or warned about when it has no effect on tree batches.
The table in docs/training.md ("TrainingArguments fields") lists what each does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_tree import TreeDataCollator
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from hf_tree.trl.dpo import TreeDPOConfig
from hf_tree.trl.grpo import TreeGRPOConfig
from hf_tree.trl.sft import TreeSFTConfig
from tests.helpers import (
    VOCAB,
    branch_loss_func,
    collate_branches,
    common_args,
    float64_norms,
    max_grad_relative_error,
    tiny_model,
    train_and_measure_updates,
)
from tests.workloads import branch_dataset, branch_groups, tree_dataset

TOLERANCE = 1e-8
# Where the reference itself rounds in float32 (a wrong divisor or a missing term moves the updates by > 1e-2):
# Trainer's LabelSmoother sums -log p over the vocabulary in float32 even in a float64 model (transformers 5.24,
# trainer_pt_utils.py; measured 9e-11 here); compiled kernels round the model's float32 parts (HF computes the
# rotary tables in float32) differently for the tree's and the branches' shapes (measured 3.9e-8, 1.6e-14 without
# torch_compile).
FLOAT32_TOLERANCE = 1e-6
TRAIN_GROUPS = branch_groups()
EVAL_GROUPS = branch_groups(seed=3, num_trees=4)  # one evaluation batch: Trainer's eval_loss is then its mean


@dataclass
class Case:
    """One field setting and what the tree trainer must do with it."""

    settings: dict[str, Any]
    expect: str  # "honoured", "refused" (ValueError naming the setting) or "warned" (a warning naming it)
    overrides: dict[str, Any] = field(default_factory=dict)  # run settings the field needs (not under test)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    length_column: bool = False  # both datasets get a "length" column (the branch tokens of each row)
    tolerance: float = TOLERANCE

    @property
    def id(self) -> str:
        """The setting as the errors and warnings write it (``field=value``), or the trainer keyword's name."""
        return ",".join(f"{k}={v!r}" for k, v in self.settings.items()) or ",".join(self.trainer_kwargs)


CASES = [
    Case({"label_smoothing_factor": 0.2}, "honoured", tolerance=FLOAT32_TOLERANCE),
    Case({"include_num_input_tokens_seen": "non_padding"}, "honoured"),
    Case({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}}, "honoured"),
    Case({"train_sampling_strategy": "group_by_length"}, "honoured", length_column=True),
    Case({"dataloader_drop_last": True}, "honoured", overrides=dict(batch_size=5, accumulation=1, max_steps=3)),
    # ~40 s of compiling on CPU
    pytest.param(Case({"torch_compile": True}, "honoured", tolerance=FLOAT32_TOLERANCE), marks=pytest.mark.slow),
    Case({"neftune_noise_alpha": 5.0}, "refused"),
    Case({"use_liger_kernel": True}, "refused"),
    Case({"train_sampling_strategy": "group_by_length"}, "refused"),  # no length column
    Case({}, "refused", trainer_kwargs={"compute_metrics": lambda prediction: {}}),
    Case({}, "refused", trainer_kwargs={"preprocess_logits_for_metrics": lambda logits, labels: logits}),
    Case({"average_tokens_across_devices": False}, "warned"),
    Case({"label_names": ["labels"]}, "warned"),
    Case({"include_num_input_tokens_seen": "all"}, "warned"),
]


def with_length(dataset: datasets.Dataset, groups) -> datasets.Dataset:
    return dataset.add_column("length", [sum(map(len, sequences)) for sequences, _ in groups])


def run(tmp_path, case: Case, tree: bool) -> tuple[Any, dict[str, torch.Tensor], dict[str, float]]:
    """Train (2 steps) and evaluate the tree trainer or the reference Trainer on the branches; the trainer, its
    parameter updates and its evaluation metrics."""
    run_settings = dict(dict(batch_size=1, accumulation=2, max_steps=2), **case.overrides)
    batch_size, accumulation = run_settings.pop("batch_size"), run_settings.pop("accumulation")
    args = common_args(
        tmp_path,
        "tree" if tree else "ref",
        batch_size,
        accumulation,
        per_device_eval_batch_size=len(EVAL_GROUPS),
        **run_settings,
        **case.settings,
    )
    make = tree_dataset if tree else branch_dataset
    train, evaluation = make(TRAIN_GROUPS), make(EVAL_GROUPS)
    if case.length_column:
        train, evaluation = with_length(train, TRAIN_GROUPS), with_length(evaluation, EVAL_GROUPS)
    if tree:
        trainer = TreeTrainer(
            model=tiny_model(vocab_size=VOCAB),
            args=TreeTrainingArguments(**args, max_packed_tokens=24),
            train_dataset=train,
            eval_dataset=evaluation,
            **case.trainer_kwargs,
        )
    else:
        # Trainer's own LabelSmoother is the oracle of label smoothing; otherwise the float64 reference loss
        smoothing = case.settings.get("label_smoothing_factor", 0.0)
        trainer = Trainer(
            model=tiny_model(vocab_size=VOCAB, attn="sdpa"),
            args=TrainingArguments(**args, remove_unused_columns=False),
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=collate_branches,
            compute_loss_func=None if smoothing else branch_loss_func("token", 0),
        )
    updates = train_and_measure_updates(trainer)
    with float64_norms():
        metrics = trainer.evaluate()
    return trainer, updates, metrics


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_field_is_honoured_as_trainer_does_on_branches_or_refused(tmp_path, caplog, case):
    if case.expect == "refused":
        first = case.id.split(",")[0]  # the field under test (the others only complete it)
        with pytest.raises(ValueError, match=first.replace("[", r"\[").replace("(", r"\(")):
            run(tmp_path, case, tree=True)
        return
    if case.expect == "warned":
        with caplog.at_level(logging.WARNING, logger="hf_tree"):
            TreeTrainer(
                model=tiny_model(vocab_size=VOCAB),
                args=TreeTrainingArguments(**common_args(tmp_path, "warned", 2, 1, **case.settings)),
                train_dataset=tree_dataset(TRAIN_GROUPS),
            )
        assert case.id in caplog.text
        return
    reference, ref_updates, ref_metrics = run(tmp_path, case, tree=False)
    tree, tree_updates, tree_metrics = run(tmp_path, case, tree=True)
    tolerance = case.tolerance
    assert ref_updates.keys() == tree_updates.keys()
    assert max(float(u.norm()) for u in ref_updates.values()) > 1e-3  # the reference moved well beyond tolerance
    # per parameter (against at least 1e-6 of the largest update, for near-zero ones)
    assert max_grad_relative_error(tree_updates, ref_updates) <= tolerance
    ref_losses = [h["loss"] for h in reference.state.log_history if "loss" in h]
    tree_losses = [h["loss"] for h in tree.state.log_history if "loss" in h]
    assert len(tree_losses) == len(ref_losses) == reference.state.global_step
    assert tree_losses == pytest.approx(ref_losses, rel=tolerance)
    assert tree_metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=tolerance)
    assert tree.state.num_input_tokens_seen == reference.state.num_input_tokens_seen
    if "include_num_input_tokens_seen" in case.settings:
        assert tree.state.num_input_tokens_seen > 0


@pytest.mark.parametrize("config_class", [TreeTrainingArguments, TreeSFTConfig, TreeGRPOConfig, TreeDPOConfig])
def test_neftune_is_refused_by_every_tree_config(config_class):
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=5\.0.*neftune_noise_alpha=None"):
        config_class(output_dir="unused", use_cpu=True, report_to=[], neftune_noise_alpha=5.0)


def test_neftune_is_refused_with_plain_training_arguments():
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=5\.0"):
        TreeTrainer(
            model=tiny_model(vocab_size=VOCAB),
            args=TrainingArguments(
                output_dir="unused", use_cpu=True, report_to=[], remove_unused_columns=False, neftune_noise_alpha=5.0
            ),
            data_collator=TreeDataCollator(max_packed_tokens=24),
            train_dataset=tree_dataset(TRAIN_GROUPS[:2]),
        )


def test_neftune_runs_trls_own_passes_without_tree_forward():
    """With tree_forward=False TRL's own passes run unchanged, so NEFTune applies as in TRL."""
    config = TreeGRPOConfig(
        output_dir="unused", use_cpu=True, report_to=[], neftune_noise_alpha=5.0, tree_forward=False
    )
    assert config.neftune_noise_alpha == 5.0


def test_drop_last_is_refused_with_row_batches():
    with pytest.raises(ValueError, match="dataloader_drop_last=True"):
        TreeSFTConfig(output_dir="unused", use_cpu=True, report_to=[], dataloader_drop_last=True)
