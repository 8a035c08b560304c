"""Shard plans for tree context parallel: which packed positions each CP rank computes.

A batch of packed rows (``[B, N]``) is cut into ``cp_size`` shards of ``L`` *slots* each. Slot ids run over
``[0, cp_size * L)``: ids ``< N`` are the row's positions, ids ``>= N`` are padding slots added so that every
rank holds the same number of rows (the all-gather of keys/values needs equal shards). A padding slot behaves
like the collator's padding: its key is seen by itself only (``kv_end = id + 1``) and it is never scored.
All rows of the batch use the same plan, so ``indices[r]`` (rank ``r``'s slot ids, ascending) is ``[L]``.

Attention *work* of query ``i`` is the number of keys it sees: ``#{j <= i : kv_end[j] > i}`` (its depth + 1
in a tree). A causal row's work grows linearly, a tree's does not (a GRPO row is flat after the prompt, an
agent row grows along the trunk): equal-token splits then leave ranks idle. Strategies:

- ``"balanced"`` (default): ``chunks_per_rank * cp_size`` equal-token chunks, dealt out greedily (heaviest
  first, to the least-loaded rank with room) so that every rank gets the same number of tokens and nearly
  the same work. Zig-zag is the special case of a linear work profile.
- ``"zigzag"``: ``2 * cp_size`` equal-token chunks, rank ``r`` takes chunks ``r`` and ``2 * cp_size - 1 - r``
  (what ring attention does for causal rows).
- ``"contiguous"``: one contiguous range per rank, cut at equal *work*; token counts then differ, and the
  shorter shards are padded up to the longest (more memory on every rank).
- ``"naive"``: one contiguous range per rank with equal tokens: the baseline the balance is reported against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_tree.attention.mask import visible_keys_per_query

STRATEGIES = ("balanced", "zigzag", "contiguous", "naive")
DEFAULT_CHUNKS_PER_RANK = 8


def check_kv_end(kv_end: torch.Tensor) -> None:
    """``ValueError`` unless ``kv_end`` is a ``[B, N]`` tree mask (``j < kv_end[j] <= N``, N >= 1)."""
    if kv_end.dim() != 2 or kv_end.shape[1] < 1:
        raise ValueError(f"kv_end has shape {tuple(kv_end.shape)}; expected [batch, seq] with seq >= 1.")
    positions = torch.arange(kv_end.shape[1], device=kv_end.device)
    if bool(((kv_end <= positions) | (kv_end > kv_end.shape[1])).any()):
        raise ValueError(
            "kv_end is not a tree mask: every key j needs j < kv_end[j] <= N. Use the batch of a TreeDataCollator."
        )


@dataclass(frozen=True)
class ContextParallelPlan:
    """Which slots each CP rank computes, and how evenly the attention work is spread.

    Build it with ``plan_context_parallel``; every rank builds the same plan from the same batch.
    """

    indices: torch.Tensor
    """``[cp_size, L]`` int64 (CPU): rank ``r`` computes slots ``indices[r]`` (ascending; ids ``>= num_tokens``
    are padding slots). Every id of ``[0, cp_size * L)`` appears once."""
    num_tokens: int
    """``N``: the row length of the batch the plan was made for."""
    strategy: str
    """The strategy that produced it (see ``STRATEGIES``)."""
    work: torch.Tensor
    """``[cp_size]`` int64: visible query/key pairs each rank computes, summed over the batch rows (a padding
    slot counts 1: it sees itself)."""
    naive_work: torch.Tensor
    """``[cp_size]`` int64: the same for the naive equal-token contiguous split (the baseline)."""

    @property
    def cp_size(self) -> int:
        return self.indices.shape[0]

    @property
    def shard_len(self) -> int:
        """``L``: slots (rows of the model input) per rank."""
        return self.indices.shape[1]

    @property
    def num_slots(self) -> int:
        return self.indices.numel()

    @property
    def work_balance(self) -> float:
        """Max over mean of the per-rank work (1.0 is perfect)."""
        return _imbalance(self.work)

    @property
    def naive_work_balance(self) -> float:
        return _imbalance(self.naive_work)

    def slot_owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rank, local)`` ``[num_slots]`` int64: the rank computing each slot id and its row in that shard."""
        flat = self.indices.flatten()
        owner = torch.empty_like(flat)
        local = torch.empty_like(flat)
        owner[flat] = torch.arange(self.cp_size).repeat_interleave(self.shard_len)
        local[flat] = torch.arange(self.shard_len).repeat(self.cp_size)
        return owner, local

    def report(self) -> dict[str, float | int | str | list[int]]:
        """The figures to log: work per rank and its balance against the naive split, padding."""
        return {
            "strategy": self.strategy,
            "cp_size": self.cp_size,
            "num_tokens": self.num_tokens,
            "shard_len": self.shard_len,
            "num_padding_slots": self.num_slots - self.num_tokens,
            "work_per_rank": self.work.tolist(),
            "work_balance": self.work_balance,
            "naive_work_balance": self.naive_work_balance,
        }


