"""The trie seen by a causal token mixer: each token's predecessor, and segments processed level by level.

A packed row is a DFS layout of trie nodes; ``kv_end[j]`` is where the subtree of j's node ends, so j is an
ancestor of i iff ``j < i < kv_end[j]``. A causal mixer (convolution, recurrence) must read, before token i,
exactly its ancestors in order: the predecessor of i is its nearest ancestor,
``pred(i) = max{j < i : kv_end[j] > i}`` (``i - 1`` inside a node, the parent node's last token at a node's
first token, none at a root). Padding (``kv_end[j] = j + 1``, after every tree) is nobody's ancestor.

For recurrences the row is cut into *segments*: maximal runs of consecutive tokens that each continue the
previous one (``pred(i) = i - 1``), also cut after every *fork* (a token with two or more successors). The state
entering a segment is then the final state of its parent segment (zero at a root), and segments whose parents are
done run together: level by level, ``num_levels`` = node depth of the deepest trie, never the number of branches.

In depth-first execution (``hf_tree.depth_first``) a row is one unit of a larger tree: its roots continue the last
token of the ancestors' cached prefix, so they start from that token's state (``kv_prefix``, a
``hf_tree.attention.prefix.PrefixCache``), and the state after the unit's last token is recorded for its
descendants.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from hf_tree.attention.prefix import PrefixCache


def predecessors(kv_end: np.ndarray) -> np.ndarray:
    """``[B, N]`` int ``kv_end`` -> ``[B, N]`` int64 row-local predecessor index, ``-1`` for roots and padding.

    One pass per row with a stack of open ancestors (amortised O(N)): pop what has ended, the top is the nearest
    ancestor."""
    batch, length = kv_end.shape
    pred = np.full((batch, length), -1, dtype=np.int64)
    for row in range(batch):
        ends = kv_end[row].tolist()
        stack: list[int] = []
        out = pred[row]
        for i in range(length):
            while stack and ends[stack[-1]] <= i:
                stack.pop()
            if stack:
                out[i] = stack[-1]
            stack.append(i)
    return pred


@dataclass
class LevelLayout:
    """Tokens of one level's segments cut into chunks of ``chunk_size`` for a chunked scan.

    Segments are sorted by chunk count (descending) and chunks laid out step-major (every segment's chunk 0, then
    every chunk 1, ...), so the segments still running at scan step ``s`` are a prefix of length
    ``step_counts[s]`` and their chunks one contiguous block.
    """

    token_index: torch.Tensor
    """``[num_chunks * chunk_size]`` int64 flat token index; ``num_tokens`` (a zero row) where a chunk is padded."""
    chunk_size: int
    step_counts: list[int]
    """Segments still running at each scan step."""
    parent: torch.Tensor
    """``[num_segments]`` int64 index of each segment's parent in the previous level's order; -1 for roots."""
    segment_length: torch.Tensor
    """``[num_segments]`` int64 tokens per segment (this level's order)."""
    segment_start: torch.Tensor
    """``[num_segments]`` int64 flat index of each segment's first token (this level's order)."""
    segments: np.ndarray
    """``[num_segments]`` row-order index (``TreeTopology.segment_start``) of each segment (this level's order)."""


@dataclass
class TreeTopology:
    """Predecessors and segments of a packed ``[B, N]`` batch (flat token index ``b * N + i``)."""

    shape: tuple[int, int]
    pred: torch.Tensor
    """``[B * N]`` int64 flat predecessor index, -1 at roots and padding."""
    segment_start: np.ndarray
    segment_length: np.ndarray
    segment_parent: np.ndarray
    """Parent segment of each segment (row order), -1 at roots."""
    segment_level: np.ndarray
    _layouts: dict[int, list[list[LevelLayout]]] = field(default_factory=dict, repr=False)
    _windows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def num_levels(self) -> int:
        return int(self.segment_level.max()) + 1 if self.segment_level.size else 0

    def window(self, width: int) -> torch.Tensor:
        """``[B * N, width]`` int64: column ``width - 1 - t`` holds the t-th ancestor of each token (column
        ``width - 1`` the token itself), ``num_tokens`` (a zero row) above a root: a causal conv's input window."""
        if width not in self._windows:
            pred = torch.cat([self.pred, self.pred.new_tensor([-1])])
            pred = torch.where(pred < 0, self.num_tokens, pred)  # above a root: the sentinel, whose pred is itself
            columns = [torch.arange(self.num_tokens, device=self.pred.device)]
            for _ in range(width - 1):
                columns.append(pred[columns[-1]])
            self._windows[width] = torch.stack(columns[::-1], dim=1)
        return self._windows[width]

    def levels(self, chunk_size: int) -> list[list[LevelLayout]]:
        """Chunk layouts of every level, each level split into buckets by chunk size (cached per chunk size).

        A segment of ``L < chunk_size`` tokens is chunked by the power of two ``>= L`` and batched with segments of
        its bucket: a row's padding tokens (one-token roots) or short completions beside a long prompt then cost
        about their own size, not a full chunk each. Any chunk size gives the same result (up to rounding)."""
        if chunk_size not in self._layouts:
            self._layouts[chunk_size] = self._build_levels(chunk_size)
        return self._layouts[chunk_size]

    def _build_levels(self, chunk_size: int) -> list[list[LevelLayout]]:
        lengths = self.segment_length
        bucket = np.where(lengths >= chunk_size, chunk_size, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(int))
        position_in_level = np.full(len(self.segment_start), -1, dtype=np.int64)
        levels: list[list[LevelLayout]] = []
        for level in range(self.num_levels):
            layouts, placed = [], 0
            for size in sorted(set(bucket[self.segment_level == level].tolist()), reverse=True):
                members = np.nonzero((self.segment_level == level) & (bucket == size))[0]
                chunks = -(-lengths[members] // size)
                order = members[np.argsort(-chunks, kind="stable")]  # most chunks first: running ones are a prefix
                position_in_level[order] = placed + np.arange(len(order))
                placed += len(order)
                layouts.append(self._layout(order, size, position_in_level))
            levels.append(layouts)
        return levels

    def _layout(self, order: np.ndarray, chunk_size: int, position_in_level: np.ndarray) -> LevelLayout:
        """The ``LevelLayout`` of segments ``order`` (sorted by chunk count, descending)."""
        chunks = -(-self.segment_length[order] // chunk_size)
        step_counts = [int((chunks > s).sum()) for s in range(int(chunks.max()))]
        offsets = np.arange(chunk_size)
        blocks = []
        for s, count in enumerate(step_counts):
            starts = self.segment_start[order[:count]] + s * chunk_size
            remaining = self.segment_length[order[:count]] - s * chunk_size
            index = starts[:, None] + offsets[None, :]
            blocks.append(np.where(offsets[None, :] < remaining[:, None], index, self.num_tokens).reshape(-1))
        parents = self.segment_parent[order]
        parent_local = np.where(parents >= 0, position_in_level[np.maximum(parents, 0)], -1)
        device = self.pred.device
        return LevelLayout(
            token_index=torch.from_numpy(np.concatenate(blocks)).to(device),
            chunk_size=chunk_size,
            step_counts=step_counts,
            parent=torch.from_numpy(parent_local).to(device),
            segment_length=torch.from_numpy(self.segment_length[order]).to(device),
            segment_start=torch.from_numpy(self.segment_start[order]).to(device),
            segments=order,
        )

    def last_segments(self) -> np.ndarray:
        """``[B]`` row-order index of the segment holding each row's last token."""
        last_tokens = np.arange(1, self.shape[0] + 1) * self.shape[1] - 1
        return np.searchsorted(self.segment_start, last_tokens, side="right") - 1


LevelFn = Callable[[torch.Tensor, LevelLayout], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def scan_levels(
    topology: TreeTopology,
    chunk_size: int,
    initial_zeros: torch.Tensor,
    level_fn: LevelFn,
    prefix: PrefixCache | None = None,
) -> torch.Tensor:
    """Run a recurrence level by level; the state entering a segment is its parent's final state (zero at a root).

    Args:
        initial_zeros: ``[*state]`` zeros in the state's dtype and device.
        level_fn: ``(initial_states [S, *state], layout) -> (outputs [M, *out], token index [M], final states
            [S, *state])`` for the segments of one bucket.
        prefix: a depth-first unit's cache (the ``kv_prefix`` keyword), or None. Its ancestors' state entry of this
            recurrence (``PrefixCache.recurrent_state_key``), ``[B, *state]``, is the state entering each row's roots
            (they continue the prefix's last token) instead of zeros; the state after each row's last token,
            ``[B, *state]`` with its autograd graph, is recorded under the same key for the unit's descendants.

    Returns:
        ``[B * N, *out]`` outputs scattered back to their tokens (every token is in exactly one segment).
    """
    pieces, indices, previous = [], [], None
    key = prefix.recurrent_state_key() if prefix is not None else None
    cached = prefix.cached.get(key) if prefix is not None else None
    wanted = topology.last_segments() if prefix is not None else np.empty(0, dtype=np.int64)
    kept: dict[int, torch.Tensor] = {}
    for level in topology.levels(chunk_size):
        finals = []
        for layout in level:
            if cached is None:
                initial = initial_zeros.expand(layout.parent.shape[0], *initial_zeros.shape)
            else:  # every root of row b continues the prefix's last token
                initial = cached.to(initial_zeros.dtype)[layout.segment_start // topology.shape[1]]
            if previous is not None:  # a differentiable gather: siblings' state gradients add up in backward
                has_parent = (layout.parent >= 0).reshape(-1, *[1] * initial_zeros.dim())
                initial = torch.where(has_parent, previous[layout.parent.clamp_min(0)], initial)
            out, index, final = level_fn(initial, layout)
            pieces.append(out)
            indices.append(index)
            finals.append(final)
            for position in np.nonzero(np.isin(layout.segments, wanted))[0].tolist():
                kept[int(layout.segments[position])] = final[position]
        previous = torch.cat(finals)
    if prefix is not None:
        prefix.record(key, torch.stack([kept[int(s)] for s in wanted]))
    out = torch.cat(pieces)
    return out.new_zeros(topology.num_tokens, *out.shape[1:]).index_copy(0, torch.cat(indices), out)


def gather_chunks(rows: torch.Tensor, layout: LevelLayout) -> torch.Tensor:
    """``[T + 1, H, ...]`` token rows (last row zero) -> ``[num_chunks, H, chunk_size, ...]``."""
    chunks = rows[layout.token_index].reshape(-1, layout.chunk_size, *rows.shape[1:])
    return chunks.transpose(1, 2)


def scatter_index(layout: LevelLayout, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of real tokens among the layout's chunk slots, their token indices)."""
    valid = layout.token_index < num_tokens
    return valid, layout.token_index[valid]


def build_topology(kv_end: torch.Tensor) -> TreeTopology:
    """The ``TreeTopology`` of a ``[B, N]`` ``kv_end`` (any int dtype, any device)."""
    if kv_end.dim() != 2:
        raise ValueError(f"kv_end must have shape [batch, seq]; got {tuple(kv_end.shape)}.")
    ends = kv_end.detach().to("cpu", torch.int64).numpy()
    batch, length = ends.shape
    bad = (ends <= np.arange(length)) | (ends > length)
    if bad.any():
        row, j = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(
            f"kv_end[{row}, {j}] = {int(ends[row, j])} must lie in [{j + 1}, {length}] (a token's subtree ends after "
            "it and inside the row); build batches with hf_tree.TreeDataCollator."
        )
    pred_local = predecessors(ends)
    flat_offsets = (np.arange(batch) * length)[:, None]
    pred = np.where(pred_local >= 0, pred_local + flat_offsets, -1).reshape(-1)
    index = np.arange(batch * length)
    successors = np.bincount(pred[pred >= 0], minlength=batch * length)
    continues = (pred == index - 1) & (pred >= 0)
    continues[1:] &= successors[:-1] < 2  # cut after a fork: its children all start from its final state
    starts = np.nonzero(~continues)[0]
    lengths = np.diff(np.append(starts, batch * length))
    segment_of = np.cumsum(~continues) - 1
    parent_token = pred[starts]
    parent = np.where(parent_token >= 0, segment_of[np.maximum(parent_token, 0)], -1)
    level = np.zeros(len(starts), dtype=np.int64)
    for s in np.nonzero(parent >= 0)[0]:  # parents precede children in row order
        level[s] = level[parent[s]] + 1
    return TreeTopology(
        shape=(batch, length),
        pred=torch.from_numpy(pred).to(kv_end.device),
        segment_start=starts,
        segment_length=lengths,
        segment_parent=parent,
        segment_level=level,
    )


_cache: dict[str, object] = {}


def tree_topology(kv_end: torch.Tensor) -> TreeTopology:
    """``build_topology`` cached for the ``kv_end`` tensor of the current forward: every mixer layer (and a
    gradient-checkpointing recompute) receives the same tensor object, so the CPU pass runs once per batch."""
    ref = _cache.get("ref")
    if ref is not None and ref() is kv_end and _cache.get("version") == kv_end._version:
        return _cache["topology"]  # type: ignore[return-value]
    topology = build_topology(kv_end)
    _cache.update(ref=weakref.ref(kv_end), version=kv_end._version, topology=topology)
    return topology
