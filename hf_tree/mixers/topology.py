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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch


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
    step_counts: list[int]
    """Segments still running at each scan step."""
    parent: torch.Tensor
    """``[num_segments]`` int64 index of each segment's parent in the previous level's order; -1 for roots."""
    segment_length: torch.Tensor
    """``[num_segments]`` int64 tokens per segment (this level's order)."""
    segment_start: torch.Tensor
    """``[num_segments]`` int64 flat index of each segment's first token (this level's order)."""


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
    _layouts: dict[int, list[LevelLayout]] = field(default_factory=dict, repr=False)
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
            sentinel = self.num_tokens
            pred = torch.cat([self.pred.clamp_min(-1), self.pred.new_tensor([-1])])
            pred = torch.where(pred < 0, sentinel, pred)  # pred of the sentinel is the sentinel
            columns = [torch.arange(self.num_tokens, device=self.pred.device)]
            for _ in range(width - 1):
                columns.append(pred[columns[-1]])
            self._windows[width] = torch.stack(columns[::-1], dim=1)
        return self._windows[width]

    def levels(self, chunk_size: int) -> list[LevelLayout]:
        """Chunk layouts of every level (cached per chunk size)."""
        if chunk_size not in self._layouts:
            self._layouts[chunk_size] = self._build_levels(chunk_size)
        return self._layouts[chunk_size]

    def _build_levels(self, chunk_size: int) -> list[LevelLayout]:
        device = self.pred.device
        layouts: list[LevelLayout] = []
        position_in_level = np.full(len(self.segment_start), -1, dtype=np.int64)
        for level in range(self.num_levels):
            members = np.nonzero(self.segment_level == level)[0]
            chunks = -(-self.segment_length[members] // chunk_size)
            order = members[np.argsort(-chunks, kind="stable")]
            chunks = -(-self.segment_length[order] // chunk_size)
            position_in_level[order] = np.arange(len(order))
            step_counts = [int((chunks > s).sum()) for s in range(int(chunks.max()))]
            offsets = np.arange(chunk_size)
            blocks = []
            for s, count in enumerate(step_counts):
                starts = self.segment_start[order[:count]] + s * chunk_size
                lengths = self.segment_length[order[:count]] - s * chunk_size
                index = starts[:, None] + offsets[None, :]
                blocks.append(np.where(offsets[None, :] < lengths[:, None], index, self.num_tokens).reshape(-1))
            parents = self.segment_parent[order]
            parent_local = np.where(parents >= 0, position_in_level[np.maximum(parents, 0)], -1)
            layouts.append(
                LevelLayout(
                    token_index=torch.from_numpy(np.concatenate(blocks)).to(device),
                    step_counts=step_counts,
                    parent=torch.from_numpy(parent_local).to(device),
                    segment_length=torch.from_numpy(self.segment_length[order]).to(device),
                    segment_start=torch.from_numpy(self.segment_start[order]).to(device),
                )
            )
        return layouts


def build_topology(kv_end: torch.Tensor) -> TreeTopology:
    """The ``TreeTopology`` of a ``[B, N]`` ``kv_end`` (any int dtype, any device)."""
    if kv_end.dim() != 2:
        raise ValueError(f"kv_end must have shape [batch, seq]; got {tuple(kv_end.shape)}.")
    ends = kv_end.detach().to("cpu", torch.int64).numpy()
    batch, length = ends.shape
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
