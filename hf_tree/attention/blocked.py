"""Blocked tree attention in pure PyTorch: each query block attends only to the keys it can see.

The tree mask gives every query block ``[q0, q1)`` a small key set: the ancestors of ``q0`` (keys
``j < q0`` with ``kv_end[j] > q0``; a later query of the block sees no other earlier key, because its
visible keys' subtrees contain ``q0`` too) plus the block itself. Keys visible to every query of the
block (``j <= q0``, ``kv_end[j] >= q1``, and inside the sliding window or chunk of every query) come first
and get no mask; only the remaining columns are masked. Siblings, other trees of the row and padding
never enter a matmul. With a bidirectional overlay (``bidirectional_block``), the later tokens of a block that a
query block cuts join its keys as masked columns.

Each block computes its whole score row at once (one matmul, one fused softmax, one matmul) and the
block size adapts so that a score tile holds about ``tile_elements`` numbers: memory is
O(N * block), never N x N. Backward recomputes the tile instead of saving probabilities. GQA/MQA
queries of one KV head are stacked into the rows of one matmul, so K/V are never repeated. On CPU the
blocks of a long row run on worker threads with single-threaded kernels (see ``_map_blocks``).
"""

from __future__ import annotations

import bisect
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import (
    autocast_inputs,
    check_bidirectional_block,
    check_sinks,
    check_window_depths,
    lowest_visible_depth,
    tree_mask_mod,
    visible_keys_per_query,
)
from hf_tree.attention.mask import compute_dtype as _compute_dtype  # its local variables keep the short name

# Default score-tile size: the live tiles of all workers (about two per block, in the compute dtype) take
# as many bytes as one row of the query, so attention memory stays ~1.1x causal SDPA's
# (benchmarks/attention.py) while matmuls stay large. Never below MIN_TILE_ELEMENTS (short rows: memory is
# small, speed matters).
MIN_TILE_ELEMENTS = 1 << 18
# Query block sizes are multiples of MIN_BLOCK_SIZE in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE].
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 512
# Rows shorter than this run on the calling thread (see ``_workers``).
MIN_PARALLEL_TOKENS = 1024


@dataclass
class _Block:
    """One query block and its visible keys, full columns first."""

    q0: int
    q1: int
    keys: slice | torch.Tensor
    """Selected key indices: a slice when they form one ascending contiguous range, else a LongTensor."""
    num_full: int
    """Leading selected keys that every query of the block sees (no mask on their columns)."""
    hidden: torch.Tensor | None
    """``[q1 - q0, num_selected - num_full]`` bool, ``True`` where a query must not see a trailing key."""


