"""Packing trees into rows: branch limits, splitting oversized trees, best-fit bin packing, DFS layout.

``PackingConfig`` holds the options, ``plan_packing`` decides the rows (``TreeDataCollator`` and ``hf-tree stats``
both use it) and ``lay_out`` writes a plan as a batch. The output of ``pack_trees`` is exactly the batch contract
of docs/design.md: ``input_ids``, depth ``position_ids``, ``kv_end`` and the loss gather
(``loss_positions``/``loss_targets``/``loss_weights``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from hf_tree.tree import Tree, dedup_ratio

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("hf_tree")

Normalization = Literal["token", "sequence"]
OverlongPolicy = Literal["error", "drop", "truncate"]
TreeExecution = Literal["packed", "auto", "depth_first"]
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
OVERLONG_POLICIES: tuple[str, ...] = get_args(OverlongPolicy)
TREE_EXECUTIONS: tuple[str, ...] = get_args(TreeExecution)
# The batch key of the trees a collator leaves to depth-first execution (a list of ``Tree``; absent when none).
DEPTH_FIRST_KEY = "depth_first_trees"


def check_max_packed_tokens(value: Any, none_allowed: bool = False) -> None:
    """The one rule of every ``max_packed_tokens`` option: an integer >= 2 (a row holds at least one scored token
    and the token that predicts it), or ``None`` where ``none_allowed`` (the TRL configs: the tokens of one TRL
    forward).

    Raises:
        ValueError: naming the field, the bad value and what it must be.
    """
    if value is None and none_allowed:
        return
    if not isinstance(value, int) or value < 2:
        raise ValueError(f"max_packed_tokens={value!r} must be an integer >= 2{', or None' if none_allowed else ''}.")


@dataclass(frozen=True)
class PackingConfig:
    """The packing options, defined once: the collator, the trainers' arguments (``TreeArguments`` derives its
    flat fields from these), the ``hf-tree`` CLI flags and ``hf-tree stats`` all read them from here.

    Each field's ``metadata`` holds its ``help`` and, for ``Literal`` fields, its ``choices`` (``get_args``).
    """

    max_packed_tokens: int = field(
        default=4096,
        metadata={
            "help": "Capacity of one packed row in tokens. The trees of a micro-batch are bin-packed into rows of at "
            "most this many (deduplicated) tokens; a larger tree is split by its branches (exact, the shared prefix "
            "is repeated). Bounds activation memory the way max_length does for flat sequences."
        },
    )
    normalization: Normalization = field(
        default="token",
        metadata={
            "help": f"Loss normalization, one of {NORMALIZATIONS}. 'token' (HF/TRL default): mean over all trained "
            "tokens of the optimizer step (all micro-batches and ranks). 'sequence': mean over trained branches of "
            "each branch's mean token loss.",
            "choices": list(NORMALIZATIONS),
        },
    )
    max_branch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Longest allowed branch (one sample) in tokens; defaults to max_packed_tokens. Longer branches "
            "follow `overlong`. May exceed max_packed_tokens unless tree_execution='packed': a tree holding such a "
            "branch then runs depth-first."
        },
    )
    overlong: OverlongPolicy = field(
        default="error",
        metadata={
            "help": f"What to do with a branch longer than max_branch_tokens: one of {OVERLONG_POLICIES}. 'truncate' "
            "and 'drop' are counted, warned about and logged (num_truncated_branches / num_dropped_branches).",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Round each batch's row length up to a multiple of this (e.g. 64 for GPU kernels)."},
    )
    tree_execution: TreeExecution = field(
        default="packed",
        metadata={
            "help": f"How trees run, one of {TREE_EXECUTIONS}. 'packed': bin-packed rows; a tree larger than "
            "max_packed_tokens is split by its branches (its shared prefix recomputed per part). 'auto': such trees "
            "run depth-first instead (docs/depth_first.md: every shared prefix computed once, activation memory of "
            "one root-to-leaf path, forwards of at most max_packed_tokens tokens); the others are packed. "
            "'depth_first': every tree runs depth-first. Depth-first runs in TreeTrainer/TreeSFTTrainer on one "
            "process or under DDP/FSDP2, without fp16 loss scaling. The trainers default to 'auto' and, where their "
            "setup cannot run depth-first (DeepSpeed, context parallel, fp16, image trees, ...), run 'packed' and log "
            "why; an explicit 'depth_first' is refused there.",
            "choices": list(TREE_EXECUTIONS),
        },
    )
    merge_in_batch: bool = field(
        default=True,
        metadata={
            "help": "Merge the branches of all trees of each micro-batch (one collator call) into tries by their "
            "tokens before packing, so rows that share a prefix (a system prompt, tool schemas, earlier turns) "
            "compute it once, across conversations, pairs and groups. The batch and its loss are unchanged (weights "
            "and divisors are per branch); False packs each tree as it is."
        },
    )

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field, the bad value and the fix."""
        check_max_packed_tokens(self.max_packed_tokens)
        limit = self.branch_limit
        if self.tree_execution == "packed" and not (isinstance(limit, int) and 2 <= limit <= self.max_packed_tokens):
            raise ValueError(
                f"max_branch_tokens={limit!r} must be an integer in [2, max_packed_tokens="
                f"{self.max_packed_tokens}]: a branch must fit in one row (or set tree_execution='auto')."
            )
        if not isinstance(limit, int) or limit < 2:
            raise ValueError(f"max_branch_tokens={limit!r} must be an integer >= 2.")
        for name, choices in (
            ("overlong", OVERLONG_POLICIES),
            ("normalization", NORMALIZATIONS),
            ("tree_execution", TREE_EXECUTIONS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {choices}.")
        if self.merge_in_batch not in (True, False):  # 0/1 from an int flag are accepted
            raise ValueError(f"merge_in_batch={self.merge_in_batch!r} must be True or False.")
        object.__setattr__(self, "merge_in_batch", bool(self.merge_in_batch))
        multiple = self.pad_to_multiple_of
        if multiple is not None and (not isinstance(multiple, int) or multiple < 1):
            raise ValueError(f"pad_to_multiple_of={multiple!r} must be a positive integer or None.")

    @property
    def branch_limit(self) -> int:
        """``max_branch_tokens``, defaulting to ``max_packed_tokens``."""
        return self.max_packed_tokens if self.max_branch_tokens is None else self.max_branch_tokens

    def runs_depth_first(self, tree: Tree) -> bool:
        """Whether ``tree`` runs depth-first rather than in a packed row (``tree_execution``; ``"auto"``: when it is
        larger than a row)."""
        if self.tree_execution == "auto":
            return tree.num_tokens > self.max_packed_tokens
        return self.tree_execution == "depth_first"


def packed_fallback(packing: PackingConfig, why: str) -> PackingConfig:
    """``packing`` with ``tree_execution="auto"`` run as ``"packed"`` because the setup cannot run depth-first
    (``why``), logged in one line. The branch limit is capped at the row (a packed row holds whole branches): longer
    branches then follow ``overlong`` (an error by default, else counted and reported)."""
    assert packing.tree_execution == "auto", packing.tree_execution
    limit = min(packing.branch_limit, packing.max_packed_tokens)
    capped = f"; branches longer than {limit} tokens follow overlong={packing.overlong!r}"
    logger.warning(
        "hf_tree: tree_execution='auto' runs as 'packed' here (%s): trees larger than max_packed_tokens=%d are split "
        "by their branches, their shared prefixes recomputed per part%s.",
        why,
        packing.max_packed_tokens,
        capped if packing.branch_limit > limit else "",
    )
    return replace(packing, tree_execution="packed", max_branch_tokens=limit)


@dataclass
class PackingStats:
    """Counts of what packing did; every input branch is trained, split, truncated or counted as dropped."""

    num_trees: int = 0
    """Input trees."""
    num_split_trees: int = 0
    """Input trees larger than ``max_packed_tokens``, split into several parts by their branches."""
    num_tree_parts: int = 0
    """Trees placed in rows (a split tree counts once per part)."""
    num_truncated_branches: int = 0
    """Branches cut to ``max_branch_tokens`` (policy ``truncate``)."""
    num_dropped_branches: int = 0
    """Branches longer than ``max_branch_tokens`` left out (policy ``drop``)."""
    num_dropped_trees: int = 0
    """Trees left with no trained token after dropping/truncating branches."""
    num_rows: int = 0
    num_tree_tokens: int = 0
    """Packed (deduplicated) tokens, padding excluded."""
    num_branch_tokens: int = 0
    """Tokens per-branch training would process for the same branches."""
    num_padding_tokens: int = 0

    def add(self, other: PackingStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def padding_fraction(self) -> float:
        total = self.num_tree_tokens + self.num_padding_tokens
        return self.num_padding_tokens / total if total else 0.0

    @property
    def dedup_ratio(self) -> float:
        return dedup_ratio(self.num_branch_tokens, self.num_tree_tokens)


@dataclass
class PackingPlan:
    """What one collator call packs: the rows' tree parts in layout order, the padded row length and the counters.

    ``TreeDataCollator`` lays this plan out (``lay_out``) and ``hf-tree stats`` reports it, so both agree by
    construction.
    """

    rows: list[list[Tree]]
    """Tree parts of each row, in layout order (an empty batch is one padding row)."""
    row_length: int
    """``N``: the longest row rounded up to ``pad_to_multiple_of`` (at least 1)."""
    stats: PackingStats
    depth_first: list[Tree] = field(default_factory=list)
    """Trees left whole to depth-first execution (``PackingConfig.tree_execution``), outside the rows."""


def plan_packing(trees: Sequence[Tree], packing: PackingConfig, where: str = "tree", first: int = 0) -> PackingPlan:
    """Apply the branch limit, split oversized trees (or leave them to depth-first execution) and bin-pack the parts
    into rows.

    Args:
        trees: one batch of trees (one collator call).
        packing: the options.
        where, first: tree ``i`` is named ``f"{where} {first + i}"`` in errors about overlong branches.

    Raises:
        ValueError: on a branch longer than ``max_branch_tokens`` with ``overlong="error"``.
    """
    stats = PackingStats(num_trees=len(trees))
    parts: list[Tree] = []
    depth_first: list[Tree] = []
    limited = [
        limit_branch_length(tree, packing.branch_limit, packing.overlong, stats, where=f"{where} {first + i}")
        for i, tree in enumerate(trees)
    ]
    limited = [tree for tree in limited if tree is not None]
    for tree in merge_trees(limited) if packing.merge_in_batch else limited:
        if packing.runs_depth_first(tree):
            depth_first.append(tree)
            continue
        split = split_tree(tree, packing.max_packed_tokens)
        stats.num_split_trees += len(split) > 1
        parts.extend(split)
    bins = best_fit_decreasing([p.num_tokens for p in parts], packing.max_packed_tokens) or [[]]
    rows = [[parts[i] for i in b] for b in bins]
    row_length = max(sum(p.num_tokens for p in row) for row in rows) or 1
    if packing.pad_to_multiple_of:
        row_length = -(-row_length // packing.pad_to_multiple_of) * packing.pad_to_multiple_of
    stats.num_tree_parts = len(parts) + len(depth_first)
    stats.num_rows = len(rows)
    stats.num_tree_tokens = sum(p.num_tokens for p in (*parts, *depth_first))
    stats.num_branch_tokens = sum(p.num_branch_tokens for p in (*parts, *depth_first))
    stats.num_padding_tokens = len(rows) * row_length - sum(p.num_tokens for p in parts)
    return PackingPlan(rows, row_length, stats, depth_first)


def merge_trees(trees: Sequence[Tree]) -> list[Tree]:
    """The branches of ``trees`` merged into tries by their tokens: one trie per first token and set of per-branch
    field names (branches carrying different fields cannot share a tree), in order of first appearance.

    Every branch keeps its tokens, loss mask and fields, so weights (``token`` and ``sequence``) and divisors are
    those of the input trees, and a prefix shared across trees is computed once. A tree alone in its
    trie is returned as it is; a trie whose branches train no token is left out (it adds nothing to the loss).
    """
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for t, tree in enumerate(trees):
        names = tuple(sorted(tree.branch_fields))
        for b in range(tree.num_branches):
            first_token = tree.node_tokens[tree.branch_path(b)[0]][0]
            groups.setdefault((first_token, names), []).append((t, b))
    merged: list[Tree] = []
    for (_, names), members in groups.items():
        owners = {t for t, _ in members}
        if len(owners) == 1 and len(members) == trees[members[0][0]].num_branches:
            merged.append(trees[members[0][0]])  # a whole tree alone: nothing to merge
            continue
        if not any(trees[t].branch_loss_spans[b] for t, b in members):
            continue
        merged.append(
            Tree.from_sequences(
                [trees[t].branch_tokens(b) for t, b in members],
                [trees[t].branch_loss_mask(b) for t, b in members],
                {name: [trees[t].branch_fields[name][b] for t, b in members] for name in names},
            )
        )
    return merged


def limit_branch_length(
    tree: Tree, max_branch_tokens: int, overlong: OverlongPolicy, stats: PackingStats, where: str = "tree"
) -> Tree | None:
    """Apply the overlong policy to branches longer than ``max_branch_tokens``.

    Returns the tree (unchanged if nothing is too long), a rebuilt tree, or ``None`` when no trained
    token is left (counted in ``stats.num_dropped_trees``).
    """
    too_long = np.nonzero(tree.branch_lengths > max_branch_tokens)[0]
    if too_long.size == 0:
        return tree
    if overlong == "error":
        b = int(too_long[0])
        raise ValueError(
            f"{where}: branch {b} has {int(tree.branch_lengths[b])} tokens, more than max_branch_tokens="
            f"{max_branch_tokens} ({too_long.size} such branches). Raise max_branch_tokens/max_packed_tokens, "
            "or set overlong='truncate' or 'drop' (counted and reported)."
        )
    if overlong == "drop":
        stats.num_dropped_branches += int(too_long.size)
        dropped = set(too_long.tolist())
        keep, truncate_to = [b for b in range(tree.num_branches) if b not in dropped], None
    else:
        stats.num_truncated_branches += int(too_long.size)
        keep, truncate_to = list(range(tree.num_branches)), max_branch_tokens
    limit = truncate_to or max_branch_tokens + 1
    if not any(tree.branch_loss_spans[b] and tree.branch_loss_spans[b][0] < limit for b in keep):
        stats.num_dropped_trees += 1
        return None
    return tree.select_branches(keep, max_tokens=truncate_to)


def split_tree(tree: Tree, max_tokens: int) -> list[Tree]:
    """Partition the branches into groups whose union fits ``max_tokens``; each group becomes a tree.

    Branches are taken in DFS order of their end nodes, so neighbours (which share the most) stay together.
    Every branch must already fit (``limit_branch_length``). Weights stay exact: each part's weights are
    sums over its own branches. A group whose branches train no token is left out: it adds nothing to the loss
    (TRL drops such rows from its datasets too), and a tree must train a token.
    """
    if tree.num_tokens <= max_tokens:
        return [tree]
    order = sorted(range(tree.num_branches), key=lambda b: (tree.branch_end_nodes[b], b))
    groups: list[list[int]] = []
    included: set[int] = set()
    size = 0
    for b in order:
        path = tree.branch_path(b)
        added = int(sum(tree.node_lengths[n] for n in path if n not in included))
        if groups and size + added <= max_tokens:
            groups[-1].append(b)
            size += added
        else:
            groups.append([b])
            included = set()
            size = int(tree.branch_lengths[b])
        included.update(path)
    trained = tree.branch_num_trained
    return [tree.select_branches(sorted(group)) for group in groups if trained[group].any()]


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing: item indices per bin, largest items first, each into the fullest bin it fits."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free space, bin index)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        pos = bisect.bisect_left(free, (sizes[item], -1))
        if pos < len(free):
            space, index = free.pop(pos)
        else:
            space, index = capacity, len(bins)
            bins.append([])
        bins[index].append(item)
        bisect.insort(free, (space - sizes[item], index))
    return [sorted(b) for b in bins]


def lay_out(
    plan: PackingPlan, normalization: Normalization = "token", pad_token_id: int = 0
) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """The batch of a plan, and the ``(row, offset)`` where each part starts (parts in row order).

    Returns:
        The batch of docs/design.md (``input_ids``/``position_ids``/``kv_end``/``token_multiplicity`` ``[B, N]``;
        ``loss_positions``, ``loss_targets`` ``[M]`` int64; ``loss_weights`` ``[M]`` float64; ``num_loss_items``
        0-dim float64).
    """
    import torch  # here, not at module level: the CLI's flags and `hf-tree stats` read this module without torch

    num_rows, longest = len(plan.rows), plan.row_length
    input_ids = np.full((num_rows, longest), pad_token_id, dtype=np.int64)
    position_ids = np.zeros((num_rows, longest), dtype=np.int64)
    kv_end = np.tile(np.arange(1, longest + 1, dtype=np.int64), (num_rows, 1))  # padding sees itself only
    multiplicity = np.zeros((num_rows, longest), dtype=np.int32)
    loss_positions, loss_targets, loss_weights = [], [], []
    placements: list[tuple[int, int]] = []
    num_loss_items = 0.0
    for r, row in enumerate(plan.rows):
        offset = 0
        for part in row:
            placements.append((r, offset))
            span = slice(offset, offset + part.num_tokens)
            input_ids[r, span] = part.input_ids
            position_ids[r, span] = part.position_ids
            kv_end[r, span] = part.kv_end + offset
            multiplicity[r, span] = part.token_multiplicity
            weights = part.token_weights if normalization == "token" else part.sequence_weights
            trained = np.nonzero(weights)[0]
            loss_positions.append(r * longest + offset + part.predictor_index[trained])
            loss_targets.append(part.input_ids[trained])
            loss_weights.append(weights[trained].astype(np.float64))
            num_loss_items += tree_divisor([part], normalization)
            offset += part.num_tokens

    def cat(chunks: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
        return np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype=dtype)

    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "position_ids": torch.from_numpy(position_ids),
        "kv_end": torch.from_numpy(kv_end.astype(np.int32)),
        "token_multiplicity": torch.from_numpy(multiplicity),
        "loss_positions": torch.from_numpy(cat(loss_positions, np.int64)),
        "loss_targets": torch.from_numpy(cat(loss_targets, np.int64)),
        "loss_weights": torch.from_numpy(cat(loss_weights, np.float64)),
        "num_loss_items": torch.tensor(num_loss_items, dtype=torch.float64),
    }
    if plan.depth_first:  # outside the rows; counted in the batch's divisor
        batch[DEPTH_FIRST_KEY] = list(plan.depth_first)
        batch["num_loss_items"] += tree_divisor(plan.depth_first, normalization)
    return batch, placements


def tree_divisor(trees: Sequence[Tree], normalization: Normalization) -> float:
    """The trees' own loss divisor: the sum of their weights (``token``) or their trained branches (``sequence``)."""
    if normalization == "token":
        return float(sum(float(t.token_weights.sum()) for t in trees))
    return float(sum(t.num_trained_branches for t in trees))


def pack_trees(
    trees: Sequence[Tree],
    max_packed_tokens: int,
    normalization: Normalization = "token",
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
) -> tuple[dict[str, torch.Tensor], PackingStats]:
    """Split, bin-pack and lay out trees (each already within ``max_packed_tokens`` per branch) into a batch
    (``lay_out``) and its packing statistics."""
    batch, stats, _, _ = pack_and_place(trees, max_packed_tokens, normalization, pad_to_multiple_of, pad_token_id)
    return batch, stats


def pack_and_place(
    trees: Sequence[Tree],
    max_packed_tokens: int,
    normalization: Normalization = "token",
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
) -> tuple[dict[str, torch.Tensor], PackingStats, list[Tree], list[tuple[int, int]]]:
    """``pack_trees``, also returning the packed parts (in row order) and the ``(row, offset)`` where each part
    starts, for callers that map per-part values back to the rows."""
    # the callers map parts back to their own trees' branches (which they merged already where they share tokens)
    packing = PackingConfig(
        max_packed_tokens, normalization, pad_to_multiple_of=pad_to_multiple_of, merge_in_batch=False
    )
    plan = plan_packing(trees, packing)
    batch, placements = lay_out(plan, normalization, pad_token_id)
    return batch, plan.stats, [part for row in plan.rows for part in row], placements
