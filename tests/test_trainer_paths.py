"""Documented TreeTrainer paths against transformers.Trainer on the unrolled branches (float64, tiny Llama): clipping
on (TRL's and Trainer's default ``max_grad_norm=1.0``), and depth-first execution through the trainer with label
smoothing, ``"sequence"`` normalization and an incomplete last accumulation window.

Oracle: ``Trainer`` on each group's branches padded into a flat batch (``collate_branches``) with the reference loss
``branch_loss_func`` (label smoothing as transformers' ``LabelSmoother``); same sampler seed and batch sizes, so each
optimizer step sees the same branches. Depth-first: every tree in units of at most 12 tokens.
"""

from __future__ import annotations

import pytest
from transformers import Trainer, TrainingArguments

from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from tests.helpers import (
    VOCAB,
    branch_loss_func,
    collate_branches,
    common_args,
    float64_norms,
    relative_error,
    tiny_model,
)
from tests.workloads import BRANCHES_PER_TREE, branch_dataset, branch_groups, tree_dataset

TOLERANCE = 1e-8
SHARED = ("max_grad_norm", "max_steps", "num_train_epochs")  # options of both trainers (the rest: the tree's)
DEPTH_FIRST = dict(tree_execution="depth_first", max_packed_tokens=12, max_branch_tokens=24)
# name: (TreeTrainingArguments fields beyond common_args, trees, batch size, accumulation steps)
CASES = {
    "clipped_packed": (dict(max_grad_norm=1.0, max_packed_tokens=24), 6, 2, 1),
    "clipped_depth_first": (dict(DEPTH_FIRST, max_grad_norm=1.0), 6, 2, 1),
    # (the reference smooths in its loss: its Trainer keeps label_smoothing_factor=0)
    "label_smoothing_depth_first": (dict(DEPTH_FIRST, label_smoothing_factor=0.1, max_steps=1), 4, 2, 2),
    "sequence_depth_first": (dict(DEPTH_FIRST, normalization="sequence", max_steps=1), 4, 2, 2),
    # 3 micro-batches of one tree, 2 per window, one epoch: the last optimizer step holds one micro-batch (its own
    # divisor)
    "incomplete_window_depth_first": (dict(DEPTH_FIRST, max_steps=-1, num_train_epochs=1), 3, 1, 2),
}


def run(trainer) -> dict:
    with float64_norms():
        trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_path_matches_trainer_on_branches(tmp_path, case):
    options, num_trees, batch_size, accumulation = CASES[case]
    groups = branch_groups(num_trees=num_trees)
    tree_options = {k: v for k, v in options.items() if k not in SHARED}
    shared = {k: v for k, v in options.items() if k in SHARED}
    normalization = options.get("normalization", "token")
    tree = TreeTrainer(
        model=tiny_model(vocab_size=VOCAB),
        args=TreeTrainingArguments(**common_args(tmp_path, "tree", batch_size, accumulation, **shared), **tree_options),
        train_dataset=tree_dataset(groups),
    )
    reference = Trainer(
        model=tiny_model(vocab_size=VOCAB, attn="sdpa"),
        args=TrainingArguments(
            **common_args(tmp_path, "ref", batch_size, accumulation, **shared), remove_unused_columns=False
        ),
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
        compute_loss_func=branch_loss_func(
            normalization, BRANCHES_PER_TREE * batch_size * accumulation, options.get("label_smoothing_factor", 0.0)
        ),
    )
    initial = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    expected, updated = run(reference), run(tree)
    assert max(relative_error(expected[n], initial[n]) for n in initial) > 1e-3  # the steps moved the weights
    assert max(relative_error(updated[n], expected[n]) for n in expected) <= TOLERANCE
    ref_logs = [h for h in reference.state.log_history if "loss" in h]
    tree_logs = [h for h in tree.state.log_history if "loss" in h]
    assert [h["loss"] for h in tree_logs] == pytest.approx([h["loss"] for h in ref_logs], rel=1e-9)
    if "max_grad_norm" in options:  # clipping rescaled the updates compared
        assert max(h["grad_norm"] for h in ref_logs) > options["max_grad_norm"]
    if case.startswith("incomplete"):
        assert len(tree_logs) == 2 and tree.state.global_step == 2
