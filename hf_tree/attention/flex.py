"""Tree attention on FlexAttention: a ``BlockMask`` built from ``kv_end`` block summaries, shared by all layers.

The block mask is computed from per-key-block summaries of ``kv_end`` (min/max; depth min/max with a
sliding window; bidirectional block ids min/max with an overlay), never from the ``N x N`` mask: a (query block,
key block) pair is skipped when no key of the block is an ancestor-or-self of a query of the block (nor shares a
bidirectional block with one), "full" (no ``mask_mod`` call) when every key is seen by every query, and partial
otherwise, where ``tree_mask_mod`` decides per element.

The block mask is built once per batch and shared by all layers (``hf_tree.attention.batch_cache``).

On CUDA ``flex_attention`` runs compiled (fused, block-sparse forward and backward). Elsewhere it runs
eagerly: PyTorch's CPU FlexAttention has no backward, so this path serves forward checks of the same
block mask and mask function; the ``blocked`` engine is the CPU engine.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from hf_tree.attention.batch_cache import BatchCache
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import check_bidirectional_block, check_sinks, check_window_depths, tree_mask_mod

# FlexAttention's default sparse block size (its kernels' tile size).
BLOCK_SIZE = 128
_cache: BatchCache[BlockMask] = BatchCache()
logger = logging.getLogger("hf_tree")


def _block_summaries(x: torch.Tensor, block_size: int, fill_min: int, fill_max: int) -> tuple[torch.Tensor, ...]:
    """``x [B, N]`` -> per-block ``(min, max)`` ``[B, ceil(N / block_size)]``, padding ignored."""
    n = x.shape[1]
    pad = -n % block_size
    low = torch.nn.functional.pad(x, (0, pad), value=fill_min).view(x.shape[0], -1, block_size)
    high = torch.nn.functional.pad(x, (0, pad), value=fill_max).view(x.shape[0], -1, block_size)
    return low.amin(-1), high.amax(-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 1, Q, K]`` bool -> (count ``[B, 1, Q]``, indices ``[B, 1, Q, K]`` with the selected ones first)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, indices


def tree_block_mask(
    kv_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    block_size: int = BLOCK_SIZE,
    bidirectional_block: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> BlockMask:
    """The ``BlockMask`` of packed tree rows (uncached; see ``flex_tree_attention`` for the cached use).

    Args:
        kv_end: ``[B, N]`` integer subtree ends.
        position_ids: ``[B, N]`` depths; needed with ``sliding_window``.
        sliding_window: window in depth positions.
        block_size: query and key block size.
        bidirectional_block: ``[B, N]`` block id per token (``-1``: none): tokens of one block see each other both
            ways (``tree_mask_mod``). A tile pair whose blocks' id ranges overlap is kept (as partial).
        attention_chunk: chunk size in depth positions (Llama 4's chunked layers).
    """
    check_window_depths("tree_block_mask", position_ids, sliding_window, attention_chunk)
    check_bidirectional_block("tree_block_mask", kv_end, bidirectional_block)
    batch, n = kv_end.shape
    device = kv_end.device
    ends = kv_end.to(torch.int64)
    num_blocks = -(-n // block_size)
    starts = torch.arange(num_blocks, device=device) * block_size
    q_first = starts[:, None]  # first query / key of each block
    q_last = torch.clamp(starts + block_size, max=n)[:, None] - 1
    k_first, k_last = starts[None, :], q_last.T
    end_min, end_max = _block_summaries(ends, block_size, fill_min=n + 1, fill_max=0)
    end_min, end_max = end_min[:, None, :], end_max[:, None, :]  # [B, 1 (query block), key block]
    # Some key j of the block is seen: j <= i < kv_end[j] for some query i (taking i = max(j, q_first)).
    any_visible = (k_first <= q_last) & (end_max > q_first)
    # Every key seen by every query: all keys precede the block's first query and outlive its last.
    all_visible = (k_last <= q_first) & (end_min > q_last)
    if bidirectional_block is not None:  # a block id in both tiles (ids' ranges overlap; exact for ids rising along
        # the row, as hf_tree.vision numbers them, conservative otherwise: mask_mod decides in partial tiles)
        ids, unmarked = bidirectional_block.to(torch.int64), 1 << 62  # above any id, exact as a pad value
        marked = ids >= 0
        id_min = _block_summaries(torch.where(marked, ids, unmarked), block_size, fill_min=unmarked, fill_max=-1)[0]
        id_max = _block_summaries(torch.where(marked, ids, -1), block_size, fill_min=unmarked, fill_max=-1)[1]
        any_visible |= (id_min[:, :, None] <= id_max[:, None, :]) & (id_min[:, None, :] <= id_max[:, :, None])
    if sliding_window is not None or attention_chunk is not None:
        depth = position_ids.to(torch.int64)
        depth_min, depth_max = _block_summaries(depth, block_size, fill_min=n + 1, fill_max=-1)
    if sliding_window is not None:
        any_visible &= depth_min[:, :, None] - depth_max[:, None, :] < sliding_window
        all_visible &= depth_max[:, :, None] - depth_min[:, None, :] < sliding_window
    if attention_chunk is not None:  # chunk ranges of the two tiles overlap / are one and the same chunk
        chunk_min, chunk_max = depth_min // attention_chunk, depth_max // attention_chunk
        any_visible &= (chunk_min[:, :, None] <= chunk_max[:, None, :]) & (
            chunk_min[:, None, :] <= chunk_max[:, :, None]
        )
        one_chunk = chunk_min == chunk_max
        all_visible &= (one_chunk[:, :, None] & one_chunk[:, None, :]) & (
            chunk_min[:, :, None] == chunk_min[:, None, :]
        )
    partial = any_visible & ~all_visible
    counts, indices = _ordered(partial[:, None])
    full_counts, full_indices = _ordered(all_visible.expand(batch, -1, -1)[:, None])
    return BlockMask.from_kv_blocks(
        counts,
        indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(kv_end, position_ids, sliding_window, bidirectional_block, attention_chunk),
        seq_lengths=(n, n),
    )


def cached_tree_block_mask(
    kv_end: torch.Tensor,
    position_ids: torch.Tensor | None,
    sliding_window: int | None,
    bidirectional_block: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> BlockMask:
    """``tree_block_mask`` built once per batch: keyed on the identity and version of ``kv_end`` (and of
    ``position_ids`` when a sliding window or chunks read them, and of ``bidirectional_block``)."""
    depth = position_ids if sliding_window is not None or attention_chunk is not None else None
    return _cache.get(
        (kv_end, depth, bidirectional_block),
        (sliding_window, attention_chunk),
        lambda: tree_block_mask(
            kv_end, depth, sliding_window, bidirectional_block=bidirectional_block, attention_chunk=attention_chunk
        ),
    )


def clear_block_mask_cache() -> None:
    """Drop the cached block masks (and the references they hold to batch tensors)."""
    _cache.clear()


@dataclass(frozen=True)
class FlexCompileKey:
    """What one compiled FlexAttention graph is specialised on: each key gets a code object of its own
    (``compiled_flex_attention``), so dynamo's recompile limit (8 per code object) counts each key's graphs alone and
    a process running many models never falls back to uncompiled Flex (10x slower, O(N^2) memory). Lengths, batch
    sizes and the soft-cap value are dynamic inside a key (one graph per key)."""

    device_type: str
    dtype: torch.dtype
    scale: float
    """A constant of Flex's kernel: each value is a graph of its own."""
    head_dim: int
    value_dim: int
    grouped_query: bool
    softcap: bool
    lse: bool
    mask_kind: tuple
    """What ``tree_mask_mod`` closes over: ``(sliding_window, attention_chunk, bidirectional)`` (a window's value
    is a constant of the mask function)."""


@dataclass
class _CompiledFlex:
    function: Callable
    calls: int = 0


_compiled: dict[FlexCompileKey, _CompiledFlex] = {}
_first_compile_reported = False
_code_objects = itertools.count()
COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for Flex (the fused kernels); tests of the compile bookkeeping use ``aot_eager``."""


def _flex_call(query, key, value, block_mask, scale, softcap, enable_gqa, return_lse):
    # The soft-cap is a 0-dim tensor (a graph input), not a Python float: a float closed over by the score function
    # becomes an unbacked symbol under dynamic=True and breaks the compile on a second value ("Pending unbacked
    # symbols"); as a tensor every value shares one graph.
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    return flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_aux=AuxRequest(lse=True) if return_lse else None,
    )


def _compile_fresh() -> Callable:
    """``_flex_call`` compiled on a code object of its own (dynamo's caches and limits live on code objects)."""
    name = f"_flex_call_{next(_code_objects)}"
    code = _flex_call.__code__.replace(co_name=name, co_qualname=name)
    function = types.FunctionType(code, _flex_call.__globals__, name)
    # fullgraph: a graph break or a hit recompile limit raises instead of silently running uncompiled Flex
    return torch.compile(function, backend=COMPILE_BACKEND, dynamic=True, fullgraph=True)


@functools.cache
def _softcap_tensor(softcap: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(softcap, device=device, dtype=dtype)


def _call_arguments(query, key, value, block_mask, scale, softcap, return_lse) -> tuple:
    cap = None
    if softcap is not None:
        cap = _softcap_tensor(softcap, query.device, torch.float64 if query.dtype == torch.float64 else torch.float32)
    return query, key, value, block_mask, scale, cap, query.shape[1] != key.shape[1], return_lse


def compiled_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    softcap: float | None = None,
    return_lse: bool = False,
    mask_kind: tuple = (None, None, False),
):
    """``flex_attention`` compiled once per ``FlexCompileKey`` with dynamic shapes (``query [B, H, N, D]``,
    ``key/value [B, Hkv, N, D]``); returns Flex's output (and ``AuxOutput`` with ``return_lse``).

    The first compile of the process is logged with its time (seconds; later lengths reuse the graph). Should a key
    still reach dynamo's recompile limit, a warning says so and the key is compiled afresh (fast kernels are kept)."""
    global _first_compile_reported
    arguments = _call_arguments(query, key, value, block_mask, scale, softcap, return_lse)
    if torch.compiler.is_compiling():  # inside a compiled model, whose compile takes Flex in
        return _flex_call(*arguments)
    compile_key = FlexCompileKey(
        query.device.type,
        query.dtype,
        scale,
        query.shape[-1],
        value.shape[-1],
        query.shape[1] != key.shape[1],
        softcap is not None,
        return_lse,
        mask_kind,
    )
    entry = _compiled.get(compile_key)
    if entry is None:
        entry = _compiled[compile_key] = _CompiledFlex(_compile_fresh())
    start = time.perf_counter()
    try:
        out = entry.function(*arguments)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        warnings.warn(
            f"hf_tree flex: FlexAttention for {compile_key} reached dynamo's recompile limit "
            f"(torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit}); compiling it afresh to "
            "keep the fused kernels. Something in these calls changes every step (report it): each new compile "
            "costs seconds.",
            RuntimeWarning,
            stacklevel=2,
        )
        entry.function = _compile_fresh()
        out = entry.function(*arguments)
    entry.calls += 1
    if entry.calls == 1 and not _first_compile_reported:
        _first_compile_reported = True
        logger.warning(
            "hf_tree flex: compiled FlexAttention in %.1f s (once per process and model kind; new lengths reuse it).",
            time.perf_counter() - start,
        )
    return out


def flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """Tree attention with FlexAttention, a ``TreeAttentionEngine`` honouring every option (``query [B, H, N, D]``,
    ``key/value [B, Hkv, N, D]``, ``kv_end [B, N]`` -> ``[B, N, H, D]`` in ``query``'s dtype).
    GQA/MQA is handled by Flex (K/V are not repeated). Sinks rescale each query's output by the share of its
    softmax mass left to the keys, ``sigmoid(lse - sink)``, from Flex's log-sum-exp ``lse`` (differentiable)."""
    check_window_depths("flex_tree_attention", options.position_ids, options.sliding_window, options.attention_chunk)
    sinks = options.sinks
    check_sinks("flex_tree_attention", sinks, query.shape[1])
    if not query.is_cuda:  # PyTorch's FlexAttention has no backward off CUDA: forward only
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
            raise ValueError(
                f"attention backend 'flex' cannot compute gradients on device {query.device.type!r} (PyTorch's "
                "FlexAttention has no backward there); use the 'blocked' backend (the default off CUDA): "
                "hf_tree.attention.set_attention_backend('blocked') or HF_TREE_ATTENTION_BACKEND=blocked."
            )
        query, key, value = query.detach(), key.detach(), value.detach()
        sinks = None if sinks is None else sinks.detach()
    block_mask = cached_tree_block_mask(
        kv_end, options.position_ids, options.sliding_window, options.bidirectional_block, options.attention_chunk
    )
    if query.is_cuda:
        mask_kind = (options.sliding_window, options.attention_chunk, options.bidirectional_block is not None)
        out = compiled_flex_attention(
            query, key, value, block_mask, options.scaling, options.softcap, sinks is not None, mask_kind
        )
    else:
        arguments = _call_arguments(query, key, value, block_mask, options.scaling, options.softcap, sinks is not None)
        out = _flex_call(*arguments)  # eagerly: PyTorch's CPU Flex compiles, but not for dynamic shapes
    if sinks is not None:
        out, aux = out
        # softmax over keys and sink = softmax over keys * exp(lse) / (exp(lse) + exp(sink))
        keys_share = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[None, :, None])
        out = out * keys_share[..., None].to(out.dtype)
    return out.transpose(1, 2).contiguous()