def _block_bounds(kv_end: torch.Tensor, num_heads: int, tile_elements: int) -> list[tuple[int, int]]:
    """Split ``[0, N)`` into query blocks whose score tile ``num_heads x Bq x (ancestors + Bq)`` fits.

    A block ends where a subtree ends when one does in its second half: rows of the next subtree then
    start a new block instead of masking the keys of the one that ended.
    """
    n = kv_end.shape[0]
    num_ancestors = (visible_keys_per_query(kv_end) - 1).tolist()  # every query sees itself and its ancestors
    subtree_ends = torch.unique(kv_end).tolist()
    rows = max(tile_elements // num_heads, 1)
    bounds, q0 = [], 0
    while q0 < n:
        a = num_ancestors[q0]
        size = (math.isqrt(a * a + 4 * rows) - a) // 2  # largest Bq with Bq * (a + Bq) <= rows
        size = max(MIN_BLOCK_SIZE, min(MAX_BLOCK_SIZE, size - size % MIN_BLOCK_SIZE))
        q1 = min(n, q0 + size)
        index = bisect.bisect_right(subtree_ends, q1) - 1
        if index >= 0 and subtree_ends[index] > q0 + size // 2:
            q1 = subtree_ends[index]
        bounds.append((q0, q1))
        q0 = q1
    return bounds


def _block_keys(kv_end: torch.Tensor, block: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Keys outside ``[q0, q1)`` and the ancestors of ``q0`` that share a bidirectional block with a query of
    ``[q0, q1)`` (``block [N]``, ``-1`` for none): the later tokens of a block the query block cuts."""
    ids = block[q0:q1]
    ids = torch.unique(ids[ids >= 0])
    if not ids.numel():
        return torch.zeros(0, dtype=torch.int64)
    shared = torch.isin(block, ids)
    shared[q0:q1] = False
    shared[:q0] &= kv_end[:q0] <= q0  # ancestors of q0 are candidates already
    return torch.nonzero(shared).flatten()


def _plan_row(
    kv_end: torch.Tensor,
    depth: torch.Tensor | None,
    window: int | None,
    num_heads: int,
    tile_elements: int,
    device: torch.device,
    block: torch.Tensor | None = None,
    chunk: int | None = None,
) -> Iterator[_Block]:
    """The blocks of one row (``kv_end``/``depth``/``block``: ``[N]`` int64 on the CPU; ``block``: bidirectional
    block ids, ``-1`` for none; ``chunk``: attention chunk in depths), index tensors on ``device``."""
    for q0, q1 in _block_bounds(kv_end, num_heads, tile_elements):
        candidates = torch.cat([torch.nonzero(kv_end[:q0] > q0).flatten(), torch.arange(q0, q1)])
        ends = kv_end[candidates]
        full = (candidates <= q0) & (ends >= q1)
        if block is not None:  # keys only the overlay makes visible: never full (masked per query)
            shared = _block_keys(kv_end, block, q0, q1)
            candidates, ends = torch.cat([candidates, shared]), torch.cat([ends, kv_end[shared]])
            full = torch.cat([full, torch.zeros(shared.numel(), dtype=torch.bool)])
        lowest = lowest_visible_depth(depth[q0:q1], window, chunk) if depth is not None else None
        if lowest is not None:  # window / chunk start of each query: keys above every query's are skipped
            key_depth = depth[candidates]
            reachable = key_depth >= lowest.min()
            candidates, ends, key_depth = candidates[reachable], ends[reachable], key_depth[reachable]
            full = full[reachable] & (key_depth >= lowest.max())
        keys = torch.cat([candidates[full], candidates[~full]])
        num_full = int(full.sum())
        partial = keys[num_full:]
        hidden = None
        if partial.numel():
            mask_mod = tree_mask_mod(
                kv_end[None],
                None if depth is None else depth[None],
                window,
                None if block is None else block[None],
                chunk,
            )
            visible = mask_mod(0, None, torch.arange(q0, q1)[:, None], partial[None, :])
            hidden = (~visible).to(device)
        first, last = int(keys[0]), int(keys[-1])
        if last - first + 1 == keys.numel() and bool((keys[1:] > keys[:-1]).all()):
            yield _Block(q0, q1, slice(first, last + 1), num_full, hidden)
        else:
            yield _Block(q0, q1, keys.to(device), num_full, hidden)


def _select(x: torch.Tensor, keys: slice | torch.Tensor) -> torch.Tensor:
    """Token-major ``x [N, Hkv, D]`` -> ``[Hkv, n_keys, D]`` (a view for a slice, gathered rows otherwise)."""
    rows = x[keys] if isinstance(keys, slice) else x.index_select(0, keys)
    return rows.transpose(0, 1)


def _key_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [Hkv, n_keys, M] @ b [Hkv, M, D]`` written token-major, ``[n_keys, Hkv, D]`` (fast to scatter-add)."""
    out = torch.empty(a.shape[1], a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    torch.matmul(a, b, out=out.transpose(0, 1))
    return out


def _accumulate(total: torch.Tensor, keys: slice | torch.Tensor, part: torch.Tensor) -> None:
    """Token-major ``total [N, Hkv, D] += part [n_keys, Hkv, D]`` at the selected keys."""
    part = part.to(total.dtype)
    if isinstance(keys, slice):
        total[keys] += part
    else:
        total.index_add_(0, keys, part)


def _rows(x: torch.Tensor, q0: int, q1: int, num_kv_heads: int, scale: float | None = None) -> torch.Tensor:
    """Rows ``q0:q1`` of token-major ``x [N, H, D]`` as ``[Hkv, groups * Bq, D]`` (a group's heads stacked)."""
    block = x[q0:q1].transpose(0, 1)
    rows = torch.empty(block.shape, dtype=x.dtype, device=x.device)
    if scale is None:
        rows.copy_(block)
    else:
        torch.mul(block, scale, out=rows)
    return rows.view(num_kv_heads, -1, x.shape[-1])


def _scores(
    rows: torch.Tensor, keys: torch.Tensor, block: _Block, softcap: float | None, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked (soft-capped) scores ``[Hkv, groups * Bq, n_keys]`` and, with a softcap, ``tanh`` of the raw ones."""
    scores = torch.matmul(rows, keys.transpose(-1, -2))
    tanh = None
    if softcap is not None:
        tanh = scores.to(compute_dtype).div_(softcap).tanh_()
        scores = tanh * softcap
    if block.hidden is not None:
        kv_heads, _, width = scores.shape
        tiled = scores.view(kv_heads, -1, block.q1 - block.q0, width)
        tiled[..., block.num_full :].masked_fill_(block.hidden, float("-inf"))
    return scores, tanh


def _with_sink_column(scores: torch.Tensor, sinks: torch.Tensor, block: _Block) -> torch.Tensor:
    """``scores [Hkv, groups * Bq, n_keys]`` -> ``[Hkv, groups * Bq, n_keys + 1]``: each row's head's sink logit
    (``sinks [H]``, head ``kv * groups + g`` owns rows ``g * Bq:(g + 1) * Bq``, see ``_rows``) as a last column."""
    kv_heads, rows, _ = scores.shape
    column = sinks.to(scores.dtype).view(kv_heads, -1, 1, 1).expand(-1, -1, block.q1 - block.q0, 1)
    return torch.cat([scores, column.reshape(kv_heads, rows, 1)], dim=-1)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[B, N, H, D]``: free for HF's projections, which are token-major already."""
    return x.transpose(1, 2).contiguous()


@dataclass
class _Planner:
    """What the block plan of each row depends on (CPU copies), kept from forward to backward."""

    kv_end: torch.Tensor
    """``[B, N]`` int64."""
    depth: torch.Tensor | None
    """``[B, N]`` int64, only with a sliding window or attention chunks."""
    window: int | None
    num_heads: int
    tile_elements: int
    bidirectional_block: torch.Tensor | None = None
    """``[B, N]`` int64 bidirectional block ids (``-1``: none), or ``None``."""
    chunk: int | None = None
    """Attention chunk in depth positions (Llama 4), or ``None``."""

    def blocks(self, device: torch.device) -> Iterator[tuple[int, _Block]]:
        """``(row, block)`` pairs, planned lazily (the plan of a block lives only while it is in flight)."""
        for b in range(self.kv_end.shape[0]):
            depth = None if self.depth is None else self.depth[b]
            overlay = None if self.bidirectional_block is None else self.bidirectional_block[b]
            for block in _plan_row(
                self.kv_end[b], depth, self.window, self.num_heads, self.tile_elements, device, overlay, self.chunk
            ):
                yield b, block


def _forward_block(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    out: torch.Tensor,
    block: _Block,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """Write ``out[q0:q1]`` for one block (token-major ``[N, H*, D]`` views of one row)."""
    compute_dtype = _compute_dtype(q_t.dtype)
    rows = _rows(q_t, block.q0, block.q1, k_t.shape[1], scaling)
    scores, _ = _scores(rows, _select(k_t, block.keys), block, softcap, compute_dtype)
    if sinks is not None:  # the sink joins the softmax as one more column (as eager attention does), then is dropped
        scores = _with_sink_column(scores, sinks, block)
    # Half-precision scores: softmax accumulates in float32 inside and rounds once, like eager's cast.
    probs = torch.softmax(scores, dim=-1).to(q_t.dtype)
    del scores  # a function per block: each tile is freed before the next one is allocated
    if sinks is not None:
        probs = probs[..., :-1]
    block_out = torch.matmul(probs, _select(v_t, block.keys))
    out[block.q0 : block.q1] = block_out.view(-1, block.q1 - block.q0, q_t.shape[-1]).transpose(0, 1)


def _backward_block(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    grad_out: torch.Tensor,
    grad_query: torch.Tensor,
    block: _Block,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Recompute one block's tile, write ``grad_query[q0:q1]``; return its key and value gradient terms
    ``[n_keys, Hkv, D]`` and, with sinks, its sink gradient term ``[H]`` (added by the caller, in block order,
    so results do not depend on thread timing)."""
    q0, q1, num_kv_heads = block.q0, block.q1, k_t.shape[1]
    dtype, compute_dtype = q_t.dtype, _compute_dtype(q_t.dtype)
    rows = _rows(q_t, q0, q1, num_kv_heads, scaling)
    keys, values = _select(k_t, block.keys), _select(v_t, block.keys)
    scores, tanh = _scores(rows, keys, block, softcap, compute_dtype)
    if sinks is not None:
        scores = _with_sink_column(scores, sinks, block)
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype)
    del scores
    if sinks is not None:
        probs_with_sink, probs = probs, probs[..., :-1]
    grad_rows = _rows(grad_out, q0, q1, num_kv_heads)
    grad_values = _key_matmul(probs.to(dtype).transpose(-1, -2), grad_rows)
    grad_scores = torch.matmul(grad_rows, values.transpose(-1, -2)).to(compute_dtype)
    grad_sinks = None
    if sinks is None:
        # The tile holds whole rows, so softmax's own fused backward applies: dS = P * (dP - rowsum(P * dP)),
        # written over dP (rows summing to zero as in eager autograd, unlike rowsum(dO * O) from saved outputs).
        torch.ops.aten._softmax_backward_data.out(grad_scores, probs, -1, compute_dtype, grad_input=grad_scores)
    else:
        # The same with the sink column, whose dP is 0: dS = P * (dP - rowsum(P * dP)) on the key columns and
        # d(sink) = -P_sink * rowsum(P * dP), summed over the rows of each head.
        row_sums = (probs * grad_scores).sum(-1, keepdim=True)
        grad_scores.sub_(row_sums).mul_(probs)
        grad_sinks = (probs_with_sink[..., -1:] * row_sums).view(num_kv_heads, -1, q1 - q0).sum(-1).neg_().flatten()
        del probs_with_sink
    del probs
    if tanh is not None:  # d(c * tanh(s / c)) / ds = 1 - tanh^2
        grad_scores.mul_(tanh.square_().neg_().add_(1.0))
        del tanh
    grad_scores = grad_scores.to(dtype)
    grad_rows_q = torch.matmul(grad_scores, keys).view(-1, q1 - q0, q_t.shape[-1]).transpose(0, 1)
    torch.mul(grad_rows_q, scaling, out=grad_query[q0:q1])
    return _key_matmul(grad_scores.transpose(-1, -2), rows), grad_values, grad_sinks


# CPU parallelism is across blocks: worker threads whose kernels run single-threaded. One parallel region
# per kernel would make every one of a call's thousands of small kernels wait for all intra-op threads,
# which on a busy (oversubscribed) machine costs milliseconds each.
_executor: ThreadPoolExecutor | None = None
_executor_key: tuple[int, int] | None = None  # (process id, workers): a forked child builds its own


def _workers(query: torch.Tensor) -> int:
    """Worker threads for a call: the caller's intra-op thread count on CPU, for rows long enough to have
    several blocks (below that the pool's hand-offs cost more than they give)."""
    cpu = query.device.type == "cpu"
    return torch.get_num_threads() if cpu and query.shape[2] >= MIN_PARALLEL_TOKENS else 1


def _block_executor(workers: int) -> ThreadPoolExecutor:
    global _executor, _executor_key
    if _executor_key != (os.getpid(), workers):
        if _executor is not None and _executor_key[0] == os.getpid():
            _executor.shutdown(wait=False)
        _executor = ThreadPoolExecutor(workers, "hf_tree_blocked", initializer=torch.set_num_threads, initargs=(1,))
        _executor_key = (os.getpid(), workers)
    return _executor


def _isolated(fn: Callable, item: tuple):
    """Run ``fn(*item)`` with no autograd recording and no autocast (both thread-local; dtypes are explicit)."""
    with torch.no_grad(), torch.autocast(item[0].device.type, enabled=False):
        return fn(*item)


def _map_blocks(fn: Callable, items: Iterable[tuple], workers: int) -> Iterator:
    """``fn(*item)`` for each item, results in order; on ``workers`` threads, one item queued beyond them
    (finished results wait in order and hold their key/value gradient terms: keep few in flight).

    The calling thread (which plans blocks and adds up results meanwhile) runs single-threaded too. The first
    failing item's error is raised once no other item is running; the items still queued never run."""
    if workers <= 1:
        for item in items:
            yield _isolated(fn, item)
        return
    executor, pending = _block_executor(workers), deque()
    torch.set_num_threads(1)  # per thread: the caller's setting is restored below
    try:
        for item in items:
            pending.append(executor.submit(_isolated, fn, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # After a failed block (or an abandoned generator) the queued blocks would go on writing into the
        # caller's outputs: drop them, and let the running ones finish before the error reaches the caller.
        for future in pending:
            future.cancel()
        wait(pending)
        torch.set_num_threads(workers)


class _BlockedTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, planner: _Planner, scaling: float, softcap: float | None):
        q_t, k_t, v_t = _token_major(query), _token_major(key), _token_major(value)
        out = torch.empty_like(q_t)
        sink_logits = None if sinks is None else sinks.detach().to(_compute_dtype(query.dtype))
        items = (
            (q_t[b], k_t[b], v_t[b], out[b], block, scaling, softcap, sink_logits)
            for b, block in planner.blocks(q_t.device)
        )
        for _ in _map_blocks(_forward_block, items, _workers(query)):
            pass
        ctx.save_for_backward(query, key, value, sinks)
        ctx.planner, ctx.scaling, ctx.softcap = planner, scaling, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks = ctx.saved_tensors
        compute_dtype = _compute_dtype(query.dtype)
        q_t, k_t, v_t = _token_major(query), _token_major(key), _token_major(value)
        grad_query = torch.empty_like(q_t)
        # Key/value (and sink) gradients collect one term per query block: accumulate them in the compute dtype.
        grad_key = torch.zeros(k_t.shape, dtype=compute_dtype, device=key.device)
        grad_value = torch.zeros(v_t.shape, dtype=compute_dtype, device=value.device)
        sink_logits = None if sinks is None else sinks.to(compute_dtype)
        grad_sinks = None if sinks is None else torch.zeros_like(sink_logits)
        in_flight = deque()  # (row, block) of each submitted item, to place its result

        def items() -> Iterator[tuple]:
            for b, block in ctx.planner.blocks(q_t.device):
                in_flight.append((b, block))
                yield q_t[b], k_t[b], v_t[b], grad_out[b], grad_query[b], block, ctx.scaling, ctx.softcap, sink_logits

        for grad_keys, grad_values, grad_sink_terms in _map_blocks(_backward_block, items(), _workers(query)):
            b, block = in_flight.popleft()
            _accumulate(grad_key[b], block.keys, grad_keys)
            _accumulate(grad_value[b], block.keys, grad_values)
            if grad_sinks is not None:
                grad_sinks += grad_sink_terms
        return (
            grad_query.transpose(1, 2),
            grad_key.to(key.dtype).transpose(1, 2),
            grad_value.to(value.dtype).transpose(1, 2),
            None if grad_sinks is None else grad_sinks.to(sinks.dtype),
            None,
            None,
            None,
        )


def _tile_bytes(query: torch.Tensor) -> int:
    """Bytes live per score-tile element at the backward's peak, over all workers: two compute-dtype
    tiles (probabilities, score gradients), plus two half-precision copies for half inputs' matmuls."""
    compute_bytes = torch.finfo(_compute_dtype(query.dtype)).bits // 8
    low_bytes = query.element_size() if query.element_size() < compute_bytes else 0
    return (2 * compute_bytes + 2 * low_bytes) * _workers(query)


@torch.compiler.disable  # data-dependent block plans: run eagerly inside a compiled model
def blocked_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
    *,
    tile_elements: int | None = None,
) -> torch.Tensor:
    """Tree attention computed block by block over visible keys only, a ``TreeAttentionEngine`` honouring every
    option (``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]`` never repeated in memory, ``kv_end [B, N]`` with
    ``kv_end[j] > j`` -> ``[B, N, H, D]`` in ``query``'s dtype), plus:

    Args:
        tile_elements: target size of one score tile (heads x block rows x keys), which sets the block
            size; default: one query row's bytes over the tiles' bytes per element (``_tile_bytes``).
    """
    window, chunk, blocks = options.sliding_window, options.attention_chunk, options.bidirectional_block
    check_window_depths("blocked_tree_attention", options.position_ids, window, chunk)
    check_sinks("blocked_tree_attention", options.sinks, query.shape[1])
    check_bidirectional_block("blocked_tree_attention", kv_end, blocks)
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads, not a multiple of the {key.shape[1]} key/value heads.")
    if tile_elements is None:  # all workers' live tiles together: about one query row's bytes
        tile_elements = max(MIN_TILE_ELEMENTS, query[0].numel() * query.element_size() // _tile_bytes(query))
    planner = _Planner(
        kv_end=kv_end.detach().to("cpu", torch.int64),
        depth=None if window is None and chunk is None else options.position_ids.detach().to("cpu", torch.int64),
        window=window,
        num_heads=query.shape[1],
        tile_elements=tile_elements,
        bidirectional_block=None if blocks is None else blocks.detach().to("cpu", torch.int64),
        chunk=chunk,
    )
    query, key, value = autocast_inputs(query, key, value)
    with torch.autocast(query.device.type, enabled=False):
        return _BlockedTreeAttention.apply(query, key, value, options.sinks, planner, options.scaling, options.softcap)
