"""What a tree dataset saves before training: deduplication, FLOP estimates, shapes, and what packing does.

FLOP estimate (forward + backward = 3x forward, 2 FLOPs per multiply-add, as in Kaplan et al. 2020):

- Linear layers (attention projections and MLP) cost ``6 * P`` per token, ``P`` = their parameters, so their
  saving is ``1 - num_tree_tokens / num_branch_tokens = 1 - 1 / dedup_ratio``.
- Attention scores and the weighted sum cost ``12 * num_layers * d`` per visible (query, key) pair (``d``: query
  heads x head dim, usually ``hidden_size``).
  A branch of ``L`` tokens alone has ``L (L + 1) / 2`` pairs; in a tree, token ``i`` sees exactly its root path,
  ``depth_i + 1`` keys, so the tree has ``sum_i (depth_i + 1)`` pairs.
- Total: ``6 P T + 12 n_layers d A`` for ``T`` tokens and ``A`` pairs, per-branch vs tree. Embedding and LM head
  are left out (the tree loss applies the head only to trained positions; per-branch HF training applies it
  to every position, so the real saving is a little larger).

Packing is planned by ``plan_packing``, the function whose plan ``TreeDataCollator`` lays out, once per collator
call, so the reported rows, splits and padding are what training does by construction. The collator's calls are
the trainer's micro-batches: ``trainer_batches`` deals the trees as ``TreeSFTTrainer``'s ``TreeRowBatchSampler`` does
(``per_device_train_batch_size`` rows each, TRL's random order or sequential), so with ``merge_in_batch`` (on by
default) the reported training dedup is the ``dedup_ratio`` the trainer logs, step by step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from hf_tree.attention.mask import visible_keys_per_query
from hf_tree.packing import PackingConfig, PackingPlan, PackingStats, plan_packing
from hf_tree.row_batching import TreeRowBatchSampler
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
    head_dim: int | None = None
    """Width of one head (None: ``hidden_size // num_attention_heads``)."""

    @classmethod
    def of_config(cls, config: Any) -> ModelShape:
        """The shape of a transformers model config (its text config for a multimodal model). A mixture of experts
        counts the MLP width its tokens run through: ``num_experts_per_tok`` experts (and a shared expert)."""
        text = config.get_text_config()
        heads = text.num_attention_heads
        intermediate = text.intermediate_size
        experts, expert_width = getattr(text, "num_experts_per_tok", None), getattr(text, "moe_intermediate_size", None)
        if experts and expert_width:
            intermediate = experts * expert_width + (getattr(text, "shared_expert_intermediate_size", None) or 0)
        return cls(
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        )

    @property
    def query_width(self) -> int:
        """Query heads x head dim: the width of the attention scores' dot products."""
        return (self.head_dim or self.hidden_size // self.num_attention_heads) * self.num_attention_heads

    @property
    def linear_params(self) -> int:
        """Parameters of the attention projections and MLPs of all layers (no embeddings, norms or head)."""
        kv_width = self.query_width // self.num_attention_heads * self.num_key_value_heads
        attention = 2 * self.hidden_size * self.query_width + 2 * self.hidden_size * kv_width
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    def training_flops(self, num_tokens: float, num_pairs: float) -> float:
        """Forward + backward FLOPs of ``num_tokens`` tokens with ``num_pairs`` visible attention pairs."""
        return 6.0 * self.linear_params * num_tokens + 12.0 * self.num_layers * self.query_width * num_pairs


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
        placeholder row that ``TreeTrainer`` never forwards on one process (``DepthFirstRunner.rows_run``), so
        neither it nor its padding counts, as in the trainer's logged packing stats."""
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

    def step_dedup_ratios(self, batches_per_step: int) -> list[float]:
        """The dedup ratio of each run of ``batches_per_step`` consecutive batches (an optimizer step of
        ``gradient_accumulation_steps`` micro-batches): what the trainer logs as ``dedup_ratio`` with
        ``logging_steps=1``."""
        ratios = []
        for start in range(0, len(self.batches), batches_per_step):
            step = PackingStats()
            for plan in self.batches[start : start + batches_per_step]:
                step.add(plan.stats)
            ratios.append(step.dedup_ratio)
        return ratios


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
    return plan_batches([trees[i : i + step] for i in range(0, len(trees), step)], packing)


@dataclass(frozen=True)
class TrainerBatching:
    """How ``TreeSFTTrainer`` (``batch_unit="rows"``, one process) deals trees into micro-batches; the defaults are
    TRL's (``SFTConfig``)."""

    per_device_train_batch_size: int = 8
    """Rows (samples, i.e. branches) per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (a step's rows are dealt into them)."""
    shuffle: bool = True
    """TRL's ``train_sampling_strategy="random"`` (trees in a seeded random order); False: ``"sequential"``."""
    seed: int = 42
    """``data_seed``, else ``seed``: the order of epoch 0 (``TreeOrder``)."""
    slot_trees: tuple[int, ...] | None = None
    """TRL's rows when some train no token but take a batch slot (``TreeSFTTrainer.tree_row_slots``: the tree of
    each, -1 for those); None: one slot per tree."""


def trainer_batches(trees: Sequence[Tree], batching: TrainerBatching) -> list[list[Tree]]:
    """The first epoch's micro-batches of ``trees`` as ``TreeSFTTrainer.get_train_dataloader`` makes them (its
    ``TreeRowBatchSampler``; a tree cut between micro-batches becomes the trees of its parts, as
    ``TreePartDataset`` gives them).

    Raises:
        ValueError: on a batch size or accumulation below 1 (as the sampler).
    """
    sampler = TreeRowBatchSampler(
        [tree.num_branches for tree in trees],
        rows_per_batch=batching.per_device_train_batch_size,
        batches_per_step=batching.gradient_accumulation_steps,
        shuffle=batching.shuffle,
        seed=batching.seed,
        slot_trees=batching.slot_trees,
    )
    return [
        [
            trees[p.tree]
            if (p.first, p.last) == (0, trees[p.tree].num_branches)
            else trees[p.tree].select_branches(range(p.first, p.last))
            for p in batch
        ]
        for batch in sampler.batches()
    ]


def plan_batches(batches: Sequence[Sequence[Tree]], packing: PackingConfig) -> DatasetPlan:
    """``plan_packing`` of each batch (one collator call each), e.g. of ``trainer_batches``."""
    plans, first = [], 0
    for batch in batches:
        plans.append(plan_packing(batch, packing, first=first))
        first += len(batch)
    return DatasetPlan(plans)


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
    model_shape_source: str = "SmolLM2-135M's shape (the default)"
    """Where ``model_shape`` comes from (the report names it)."""
    max_packed_tokens: int | None = None
    packing: PackingStats | None = None
    """What packing at ``max_packed_tokens`` did (rows, splits, drops, padding; forwarded rows only)."""
    num_row_tokens: int = 0
    """Tokens in the packed rows (padding and depth-first trees excluded)."""
    num_depth_first_trees: int = 0
    """Trees left whole to depth-first execution (``PackingConfig.tree_execution``), outside the rows."""
    packing_config: PackingConfig | None = None
    """The options packing was planned with."""
    batching: TrainerBatching | None = None
    """The trainer's micro-batches packing was planned on (``trainer_batches``); None: ``trees_per_batch``."""
    trees_per_batch: int | None = None
    """With ``batching`` None: consecutive batches of this many trees (None: all trees in one batch)."""
    num_batches: int = 0
    """Collator calls (micro-batches) planned."""
    step_dedup_ratios: list[float] = field(default_factory=list)
    """Dedup ratio of each optimizer step (``gradient_accumulation_steps`` micro-batches): the trainer's logged
    ``dedup_ratio`` at ``logging_steps=1``."""
    num_packed_branch_attention_pairs: int = 0
    num_packed_tree_attention_pairs: int = 0
    """Attention pairs of the planned tree parts (merged per batch, split, depth-first), per branch and as trees."""
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
    def training_dedup_ratio(self) -> float:
        """Branch tokens / tree tokens of the planned batches (after in-batch merging): the trainer's ``dedup_ratio``
        over the epoch."""
        return self.packing.dedup_ratio if self.packing is not None else self.dedup_ratio

    @property
    def training_total_flop_saving(self) -> float:
        """``total_flop_saving`` of the planned batches (what training computes, for ``model_shape``)."""
        if self.packing is None:
            return self.total_flop_saving
        shape = self.model_shape
        branch = shape.training_flops(self.packing.num_branch_tokens, self.num_packed_branch_attention_pairs)
        tree = shape.training_flops(self.packing.num_tree_tokens, self.num_packed_tree_attention_pairs)
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
            training_dedup_ratio=self.training_dedup_ratio,
            training_total_flop_saving=self.training_total_flop_saving,
            step_dedup_ratios=self.step_dedup_ratios,
            row_fill=self.row_fill,
        )
        return out


def compute_stats(
    trees: Iterable[Tree],
    packing: PackingConfig | None = None,
    *,
    batching: TrainerBatching | None = None,
    trees_per_batch: int | None = None,
    model_shape: ModelShape | None = None,
    model_shape_source: str | None = None,
    dropped: dict[str, Any] | None = None,
) -> DatasetStats:
    """Statistics of ``trees``; with ``packing``, also what packing them does: in the trainer's micro-batches
    (``batching``, ``trainer_batches``) or in consecutive batches of ``trees_per_batch`` trees (``plan_rows``).

    Args:
        trees: the dataset's trees (e.g. ``Tree.from_dict(row)`` for each row).
        packing: as ``TreeDataCollator``.
        batching, trees_per_batch: how the trees reach the collator (at most one; neither: all trees at once).
        model_shape: dimensions for ``total_flop_saving`` (default SmolLM2-135M); ``model_shape_source`` says whose.
        dropped: counts by reason from conversion/building, carried into the report.

    Raises:
        ValueError: on bad options, both ``batching`` and ``trees_per_batch``, or what ``plan_packing`` raises.
    """
    if batching is not None and trees_per_batch is not None:
        raise ValueError("pass batching (the trainer's micro-batches) or trees_per_batch, not both.")
    trees = list(trees)
    stats = DatasetStats(model_shape=model_shape or ModelShape(), dropped=dict(dropped or {}))
    if model_shape_source is not None:
        stats.model_shape_source = model_shape_source
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
        if batching is not None:
            plan = plan_batches(trainer_batches(trees, batching), packing)
        else:
            plan = plan_rows(trees, packing, trees_per_batch=trees_per_batch)
        stats.batching, stats.trees_per_batch, stats.num_batches = batching, trees_per_batch, len(plan.batches)
        stats.packing, stats.num_row_tokens = plan.stats, plan.num_row_tokens
        stats.num_depth_first_trees = sum(len(batch.depth_first) for batch in plan.batches)
        accumulation = batching.gradient_accumulation_steps if batching is not None else 1
        stats.step_dedup_ratios = plan.step_dedup_ratios(accumulation)
        for part in (*(p for row in plan.rows for p in row), *(t for b in plan.batches for t in b.depth_first)):
            branch_pairs, tree_pairs = attention_pairs(part)
            stats.num_packed_branch_attention_pairs += branch_pairs
            stats.num_packed_tree_attention_pairs += tree_pairs
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


def _training_line(stats: DatasetStats) -> str:
    """The training dedup and where its batches come from."""
    config, batching = stats.packing_config, stats.batching
    merged = "merged per batch (merge_in_batch)" if config.merge_in_batch else "not merged (merge_in_batch=False)"
    if batching is not None:
        order = f"TRL's random order, seed {batching.seed}" if batching.shuffle else "sequential order"
        source = (
            f"{stats.num_batches} micro-batches of {batching.per_device_train_batch_size} rows, "
            f"{batching.gradient_accumulation_steps} per step ({order}, one process, epoch 0), "
            "as hf-tree sft batches them"
        )
    elif stats.trees_per_batch is not None:
        source = f"{stats.num_batches} batch(es) of up to {stats.trees_per_batch} consecutive trees"
    else:
        source = "all trees in one batch (an upper bound: training merges only within its micro-batches)"
    return f"dedup in training      {stats.training_dedup_ratio:.3f}  {merged}; {source}"


def format_report(stats: DatasetStats) -> str:
    """The human-readable report ``hf-tree stats`` prints."""
    lengths = np.asarray(stats.branch_lengths or [0])
    lines = [
        f"trees                  {stats.num_trees}",
        f"branches               {stats.num_branches} ({stats.num_trained_branches} with trained tokens)",
        f"tokens per branch      min {lengths.min()}  median {int(np.median(lengths))}  max {lengths.max()}",
        f"tokens before dedup    {stats.num_branch_tokens}  (sum of branch lengths: per-branch training)",
        f"tokens after dedup     {stats.num_tree_tokens}  (tree packing)",
        f"dedup ratio            {stats.dedup_ratio:.3f}  within trees (as built: group_by / messages_branches)",
        f"trained tokens         {stats.num_trained_tokens} (summed over branches)",
        "estimated FLOP saving  (fwd+bwd; linear 6*P per token, attention 12*layers*d per visible query-key pair)",
        f"  linear layers/MLP    {stats.linear_flop_saving:.1%}  = 1 - tree tokens / branch tokens",
        f"  attention            {stats.attention_flop_saving:.1%}  = 1 - sum(depth+1) / sum(L(L+1)/2) "
        f"({stats.num_tree_attention_pairs} vs {stats.num_branch_attention_pairs} pairs)",
        f"  total                {stats.total_flop_saving:.1%}  for {stats.model_shape.num_layers} layers, "
        f"d={stats.model_shape.hidden_size}, P={stats.model_shape.linear_params / 1e6:.1f}M linear parameters "
        f"({stats.model_shape_source})",
    ]
    if stats.packing is not None:
        p = stats.packing
        lines += [_training_line(stats)]
        if stats.step_dedup_ratios:
            steps = np.asarray(stats.step_dedup_ratios)
            lines.append(
                f"  per optimizer step   min {steps.min():.3f}  median {np.median(steps):.3f}  max {steps.max():.3f}"
                f"  ({len(steps)} steps; the trainer logs each as dedup_ratio)"
            )
        lines += [
            f"  FLOP saving          {stats.training_total_flop_saving:.1%}  in training (total, as above)",
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
