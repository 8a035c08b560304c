"""Batches of trees that hold as many rows (samples) per optimizer step as TRL's batches.

A TRL script's ``per_device_train_batch_size`` counts dataset rows: 20 prompt/completion rows (5 prompts x 4
completions) at batch size 4 make 5 optimizer steps per epoch. After merging, the same data is 5 trees of 4 branches;
counting trees, batch size 4 would make 2 steps of 16 rows each, a silently different recipe.
``TreeRowBatchSampler`` keeps TRL's unit (``batch_unit="rows"``):

1. the trees of an epoch, in sampling order, are assigned to optimizer steps by their cumulative row count: a tree
   whose first row is row ``s`` of the epoch goes to step ``s // rows_per_step``, with ``rows_per_step =
   per_device_train_batch_size x gradient_accumulation_steps x ranks``; a group is never cut across steps (a step
   with fewer rows than micro-batches joins the next one);
2. a step's branches, in order, are dealt into its micro-batches in contiguous runs of near-equal size. A tree cut
   between two micro-batches of one step becomes two trees of its branches (``Tree.select_branches``: weights stay
   exact, the shared prefix is computed once per part), and the loss divisor is the whole step's, so the update is
   the step's exactly. The epoch's last step, when it holds fewer rows than micro-batches, has one micro-batch per
   tree instead, each whole (Trainer runs a shorter last accumulation window), rather than one row per micro-batch.

An epoch then has about ``ceil(rows / rows_per_step)`` steps, as TRL's, and exactly TRL's batches when each group's
size divides the rows per step (or the other way round) and the order is the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from hf_tree.tree import Tree

BATCH_UNITS = ("rows", "trees")


class TreePart(NamedTuple):
    """Branches ``[first, last)`` of tree ``tree`` (the whole tree when they are all of its branches)."""

    tree: int
    first: int
    last: int


def plan_row_batches(
    order: Sequence[int], num_rows: Sequence[int], rows_per_batch: int, batches_per_step: int, ranks: int = 1
) -> list[list[TreePart]]:
    """Micro-batches of tree parts, ``batches_per_step`` consecutive ones per optimizer step (see module doc).

    Args:
        order: tree indices in sampling order.
        num_rows: rows (branches) of each tree, indexed by tree.
        rows_per_batch: rows per micro-batch (TRL's ``per_device_train_batch_size``).
        batches_per_step: micro-batches per optimizer step (gradient accumulation steps x ranks).
        ranks: data-parallel ranks (the epoch's short last step keeps one micro-batch per rank where it has the rows).

    Returns:
        Non-empty micro-batches; every step but the epoch's last has exactly ``batches_per_step`` of them.
    """
    rows_per_step = rows_per_batch * batches_per_step
    steps: list[list[int]] = []
    current, start = -1, 0
    for tree in order:
        if start // rows_per_step != current:
            steps.append([])
            current = start // rows_per_step
        steps[-1].append(int(tree))
        start += int(num_rows[tree])
    merged: list[list[int]] = []
    carry: list[int] = []
    for trees in steps:  # a step with fewer rows than micro-batches cannot fill them: join the next step
        carry += trees
        if sum(int(num_rows[t]) for t in carry) >= batches_per_step:
            merged.append(carry)
            carry = []
    if carry:
        merged.append(carry)
    return [batch for trees in merged for batch in _step_batches(trees, num_rows, batches_per_step, ranks)]


def _step_batches(trees: list[int], num_rows: Sequence[int], batches_per_step: int, ranks: int) -> list[list[TreePart]]:
    """One step's micro-batches: its branches, in order, dealt in contiguous runs of near-equal size into
    ``batches_per_step`` micro-batches. The epoch's last step may hold fewer rows than that: dealing them one per
    micro-batch would cut every group into single branches (nothing shared), so it gets one micro-batch per tree,
    whole (or, with fewer trees than ``ranks``, one run per rank where it has the rows)."""
    rows = sum(int(num_rows[t]) for t in trees)
    num_batches = min(batches_per_step, rows)
    if rows < batches_per_step:
        num_batches = max(len(trees), min(ranks, rows))
        if num_batches == len(trees):
            return [[TreePart(tree, 0, int(num_rows[tree]))] for tree in trees]
    branches = [(tree, branch) for tree in trees for branch in range(int(num_rows[tree]))]
    batches: list[list[TreePart]] = []
    for run in np.array_split(np.arange(len(branches)), num_batches):
        parts: list[TreePart] = []
        for index in run.tolist():
            tree, branch = branches[index]
            if parts and parts[-1].tree == tree:
                parts[-1] = parts[-1]._replace(last=branch + 1)
            else:
                parts.append(TreePart(tree, branch, branch + 1))
        batches.append(parts)
    return batches


class TreeOrder(Sampler[int]):
    """Tree indices in sampling order: shuffled per epoch (``seed + epoch``, the same on every rank) or in order."""

    def __init__(self, num_trees: int, shuffle: bool, seed: int) -> None:
        self.num_trees, self.shuffle, self.seed, self.epoch = num_trees, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_trees))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_trees, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_trees


class TreeRowBatchSampler(Sampler[list[TreePart]]):
    """Batch sampler of ``TreePart`` lists (``plan_row_batches`` over ``sampler``'s order each epoch).

    Args:
        num_rows: rows (branches) of each tree (``len(row["branch_end_nodes"])``).
        rows_per_batch: ``per_device_train_batch_size``.
        batches_per_step: ``gradient_accumulation_steps x`` data-parallel ranks (accelerate deals the micro-batches
            to the ranks in turn).
        ranks: the data-parallel ranks (``plan_row_batches``).
        shuffle, seed: see ``TreeOrder`` (``sampler``; accelerate calls its ``set_epoch``).
        slot_trees: when given, the dataset's slots in order: the tree of each, or -1 for a row that trains nothing
            but takes a batch slot, as in TRL's batches (``TreeSFTTrainer.tree_row_slots``: a text row of one
            token). The slots are sampled and dealt (one row for a -1 slot); the batches hold the trees of theirs.
    """

    def __init__(
        self,
        num_rows: Sequence[int],
        rows_per_batch: int,
        batches_per_step: int,
        shuffle: bool,
        seed: int,
        ranks: int = 1,
        slot_trees: Sequence[int] | None = None,
    ) -> None:
        if rows_per_batch < 1 or batches_per_step < 1:
            raise ValueError(
                f"rows_per_batch={rows_per_batch} and batches_per_step={batches_per_step} must be >= 1 "
                "(per_device_train_batch_size, gradient_accumulation_steps)."
            )
        if slot_trees is not None:
            num_rows = [num_rows[tree] if tree >= 0 else 1 for tree in slot_trees]
        self.num_rows = np.asarray(num_rows, dtype=np.int64)  # of each tree, or each slot
        self.rows_per_batch, self.batches_per_step, self.ranks = rows_per_batch, batches_per_step, ranks
        self.slot_trees = slot_trees
        self.sampler = TreeOrder(len(self.num_rows), shuffle, seed)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def batches(self) -> list[list[TreePart]]:
        """This epoch's micro-batches (deterministic in the seed and epoch)."""
        batches = plan_row_batches(
            list(self.sampler), self.num_rows, self.rows_per_batch, self.batches_per_step, self.ranks
        )
        if self.slot_trees is None:
            return batches
        trees = self.slot_trees
        return [[part._replace(tree=trees[part.tree]) for part in batch if trees[part.tree] >= 0] for batch in batches]

    def __iter__(self) -> Iterator[list[TreePart]]:
        yield from self.batches()

    def __len__(self) -> int:
        return len(self.batches())


class TreePartDataset(Dataset):
    """``dataset[TreePart]``: the tree row itself when the part is the whole tree, else a ``Tree`` of its branches
    (``TreeDataCollator`` takes both)."""

    def __init__(self, trees: Any) -> None:
        self.trees = trees

    def __len__(self) -> int:
        return len(self.trees)

    def __getitem__(self, part: TreePart) -> dict[str, Any] | Tree:
        row = self.trees[part.tree]
        if part.first == 0 and part.last == len(row["branch_end_nodes"]):
            return row
        return Tree.from_dict(row, row=part.tree).select_branches(range(part.first, part.last))
