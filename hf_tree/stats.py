"""What a tree dataset saves before training: deduplication, FLOP estimates, shapes, and what packing does.

FLOP estimate (forward + backward = 3x forward, 2 FLOPs per multiply-add, as in Kaplan et al. 2020):

- Linear layers (attention projections and MLP) cost ``6 * P`` per token, ``P`` = their parameters, so their
  saving is ``1 - num_tree_tokens / num_branch_tokens = 1 - 1 / dedup_ratio``.
- Attention scores and the weighted sum cost ``12 * num_layers * hidden_size`` per visible (query, key) pair.
  A branch of ``L`` tokens alone has ``L (L + 1) / 2`` pairs; in a tree, token ``i`` sees exactly its root path,
  ``depth_i + 1`` keys, so the tree has ``sum_i (depth_i + 1)`` pairs.
- Total: ``6 P T + 12 n_layers d A`` for ``T`` tokens and ``A`` pairs, per-branch vs tree. Embedding and LM head
  are left out (the tree loss applies the head only to trained positions; per-branch HF training applies it
  to every position, so the real saving is a little larger).

Packing is planned by ``plan_packing``, the function whose plan ``TreeDataCollator`` lays out, once per collator
call, so the reported rows, splits and padding are what training does by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from hf_tree.attention.mask import visible_keys_per_query
from hf_tree.packing import PackingConfig, PackingPlan, PackingStats, plan_packing
from hf_tree.tree import Tree, dedup_ratio


@dataclass(frozen=True)
class ModelShape:
    """Dimensions entering the FLOP estimate (defaults: SmolLM2-135M, the project's offline real model)."""

    num_layers: int = 30
    """Decoder layers."""
    hidden_size: int = 576
    """Model width ``d`` (= query heads x head dim)."""
    intermediate_size: int = 1536
    """Gated MLP width (gate, up and down projections)."""
    num_attention_heads: int = 9
    """Query heads."""
    num_key_value_heads: int = 3
    """Key/value heads (GQA)."""

    @property
    def linear_params(self) -> int:
        """Parameters of the attention projections and MLPs of all layers (no embeddings, norms or head)."""
        kv_width = self.hidden_size // self.num_attention_heads * self.num_key_value_heads
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv_width
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    def training_flops(self, num_tokens: float, num_pairs: float) -> float:
        """Forward + backward FLOPs of ``num_tokens`` tokens with ``num_pairs`` visible attention pairs."""
        return 6.0 * self.linear_params * num_tokens + 12.0 * self.num_layers * self.hidden_size * num_pairs


@dataclass
class DatasetPlan:
    """The collator's plans for a dataset fed to it in consecutive batches of trees."""

    batches: list[PackingPlan]
    """One ``plan_packing`` result per collator call."""

    @property
    def rows(self) -> list[list[Tree]]:
        """Every row's tree parts, in layout order, batch after batch."""
        return [row for plan in self.batches for row in plan.rows]

    @property
    def stats(self) -> PackingStats:
        """The collator's counters summed over the batches (splits, truncated/dropped branches, padding), rows
        counted only where the trainer forwards them: a batch whose trees all run depth-first carries a 1-token
        placeholder row that ``TreeTrainer`` never forwards on one process (``_rows_run``), so neither it nor its
        padding counts, as in the trainer's logged packing stats."""
        total = PackingStats()
        for plan in self.batches:
            stats = plan.stats
            if placeholder_only(plan):
                stats = replace(stats, num_rows=0, num_padding_tokens=0)
            total.add(stats)
        return total

    @property
    def num_row_tokens(self) -> int:
        """Tokens in the packed rows (padding and depth-first trees excluded): the numerator of the rows' fill."""
        return sum(part.num_tokens for row in self.rows for part in row)


def placeholder_only(plan: PackingPlan) -> bool:
    """Whether ``plan``'s one row is the placeholder of a batch whose trees all run depth-first."""
    return bool(plan.depth_first) and not any(plan.rows[0])


def plan_rows(
    trees: Sequence[Tree], packing: PackingConfig | int, *, trees_per_batch: int | None = None, **options: Any
) -> DatasetPlan:
    """Plan ``trees`` as ``TreeDataCollator`` packs them, called on consecutive batches of ``trees_per_batch`` trees
    (``None``: one call on all trees, the fewest rows possible).

    Args:
        packing: the options, or ``max_packed_tokens`` with the other ``PackingConfig`` fields in ``options``.

    Raises:
        ValueError: on bad options (as the collator), or on an overlong branch with ``overlong="error"``.
    """
    if not isinstance(packing, PackingConfig):
        packing = PackingConfig(packing, **options)
    elif options:
        raise ValueError(f"plan_rows: pass the packing options in the PackingConfig, not as {sorted(options)}.")
    if trees_per_batch is not None and (not isinstance(trees_per_batch, int) or trees_per_batch < 1):
        raise ValueError(f"trees_per_batch={trees_per_batch!r} must be a positive integer or None.")
    step = trees_per_batch or max(len(trees), 1)
    return DatasetPlan([plan_packing(trees[i : i + step], packing, first=i) for i in range(0, len(trees), step)])


def attention_pairs(tree: Tree) -> tuple[int, int]:
    """(visible query-key pairs per branch alone, pairs in the tree) — see the module docstring."""
    lengths = tree.branch_lengths
    return int((lengths * (lengths + 1) // 2).sum()), int(visible_keys_per_query(torch.from_numpy(tree.kv_end)).sum())


def fan_outs(tree: Tree) -> list[int]:
    """Children of every node that has any (a forest's roots count as children of a virtual root if > 1)."""
    parents = np.asarray(tree.node_parents)
    counts = np.bincount(parents[parents >= 0], minlength=tree.num_nodes)
    out = counts[counts > 0].tolist()
    roots = int((parents < 0).sum())
    return out + [roots] if roots > 1 else out


@dataclass
class DatasetStats:
    """Statistics of a tree dataset; see the module docstring for the FLOP formulas."""

    num_trees: int = 0
    num_branches: int = 0
    num_trained_branches: int = 0
    """Branches with at least one trained token."""
    num_branch_tokens: int = 0
    """Tokens per-branch training processes (sum of branch lengths)."""
    num_tree_tokens: int = 0
    """Tokens after deduplication (what tree packing processes)."""
    num_trained_tokens: int = 0
    """Trained tokens summed over branches (the ``"token"`` normalization's divisor)."""
    num_branch_attention_pairs: int = 0
    num_tree_attention_pairs: int = 0
    branch_lengths: list[int] = field(default_factory=list)
    fan_outs: list[int] = field(default_factory=list)
    """Children per node with children, over all trees."""
    branches_per_tree: list[int] = field(default_factory=list)
    tree_dedup_ratios: list[float] = field(default_factory=list)
    model_shape: ModelShape = field(default_factory=ModelShape)
    max_packed_tokens: int | None = None
    packing: PackingStats | None = None
    """What packing at ``max_packed_tokens`` did (rows, splits, drops, padding; forwarded rows only)."""
    num_row_tokens: int = 0
    """Tokens in the packed rows (padding and depth-first trees excluded)."""
    num_depth_first_trees: int = 0
    """Trees left whole to depth-first execution (``PackingConfig.tree_execution``), outside the rows."""
    packing_config: PackingConfig | None = None
    """The options packing was planned with."""
    dropped: dict[str, Any] = field(default_factory=dict)
    """Counts left out before the trees existed (conversion and building), by reason."""

    @property
    def dedup_ratio(self) -> float:
        return dedup_ratio(self.num_branch_tokens, self.num_tree_tokens)

    @property
    def linear_flop_saving(self) -> float:
        """Fraction of linear-layer FLOPs the tree saves: ``1 - tree tokens / branch tokens``."""
        return 1.0 - self.num_tree_tokens / self.num_branch_tokens if self.num_branch_tokens else 0.0

    @property
    def attention_flop_saving(self) -> float:
        """Fraction of attention FLOPs saved: ``1 - tree pairs / branch pairs``."""
        if not self.num_branch_attention_pairs:
            return 0.0
        return 1.0 - self.num_tree_attention_pairs / self.num_branch_attention_pairs

    @property
    def total_flop_saving(self) -> float:
        """Fraction of training FLOPs saved for ``model_shape`` (linear layers + attention)."""
        shape = self.model_shape
        branch = shape.training_flops(self.num_branch_tokens, self.num_branch_attention_pairs)
        tree = shape.training_flops(self.num_tree_tokens, self.num_tree_attention_pairs)
        return 1.0 - tree / branch if branch else 0.0

    @property
    def row_fill(self) -> float:
        """Share of the forwarded rows' capacity (``num_rows * max_packed_tokens``) holding tree tokens (<= 1)."""
        if self.packing is None or not self.packing.num_rows:
            return 0.0
        return self.num_row_tokens / (self.packing.num_rows * self.max_packed_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Scalars, savings and packing counters (histogram inputs left out), JSON-ready."""
        out = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        out.update(
            dedup_ratio=self.dedup_ratio,
            linear_flop_saving=self.linear_flop_saving,
            attention_flop_saving=self.attention_flop_saving,
            total_flop_saving=self.total_flop_saving,
            row_fill=self.row_fill,
        )
        return out


def compute_stats(
    trees: Iterable[Tree],
    packing: PackingConfig | None = None,
    *,
    trees_per_batch: int | None = None,
    model_shape: ModelShape | None = None,
    dropped: dict[str, Any] | None = None,
) -> DatasetStats:
    """Statistics of ``trees``; with ``packing``, also what packing them does (``plan_rows``).

    Args:
        trees: the dataset's trees (e.g. ``Tree.from_dict(row)`` for each row).
        packing, trees_per_batch: as ``TreeDataCollator`` / ``plan_rows``.
        model_shape: dimensions for ``total_flop_saving`` (default SmolLM2-135M).
        dropped: counts by reason from conversion/building, carried into the report.
    """
    trees = list(trees)
    stats = DatasetStats(model_shape=model_shape or ModelShape(), dropped=dict(dropped or {}))
    for tree in trees:
        stats.num_trees += 1
        stats.num_branches += tree.num_branches
        stats.num_trained_branches += tree.num_trained_branches
        stats.num_branch_tokens += tree.num_branch_tokens
        stats.num_tree_tokens += tree.num_tokens
        stats.num_trained_tokens += int(tree.branch_num_trained.sum())
        branch_pairs, tree_pairs = attention_pairs(tree)
        stats.num_branch_attention_pairs += branch_pairs
        stats.num_tree_attention_pairs += tree_pairs
        stats.branch_lengths.extend(tree.branch_lengths.tolist())
        stats.fan_outs.extend(fan_outs(tree))
        stats.branches_per_tree.append(tree.num_branches)
        stats.tree_dedup_ratios.append(tree.dedup_ratio)
    if packing is not None:
        stats.packing_config, stats.max_packed_tokens = packing, packing.max_packed_tokens
        plan = plan_rows(trees, packing, trees_per_batch=trees_per_batch)
        stats.packing, stats.num_row_tokens = plan.stats, plan.num_row_tokens
        stats.num_depth_first_trees = sum(len(batch.depth_first) for batch in plan.batches)
    return stats


def text_histogram(values: Sequence[float], bins: int = 10, width: int = 40, integer: bool = True) -> str:
    """A small text histogram (one line per bin: range, count, bar)."""
    if len(values) == 0:
        return "  (no values)"
    array = np.asarray(values, dtype=np.float64)
    low, high = float(array.min()), float(array.max())
    if integer and high - low + 1 <= bins:  # one bin per value
        edges = np.arange(low, high + 2) - 0.5
    else:
        edges = np.linspace(low, high, bins + 1) if high > low else np.array([low - 0.5, low + 0.5])
    counts, edges = np.histogram(array, bins=edges)
    top = max(int(counts.max()), 1)
    lines = []
    for count, start, end in zip(counts, edges[:-1], edges[1:]):
        if integer and end - start <= 1:
            label = f"{int(round((start + end) / 2)):>8d}"
        else:
            label = f"{start:>8.{0 if integer else 2}f}-{end:<8.{0 if integer else 2}f}"
        lines.append(f"  {label} {int(count):>7d} {'#' * round(width * int(count) / top)}")
    return "\n".join(lines)


def format_report(stats: DatasetStats) -> str:
    """The human-readable report ``hf-tree stats`` prints."""
    lengths = np.asarray(stats.branch_lengths or [0])
    lines = [
        f"trees                  {stats.num_trees}",
        f"branches               {stats.num_branches} ({stats.num_trained_branches} with trained tokens)",
        f"tokens per branch      min {lengths.min()}  median {int(np.median(lengths))}  max {lengths.max()}",
        f"tokens before dedup    {stats.num_branch_tokens}  (sum of branch lengths: per-branch training)",
        f"tokens after dedup     {stats.num_tree_tokens}  (tree packing)",
        f"dedup ratio            {stats.dedup_ratio:.3f}",
        f"trained tokens         {stats.num_trained_tokens} (summed over branches)",
        "estimated FLOP saving  (fwd+bwd; linear 6*P per token, attention 12*layers*d per visible query-key pair)",
        f"  linear layers/MLP    {stats.linear_flop_saving:.1%}  = 1 - tree tokens / branch tokens",
        f"  attention            {stats.attention_flop_saving:.1%}  = 1 - sum(depth+1) / sum(L(L+1)/2) "
        f"({stats.num_tree_attention_pairs} vs {stats.num_branch_attention_pairs} pairs)",
        f"  total                {stats.total_flop_saving:.1%}  for {stats.model_shape.num_layers} layers, "
        f"d={stats.model_shape.hidden_size}, P={stats.model_shape.linear_params / 1e6:.1f}M linear parameters",
    ]
    if stats.packing is not None:
        p = stats.packing
        lines += [
            f"packing at max_packed_tokens={stats.max_packed_tokens}",
            f"  rows                 {p.num_rows}  (fill {stats.row_fill:.1%} of row capacity; padding to the batch's "
            f"longest row {p.padding_fraction:.1%})",
            f"  trees depth-first    {stats.num_depth_first_trees} ({p.num_tree_tokens - stats.num_row_tokens} tokens, "
            "outside the rows)",
            f"  trees split          {p.num_split_trees} (into {p.num_tree_parts} parts in total)",
            f"  branches truncated   {p.num_truncated_branches} (longer than max_branch_tokens, overlong='truncate')",
            f"  branches dropped     {p.num_dropped_branches} (longer than max_branch_tokens, overlong='drop')",
            f"  trees dropped        {p.num_dropped_trees} (no trained token left)",
        ]
    for stage, counts in stats.dropped.items():
        lines.append(f"{stage:<23s}{sum(counts.values())} {counts if counts else ''}")
    lines += ["branch length histogram (tokens):", text_histogram(stats.branch_lengths)]
    lines += ["fan-out histogram (children per node with children):", text_histogram(stats.fan_outs)]
    lines += ["per-tree dedup ratio histogram:", text_histogram(stats.tree_dedup_ratios, integer=False)]
    return "\n".join(lines)
