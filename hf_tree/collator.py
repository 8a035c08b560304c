"""``TreeDataCollator``: a list of ``Tree.to_dict()`` rows -> one packed batch of tensors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_tree.packing import (
    PackingStats,
    check_packing_options,
    limit_branch_length,
    pack_trees,
)
from hf_tree.tree import Tree

logger = logging.getLogger("hf_tree")

# Batch keys the collator adds beside the model inputs, so trainers can log what packing did even when
# the collator runs in dataloader worker processes.
STATS_KEYS = (
    "num_trees",
    "num_split_trees",
    "num_tree_parts",
    "num_truncated_branches",
    "num_dropped_branches",
    "num_dropped_trees",
    "num_tree_tokens",
    "num_branch_tokens",
    "num_padding_tokens",
)


@dataclass
class TreeDataCollator:
    """Packs tree rows into ``[B, N]`` rows of at most ``max_packed_tokens`` tokens.

    Output keys (docs/design.md): ``input_ids``, ``position_ids``, ``kv_end`` (int32) ``[B, N]``;
    ``loss_positions``, ``loss_targets`` ``[M]``; ``loss_weights`` ``[M]`` float64; ``num_loss_items``
    (0-dim float64); plus the counters in ``STATS_KEYS`` (0-dim int64) for logging.
    """

    max_packed_tokens: int
    """Row capacity in tokens; trees larger than this are split by their branches."""
    normalization: str = "token"
    """``"token"``: mean over trained tokens (HF/TRL default); ``"sequence"``: mean over branches of each
    branch's mean token loss."""
    max_branch_tokens: int | None = None
    """Longest allowed branch (defaults to ``max_packed_tokens``)."""
    overlong: str = "error"
    """What to do with a longer branch: ``"error"``, ``"drop"`` or ``"truncate"`` (both counted and logged)."""
    pad_to_multiple_of: int | None = None
    """Round the row length up to a multiple of this (e.g. 64 for kernels)."""
    pad_token_id: int = 0
    """Token id written into padding (never attended to from real tokens, never scored)."""
    stats: PackingStats = field(default_factory=PackingStats, init=False, repr=False)
    """Running totals over all batches this collator made in this process."""

    def __post_init__(self) -> None:
        self.max_branch_tokens = check_packing_options(
            self.max_packed_tokens,
            self.max_branch_tokens,
            self.overlong,
            self.normalization,
            self.pad_to_multiple_of,
        )

    def __call__(self, features: Sequence[dict[str, Any] | Tree]) -> dict[str, torch.Tensor]:
        batch_stats = PackingStats()
        trees = []
        for row, feature in enumerate(features):
            tree = feature if isinstance(feature, Tree) else Tree.from_dict(feature, row=row)
            tree = limit_branch_length(
                tree, self.max_branch_tokens, self.overlong, batch_stats, where=f"batch row {row}"
            )
            if tree is not None:
                trees.append(tree)
        batch, packed_stats = pack_trees(
            trees, self.max_packed_tokens, self.normalization, self.pad_to_multiple_of, self.pad_token_id
        )
        packed_stats.num_trees = len(features)
        for name in ("num_truncated_branches", "num_dropped_branches", "num_dropped_trees"):
            setattr(packed_stats, name, getattr(batch_stats, name))
        self.stats.add(packed_stats)
        if batch_stats.num_truncated_branches or batch_stats.num_dropped_branches or batch_stats.num_dropped_trees:
            logger.warning(
                "TreeDataCollator: in this batch %d branches truncated and %d dropped for exceeding "
                "max_branch_tokens=%d, %d trees dropped (no trained token left); totals so far: %d "
                "truncated, %d dropped, %d trees dropped.",
                batch_stats.num_truncated_branches,
                batch_stats.num_dropped_branches,
                self.max_branch_tokens,
                batch_stats.num_dropped_trees,
                self.stats.num_truncated_branches,
                self.stats.num_dropped_branches,
                self.stats.num_dropped_trees,
            )
        for name in STATS_KEYS:
            batch[name] = torch.tensor(getattr(packed_stats, name), dtype=torch.int64)
        return batch
