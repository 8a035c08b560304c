"""``TreeDataCollator``: a list of ``Tree.to_dict()`` rows -> one packed batch of tensors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch

from hf_tree.packing import PackingConfig, PackingStats, lay_out, plan_packing
from hf_tree.tree import Tree

logger = logging.getLogger("hf_tree")

# The one channel for packing counters: the collator adds these ``PackingStats`` fields to each batch (0-dim
# int64), so trainers can log what packing did even when the collator runs in dataloader worker processes.
# ``num_rows`` is left out: it is the batch's ``input_ids.shape[0]``.
STATS_KEYS = tuple(f.name for f in fields(PackingStats) if f.name != "num_rows")


def pop_packing_stats(batch: dict[str, Any]) -> PackingStats:
    """Remove the counters from a collated batch (so the model never sees them) and return them."""
    stats = PackingStats(**{name: int(batch.pop(name)) for name in STATS_KEYS if name in batch})
    stats.num_rows = int(batch["input_ids"].shape[0]) if "input_ids" in batch else 0
    return stats


class TreeDataCollator:
    """Packs tree rows into ``[B, N]`` rows of at most ``max_packed_tokens`` tokens, as ``plan_packing`` plans them.

    Takes the ``PackingConfig`` fields as keywords (``max_packed_tokens``, ``normalization``, ``max_branch_tokens``,
    ``overlong``, ``pad_to_multiple_of``, ``tree_execution``; see ``PackingConfig`` for their meaning) or a ready
    ``packing=`` config, and ``pad_token_id``: the token id written into padding (never attended to from real tokens,
    never scored).

    Output keys (docs/design.md): ``input_ids``, ``position_ids``, ``kv_end`` (int32) ``[B, N]``;
    ``loss_positions``, ``loss_targets`` ``[M]``; ``loss_weights`` ``[M]`` float64; ``num_loss_items``
    (0-dim float64, depth-first trees included); ``depth_first_trees`` (a list of ``Tree``, only when
    ``tree_execution`` leaves some trees to depth-first execution); plus the counters in ``STATS_KEYS`` (0-dim int64,
    read back with ``pop_packing_stats``).
    """

    def __init__(self, *args: Any, pad_token_id: int = 0, packing: PackingConfig | None = None, **options: Any):
        if packing is not None and (args or options):
            raise ValueError("TreeDataCollator: pass either packing=PackingConfig(...) or its fields, not both.")
        if packing is None and not args and "max_packed_tokens" not in options:
            raise TypeError("TreeDataCollator needs max_packed_tokens=... (or packing=PackingConfig(...)).")
        self.packing = packing if packing is not None else PackingConfig(*args, **options)
        self.pad_token_id = pad_token_id

    def __getattr__(self, name: str) -> Any:
        """The packing options read as attributes (``collator.max_packed_tokens``, ...)."""
        if name != "packing" and name in PackingConfig.__dataclass_fields__:
            return getattr(self.packing, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"TreeDataCollator({self.packing!r}, pad_token_id={self.pad_token_id})"

    def __call__(self, features: Sequence[dict[str, Any] | Tree]) -> dict[str, torch.Tensor]:
        trees = [f if isinstance(f, Tree) else Tree.from_dict(f, row=row) for row, f in enumerate(features)]
        plan = plan_packing(trees, self.packing, where="batch row")
        stats = plan.stats
        if stats.num_truncated_branches or stats.num_dropped_branches or stats.num_dropped_trees:
            logger.warning(
                "TreeDataCollator: in this batch %d branches truncated and %d dropped for exceeding "
                "max_branch_tokens=%d, %d trees dropped (no trained token left); the trainer logs running totals.",
                stats.num_truncated_branches,
                stats.num_dropped_branches,
                self.packing.branch_limit,
                stats.num_dropped_trees,
            )
        batch, _ = lay_out(plan, self.packing.normalization, self.pad_token_id)
        for name in STATS_KEYS:
            batch[name] = torch.tensor(getattr(stats, name), dtype=torch.int64)
        return batch
