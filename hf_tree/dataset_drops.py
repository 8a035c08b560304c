"""Before training: what the collator's branch limit leaves of a tree dataset.

The collator applies ``overlong`` per micro-batch (``hf_tree.packing.limit_branch_length``): a branch longer than
``max_branch_tokens`` is truncated (keeping its start) or dropped, and a tree left with no trained token is dropped.
Found only at collation, a dataset whose every tree goes that way would run each step on nothing (loss 0, grad norm
0) and end "completed"; one that loses much of its data would do so with a warning per batch. ``check_dataset_drops``
reads the tree columns once before the first step: nothing left raises ``ValueError``, more than
``DROP_WARNING_SHARE`` of the rows (branches) lost warns once with the tally.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import datasets
import pyarrow.compute as pc

from hf_tree.packing import PackingConfig

logger = logging.getLogger("hf_tree")

DROP_WARNING_SHARE = 0.05
"""Share of a dataset's rows (branches) that, when the branch limit leaves them untrained, is warned about once."""
_COLUMNS = ["node_tokens", "node_parents", "branch_end_nodes", "branch_loss_spans"]


def branch_lengths_by_row(dataset: datasets.Dataset, *columns: str) -> Iterator[tuple[list[int], ...]]:
    """Per ``Tree.to_dict()`` row of ``dataset``: its branch lengths (tokens), then the row's values of ``columns``;
    read column-wise from Arrow (no ``Tree`` is built)."""
    names = ["node_tokens", "node_parents", "branch_end_nodes", *columns]
    for table in dataset.select_columns(names).with_format("arrow").iter(batch_size=4096):
        node_tokens = table.column("node_tokens").combine_chunks()
        node_lengths = pc.list_value_length(node_tokens.flatten()).to_numpy().tolist()
        node_offsets = node_tokens.offsets.to_numpy()
        parents, ends = table.column("node_parents").to_pylist(), table.column("branch_end_nodes").to_pylist()
        values = [table.column(name).to_pylist() for name in columns]
        for row, (row_parents, row_ends) in enumerate(zip(parents, ends)):
            end_depth: list[int] = []  # tokens from the root to each node's end; parents precede children (DFS)
            for length, parent in zip(node_lengths[node_offsets[row] : node_offsets[row + 1]], row_parents):
                end_depth.append(length + (end_depth[parent] if parent >= 0 else 0))
            yield ([end_depth[end] for end in row_ends], *(column[row] for column in values))


def _largest_tree(dataset: datasets.Dataset) -> int:
    """The most tokens of any tree row (no branch is longer), vectorized over Arrow offsets."""
    largest = 0
    for table in dataset.select_columns(["node_tokens"]).with_format("arrow").iter(batch_size=65536):
        node_tokens = table.column("node_tokens").combine_chunks()
        row_offsets = node_tokens.offsets.to_numpy()
        token_offsets = node_tokens.flatten().offsets.to_numpy()
        row_offsets, token_offsets = row_offsets - row_offsets[0], token_offsets - token_offsets[0]
        totals = token_offsets[row_offsets[1:]] - token_offsets[row_offsets[:-1]]
        largest = max(largest, int(totals.max(initial=0)))
    return largest


def _tally(dataset: datasets.Dataset, limit: int, overlong: str) -> tuple[int, int, int, int]:
    """``(rows, rows left untrained, trees, trees left untrained)`` once every branch longer than ``limit`` follows
    ``overlong`` ("truncate": it trains only where its first trained token is within ``limit``; "drop": it is
    gone); a row already trained nothing (its loss spans empty) counts as untrained."""
    num_rows = num_untrained = num_trees = num_dropped_trees = 0
    for lengths, spans in branch_lengths_by_row(dataset, "branch_loss_spans"):
        trained = [
            bool(span) and (length <= limit or (overlong == "truncate" and span[0] < limit))
            for length, span in zip(lengths, spans)
        ]
        num_rows += len(trained)
        num_untrained += trained.count(False)
        num_trees += 1
        num_dropped_trees += not any(trained)
    return num_rows, num_untrained, num_trees, num_dropped_trees


def check_dataset_drops(collator: Any, dataset: Any, name: str = "training") -> None:
    """Refuse a tree dataset that would train nothing, warn once when the branch limit leaves more than
    ``DROP_WARNING_SHARE`` of its rows untrained (each epoch: the same rows every time).

    Free for other collators and datasets (not a ``PackingConfig`` collator, not a map-style dataset of tree rows);
    else one pass over the tree columns (``overlong="error"`` only checks that there are rows: a longer branch is
    refused by name at collation).

    Raises:
        ValueError: when the dataset has no tree, or when every tree would be dropped at collation.
    """
    packing = getattr(collator, "packing", None)
    if not isinstance(packing, PackingConfig) or not isinstance(dataset, datasets.Dataset):
        return
    if not set(_COLUMNS) <= set(dataset.column_names):
        return
    if len(dataset) == 0:
        raise ValueError(
            f"the {name} dataset has no tree rows: training would run on nothing. Check how it was built (the "
            "builders log every dropped row with its reason)."
        )
    if packing.overlong == "error":
        return
    limit = packing.branch_limit
    if _largest_tree(dataset) <= limit:  # no branch is longer: nothing is cut (the usual case, checked cheaply)
        return
    num_rows, num_untrained, num_trees, num_dropped_trees = _tally(dataset, limit, packing.overlong)
    what = (
        f"with overlong={packing.overlong!r} at max_branch_tokens={limit} (TRL's max_length where set), "
        f"{num_untrained} of its {num_rows} rows (branches) train no token and {num_dropped_trees} of its "
        f"{num_trees} trees are dropped whole"
    )
    if num_dropped_trees == num_trees:
        raise ValueError(
            f"every tree of the {name} dataset would be dropped at collation: {what}, so each step would train on "
            "nothing. Raise max_branch_tokens (or max_length, max_packed_tokens), or shorten the rows' untrained "
            "prefixes (prompts)."
        )
    if num_untrained > DROP_WARNING_SHARE * num_rows:
        logger.warning(
            "hf_tree: each epoch of the %s dataset loses more than %.0f%% of its rows: %s (the collator's counts are "
            "logged as num_truncated_branches / num_dropped_branches / num_dropped_trees).",
            name,
            100 * DROP_WARNING_SHARE,
            what,
        )
