"""PNG pictures of a tree dataset (``hf-tree stats --plot``) and of one packed row (``hf-tree show``).

Needs ``matplotlib`` (the ``plots`` extra: ``pip install hf_tree[plots]``); it is imported lazily, with the
non-interactive ``Agg`` backend, so the rest of hf_tree never needs it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hf_tree.attention.mask import tree_mask_mod
from hf_tree.stats import DatasetStats
from hf_tree.tree import Tree

# A row longer than this is drawn with its mask sampled on a grid of this many queries and keys.
MASK_PIXELS = 1024


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib: pip install 'hf_tree[plots]' (or pip install matplotlib)"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_bars(ax: Any, values: Sequence[int], color: str) -> None:
    """Counts per integer value (bars), log-scaled when the counts span several orders of magnitude."""
    keys, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    ax.bar(keys, counts, width=0.8, color=color)
    ax.set_xticks(keys if len(keys) <= 20 else ax.get_xticks())
    if counts.max() > 50 * max(counts.min(), 1):
        ax.set_yscale("log")


def plot_stats(stats: DatasetStats, path: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
    """Write a 2x2 PNG: branch lengths, fan-out, per-tree dedup ratio, and tokens before/after dedup/packing."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (lengths_ax, fan_ax), (dedup_ax, tokens_ax) = axes

    lengths_ax.hist(stats.branch_lengths or [0], bins=40, color="tab:blue")
    lengths_ax.set(title="branch length", xlabel="tokens per branch", ylabel="branches")

    if stats.fan_outs:
        _integer_bars(fan_ax, stats.fan_outs, "tab:orange")
    fan_ax.set(title="fan-out", xlabel="children per node with children", ylabel="nodes")

    dedup_ax.hist(stats.tree_dedup_ratios or [1.0], bins=40, color="tab:green")
    dedup_ax.axvline(stats.dedup_ratio, color="black", linestyle="--", label=f"dataset {stats.dedup_ratio:.2f}")
    dedup_ax.set(title="dedup ratio per tree", xlabel="branch tokens / tree tokens", ylabel="trees")
    dedup_ax.legend()

    names = ["per-branch\n(before dedup)", "tree\n(after dedup)"]
    values = [stats.num_branch_tokens, stats.num_tree_tokens]
    if stats.packing is not None:
        names.append(f"packed rows\n({stats.packing.num_rows} x {stats.max_packed_tokens})")
        values.append(stats.packing.num_rows * stats.max_packed_tokens)
    bars = tokens_ax.bar(names, values, color=["tab:gray", "tab:green", "tab:purple"][: len(values)])
    tokens_ax.bar_label(bars, labels=[f"{v:,}" for v in values])
    tokens_ax.margins(y=0.15)  # room for the bar labels
    tokens_ax.set(
        title=f"tokens per epoch: dedup {stats.dedup_ratio:.2f}x\nestimated FLOP saving: linear "
        f"{stats.linear_flop_saving:.0%}, attention {stats.attention_flop_saving:.0%}, "
        f"total {stats.total_flop_saving:.0%}",
        ylabel="tokens",
    )
    fig.suptitle(title or f"{stats.num_trees} trees, {stats.num_branches} branches")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _node_levels(tree: Tree) -> np.ndarray:
    """``[num_nodes]``: number of ancestors of each node (its row in the tree drawing)."""
    levels = np.zeros(tree.num_nodes, dtype=np.int64)
    for i, p in enumerate(tree.node_parents):
        if p >= 0:
            levels[i] = levels[p] + 1
    return levels


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` runs where ``mask`` is true."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


def plot_packed_row(
    parts: Sequence[Tree],
    path: str | pathlib.Path,
    title: str | None = None,
    row_length: int | None = None,
    window: tuple[int, int] | None = None,
) -> pathlib.Path:
    """Write a PNG of one packed row: its trees as node bars over the packed positions (one level per tree
    depth in nodes; trained tokens dark; an elbow joins a node's end to each child's start) above the row's
    attention mask (query rows, key columns).

    Args:
        parts: the row's tree parts in layout order (``hf_tree.stats.plan_rows(...).rows[i]``).
        row_length: the padded row length (default: the row's tokens).
        window: ``(start, end)`` packed positions to draw (default: the whole row), to zoom in on the forks of
            a row whose shared prefix is long.

    Raises:
        ValueError: on an empty or out-of-range ``window``.
    """
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    num_tokens = sum(p.num_tokens for p in parts)
    n = max(row_length or num_tokens, 1)
    start, end = window or (0, n)
    if not 0 <= start < end <= n:
        raise ValueError(f"window={window!r} must satisfy 0 <= start < end <= {n} (the row's length).")
    min_width = (end - start) / 300  # one-token nodes stay visible
    fig, (tree_ax, mask_ax) = plt.subplots(2, 1, figsize=(10, 11), gridspec_kw={"height_ratios": [1, 2.4]}, sharex=True)
    colors = plt.get_cmap("tab10").colors
    kv_end = np.arange(1, n + 1, dtype=np.int64)  # padding sees itself only
    offset, max_level = 0, 0
    for k, part in enumerate(parts):
        color = colors[k % len(colors)]
        levels = _node_levels(part)
        max_level = max(max_level, int(levels.max()))
        starts = part.node_offsets[:-1] + offset
        ends = part.node_offsets[1:] + offset
        trained = part.token_weights > 0
        for i in range(part.num_nodes):
            y = -levels[i]
            width = max(ends[i] - starts[i], min_width)
            tree_ax.add_patch(Rectangle((starts[i], y - 0.3), width, 0.6, color=color, alpha=0.3, lw=0))
            for s, e in _runs(trained[part.node_offsets[i] : part.node_offsets[i + 1]]):
                tree_ax.add_patch(Rectangle((starts[i] + s, y - 0.3), max(e - s, min_width), 0.6, color=color, lw=0))
            # an outline per node, so that adjacent siblings stay apart
            tree_ax.add_patch(Rectangle((starts[i], y - 0.3), width, 0.6, fill=False, edgecolor="black", lw=0.6))
            if part.node_parents[i] >= 0:  # down from the parent's end, then across to the child's start
                p = part.node_parents[i]
                tree_ax.plot([ends[p], ends[p], starts[i]], [-levels[p] - 0.3, y, y], color=color, lw=0.7, ls=":")
        kv_end[offset : offset + part.num_tokens] = part.kv_end + offset
        offset += part.num_tokens
    tree_ax.set_xlim(start - 0.5, end - 0.5)
    tree_ax.set_ylim(-max_level - 0.8, 0.8)
    tree_ax.set_yticks([])
    tree_ax.set_ylabel("tree level (nodes from the root)")
    tree_ax.set_title(
        title
        or f"{len(parts)} trees, {sum(p.num_branches for p in parts)} branches, {num_tokens} tokens (dark: trained)"
    )

    # The mask (hf_tree.attention.mask's rule), sampled on a grid for long windows.
    index = np.unique(np.linspace(start, end - 1, min(end - start, MASK_PIXELS)).round().astype(np.int64))
    grid = torch.from_numpy(index)
    visible = tree_mask_mod(torch.from_numpy(kv_end)[None])(0, None, grid[:, None], grid[None, :]).numpy()
    extent = (start - 0.5, end - 0.5, end - 0.5, start - 0.5)
    mask_ax.imshow(visible, cmap="Greys", interpolation="nearest", extent=extent, aspect="auto")
    for b in np.cumsum([p.num_tokens for p in parts])[:-1]:
        if start < b < end:
            mask_ax.axvline(b - 0.5, color="tab:red", lw=0.6)
            mask_ax.axhline(b - 0.5, color="tab:red", lw=0.6)
    mask_ax.set(
        xlabel="key position (packed)", ylabel="query position (packed)", title="attention mask (black: visible)"
    )
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# Weight of the previous average in the smoothed training curve (TensorBoard's slider default is 0.6)
LOSS_SMOOTHING = 0.6


def smoothed(values: Sequence[float], weight: float = LOSS_SMOOTHING) -> list[float]:
    """Exponential moving average of ``values``, bias-corrected (as Adam's moments) so that the curve starts at the
    first value instead of at 0."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1.0 - weight) * value
        out.append(average / (1.0 - weight**i))
    return out


def plot_loss_curve(log_history: Sequence[dict[str, Any]], path: str | pathlib.Path, title: str) -> pathlib.Path:
    """The training loss of each logging interval (faint) with its exponential moving average (``smoothed``), and
    every held-out loss as a point (``Trainer.state.log_history``), against the optimizer step, as a PNG at ``path``.
    Held-out points are not joined: two evaluations say nothing about the curve between them."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(log["step"], log["loss"]) for log in log_history if "loss" in log]
    if train:
        steps, losses = zip(*train)
        raw, ema = "training loss (logging interval)", f"smoothed (EMA {LOSS_SMOOTHING})"
        ax.plot(steps, losses, "o-", color="tab:blue", alpha=0.3, markersize=3, label=raw)
        ax.plot(steps, smoothed(losses), "-", color="tab:blue", linewidth=2, label=ema)
    held_out = [(log["step"], log["eval_loss"]) for log in log_history if "eval_loss" in log]
    if held_out:
        ax.plot(*zip(*held_out), "s", color="tab:orange", markersize=8, linestyle="none", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per trained token)")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # a run that logged no loss draws empty axes
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return pathlib.Path(path)