def _imbalance(work: torch.Tensor) -> float:
    mean = float(work.double().mean())
    return float(work.max()) / mean if mean > 0 else 1.0


def _slot_work(token_work: torch.Tensor, num_rows: int, slots: torch.Tensor) -> torch.Tensor:
    """Work of each slot id in ``slots`` (any shape): the row work of real positions, one pair per row for
    padding slots (a padding query sees itself)."""
    real = slots < token_work.numel()
    return torch.where(real, token_work[slots.clamp(max=token_work.numel() - 1)], num_rows)


def _chunk_indices(num_tokens: int, num_chunks: int) -> torch.Tensor:
    """``[num_chunks, c]``: slot ids of equal chunks covering ``ceil(N / num_chunks) * num_chunks`` slots."""
    size = max(1, math.ceil(num_tokens / num_chunks))
    return torch.arange(num_chunks * size).view(num_chunks, size)


def _deal_chunks(chunk_work: torch.Tensor, cp_size: int, chunks_per_rank: int) -> list[list[int]]:
    """Greedy longest-processing-time assignment with a cardinality limit: heaviest chunk first, to the
    least-loaded rank that still has room; ties go to the lower rank (deterministic on every rank)."""
    loads = [0] * cp_size
    taken: list[list[int]] = [[] for _ in range(cp_size)]
    for chunk in sorted(range(chunk_work.numel()), key=lambda c: (-int(chunk_work[c]), c)):
        rank = min((r for r in range(cp_size) if len(taken[r]) < chunks_per_rank), key=lambda r: (loads[r], r))
        taken[rank].append(chunk)
        loads[rank] += int(chunk_work[chunk])
    return taken


def _contiguous_indices(work: torch.Tensor, num_tokens: int, cp_size: int) -> torch.Tensor:
    """Cut ``[0, N)`` at equal cumulative work; pad every shard with fresh padding slot ids up to the longest."""
    cumulative = work.cumsum(0)
    targets = cumulative[-1] * torch.arange(1, cp_size) / cp_size
    cuts = [0, *torch.searchsorted(cumulative, targets, right=True).tolist(), num_tokens]  # non-decreasing
    length = max(1, max(b - a for a, b in zip(cuts[:-1], cuts[1:])))
    rows, next_pad = [], num_tokens
    for a, b in zip(cuts[:-1], cuts[1:]):
        pad = length - (b - a)
        rows.append(torch.cat([torch.arange(a, b), torch.arange(next_pad, next_pad + pad)]))
        next_pad += pad
    return torch.stack(rows)


def _indices(strategy: str, work: torch.Tensor, num_rows: int, cp_size: int, chunks_per_rank: int) -> torch.Tensor:
    """``[cp_size, L]`` slot ids per rank; ``work`` is ``[N]`` per-position work summed over the rows."""
    num_tokens = work.numel()
    if strategy == "naive":
        return _chunk_indices(num_tokens, cp_size)
    if strategy == "contiguous":
        return _contiguous_indices(work, num_tokens, cp_size)
    if strategy == "zigzag":
        chunks = _chunk_indices(num_tokens, 2 * cp_size)
        return torch.stack([torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]]) for r in range(cp_size)])
    chunks = _chunk_indices(num_tokens, chunks_per_rank * cp_size)
    dealt = _deal_chunks(_slot_work(work, num_rows, chunks).sum(1), cp_size, chunks_per_rank)
    return torch.stack([torch.sort(chunks[sorted(rank_chunks)].flatten()).values for rank_chunks in dealt])


def plan_context_parallel(
    kv_end: torch.Tensor,
    cp_size: int,
    strategy: str = "balanced",
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
) -> ContextParallelPlan:
    """Split the rows of a packed batch over ``cp_size`` ranks.

    Args:
        kv_end: ``[B, N]`` integer subtree ends of the (global) batch; any device (planning runs on the CPU).
        cp_size: ranks of the context-parallel group.
        strategy: one of ``STRATEGIES`` (see the module docstring).
        chunks_per_rank: chunks each rank receives with ``"balanced"`` (more chunks: finer balance, more
            query blocks).

    Returns:
        The plan; rows shorter than ``cp_size`` and lengths that do not divide evenly get padding slots.
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive integer (the context-parallel group size).")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}.")
    if not isinstance(chunks_per_rank, int) or chunks_per_rank < 1:
        raise ValueError(f"chunks_per_rank={chunks_per_rank!r} must be a positive integer.")
    kv_end = kv_end.detach().to("cpu", torch.int64)
    check_kv_end(kv_end)
    num_rows, num_tokens = kv_end.shape
    work = visible_keys_per_query(kv_end).sum(0)
    indices = _indices(strategy, work, num_rows, cp_size, chunks_per_rank)
    naive = _indices("naive", work, num_rows, cp_size, chunks_per_rank)
    return ContextParallelPlan(
        indices=indices,
        num_tokens=num_tokens,
        strategy=strategy,
        work=_slot_work(work, num_rows, indices).sum(1),
        naive_work=_slot_work(work, num_rows, naive).sum(1),
    )
