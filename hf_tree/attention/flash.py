"""Tree attention on flash-attn's varlen kernel: each segment's queries against its gathered root-to-segment path.

A packed tree row splits into segments (``hf_tree.attention.segments``: maximal runs of tokens with the same subtree
end). A segment's queries see exactly the keys of their root-to-segment path (the ancestors' keys, then the segment's
own, causally), so each segment is one variable-length "sequence" of ``flash_attn_varlen_func``: its queries are the
segment's tokens, its keys/values the path's, gathered end to end, with ``causal=True``, which flash-attn (>= 2.1)
aligns bottom-right (query ``t`` of ``Lq`` sees the first ``Lk - Lq + t + 1`` keys: the ancestors and itself). Along a
path the gathered index grows by one per depth, so a sliding window in depth positions is flash-attn's own
``window_size=(window - 1, 0)``; soft-capping is its ``softcap``; GQA is native. This is the design of TRL 1.16's
``tree_fa3`` (experimental AsyncGRPO), built here from ``kv_end`` and the segments engine's decomposition.

The queries need no gather (segments tile the row in order); keys/values are gathered once per call (``index_select``,
whose backward sums each shared key's gradient over the paths through it). The index is built once per batch on the
CPU (one host sync per forward, as the segments plan) and shared by all layers.

What the kernel cannot compute exactly is refused with the reason (``flash_attn_refusal``); the automatic CUDA engine
(``hf_tree.attention.cuda``) sends such calls to another engine.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_tree.attention.batch_cache import BatchCache
from hf_tree.attention.engine import EngineRefused, TreeAttentionOptions
from hf_tree.attention.mask import autocast_inputs, check_sinks, has_bidirectional_blocks
from hf_tree.attention.segments import row_segments, segment_ancestors

VarlenAttention = Callable[..., torch.Tensor]
"""``flash_attn.flash_attn_varlen_func``'s contract: ``(q [Tq, H, D], k/v [Tk, Hkv, D], cu_seqlens_q [S + 1],
cu_seqlens_k [S + 1] (int32), max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
alibi_slopes, deterministic, return_attn_probs) -> [Tq, H, D]``."""

# flash-attn 2's kernels: half types only, head dims up to 256.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
INSTALL_HINT = "pip install 'hf-tree[gpu]' (flash-attn >= 2.6.3, built for this torch and CUDA)"


class FlashAttnRefused(EngineRefused):
    """The ``flash_attn`` engine was asked for what its kernel cannot compute exactly (the message says what)."""


@dataclass(frozen=True)
class VarlenTreeIndex:
    """The varlen layout of packed tree rows: one sequence per segment."""

    key_index: torch.Tensor
    """``[K]`` int64 flat token indices ``row * N + j`` of the keys/values to gather: every segment's root-to-segment
    path (ancestors, then the segment), segment after segment."""
    cu_seqlens_q: torch.Tensor
    """``[S + 1]`` int32 segment boundaries in the flattened ``B * N`` tokens."""
    cu_seqlens_k: torch.Tensor
    """``[S + 1]`` int32 path boundaries in ``key_index``."""
    max_seqlen_q: int
    """Tokens of the longest segment."""
    max_seqlen_k: int
    """Keys of the longest path."""


def varlen_tree_index(kv_end: torch.Tensor, device: torch.device | None = None) -> VarlenTreeIndex:
    """The ``VarlenTreeIndex`` of ``kv_end [B, N]`` (any integer dtype/device); tensors on ``device`` (default:
    ``kv_end``'s)."""
    rows = kv_end.detach().to("cpu", torch.int64)
    device = kv_end.device if device is None else device
    batch, n = rows.shape
    query_starts, run_starts, run_lengths, path_lengths = [], [], [], []
    for b in range(batch):
        starts, stops, subtree_ends = row_segments(rows[b])
        query_starts.append(starts + b * n)
        for s, e, runs in segment_ancestors(starts.tolist(), stops.tolist(), subtree_ends.tolist()):
            path = (*runs, (s, e))  # the ancestors' key runs, then the segment itself
            lengths = [z - a for a, z in path]
            run_starts += [b * n + a for a, _ in path]
            run_lengths += lengths
            path_lengths.append(sum(lengths))
    starts_t, lengths_t = torch.tensor(run_starts), torch.tensor(run_lengths)
    # Run r covers key_index[offset_r : offset_r + length_r] = run_start_r + (position - offset_r).
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    key_index = torch.repeat_interleave(starts_t - offsets, lengths_t) + torch.arange(int(lengths_t.sum()))
    cu_seqlens_q = torch.cat([*query_starts, torch.tensor([batch * n])])
    cu_seqlens_k = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(path_lengths), 0)])
    return VarlenTreeIndex(
        key_index=key_index.to(device),
        cu_seqlens_q=cu_seqlens_q.to(device, torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(device, torch.int32),
        max_seqlen_q=int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()),
        max_seqlen_k=max(path_lengths),
    )


_indices: BatchCache[VarlenTreeIndex] = BatchCache()


def cached_varlen_tree_index(kv_end: torch.Tensor) -> VarlenTreeIndex:
    """``varlen_tree_index`` once per batch (all layers share it; ``hf_tree.attention.batch_cache``)."""
    return _indices.get((kv_end,), (), lambda: varlen_tree_index(kv_end))


def varlen_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    *,
    scaling: float,
    attend: VarlenAttention,
    sliding_window: int | None = None,
    softcap: float | None = None,
    index: VarlenTreeIndex | None = None,
) -> torch.Tensor:
    """Tree attention through any kernel ``attend`` with ``flash_attn_varlen_func``'s contract (``VarlenAttention``):
    ``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]``, ``kv_end [B, N]`` -> ``[B, N, H, D]`` in ``attend``'s
    output dtype. ``sliding_window`` is in depth positions (= gathered path positions); no other mask feature."""
    batch, heads, n, _ = query.shape
    if index is None:
        index = cached_varlen_tree_index(kv_end)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, h, N, d] -> [B * N, h, d] (a view for transformers' layout)
        return x.transpose(1, 2).reshape(batch * n, x.shape[1], x.shape[3])

    out = attend(
        tokens(query),
        tokens(key).index_select(0, index.key_index),
        tokens(value).index_select(0, index.key_index),
        index.cu_seqlens_q,
        index.cu_seqlens_k,
        index.max_seqlen_q,
        index.max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scaling,
        causal=True,  # bottom-right aligned: each query sees its path up to itself
        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
        softcap=0.0 if softcap is None else softcap,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    )
    return out.view(batch, n, heads, value.shape[3])


@functools.cache
def flash_attn_varlen_func() -> VarlenAttention | None:
    """``flash_attn.flash_attn_varlen_func``, or ``None`` when flash-attn is not installed (or does not load)."""
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except (ImportError, OSError):  # OSError: a wheel built for another CUDA/torch fails to load its library
        return None


def _input_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the kernel would receive: the enclosing autocast's (``autocast_inputs``), else ``x``'s."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def flash_attn_refusal(
    query: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None = None,
    bidirectional_block: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> str | None:
    """Why the flash engine cannot run a call exactly (``query [B, H, N, D]``, ``value [B, Hkv, N, Dv]``), or
    ``None`` when it can."""
    if sinks is not None:
        return (
            "attention sinks: flash_attn_varlen_func has no sink logit, and the log-sum-exp it can return carries no "
            "gradient (the sink could not be trained)"
        )
    if has_bidirectional_blocks(bidirectional_block):
        return "bidirectional blocks: a causal varlen sequence cannot let a block's tokens see its later tokens"
    if attention_chunk is not None:
        return f"attention_chunk={attention_chunk}: flash-attn has sliding windows but no chunked attention"
    dtype = _input_dtype(query)
    if dtype not in FLASH_DTYPES:
        return f"{dtype}: flash-attn's kernels take float16/bfloat16 only (casting would change the results)"
    if query.shape[3] > MAX_HEAD_DIM or value.shape[3] != query.shape[3]:
        return (
            f"head dims {query.shape[3]} (query/key), {value.shape[3]} (value): flash-attn 2 needs equal dims of at "
            f"most {MAX_HEAD_DIM}"
        )
    if not query.is_cuda:
        return f"device {query.device.type!r}: flash-attn runs on CUDA only"
    if flash_attn_varlen_func() is None:
        return f"flash-attn is not installed: {INSTALL_HINT}"
    return None


def flash_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """Tree attention with ``flash_attn_varlen_func`` on CUDA (float16/bfloat16, or under such an autocast), a
    ``TreeAttentionEngine`` (``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]``, ``kv_end [B, N]`` ->
    ``[B, N, H, D]``). Forward and backward are flash-attn's (differentiable). Raises ``FlashAttnRefused`` (a
    ``ValueError``) with the reason for what the kernel cannot compute exactly (``flash_attn_refusal``); the
    ``position_ids`` are not read: the gathered path positions are the depths (windows are measured along the
    path)."""
    check_sinks("flash_tree_attention", options.sinks, query.shape[1])
    reason = flash_attn_refusal(query, value, options.sinks, options.bidirectional_block, options.attention_chunk)
    if reason is not None:
        raise FlashAttnRefused(
            f"attention backend 'flash_attn' cannot run this call: {reason}. Use 'flex' on CUDA (or the automatic "
            "choice, 'cuda', which sends such calls to an engine that computes them)."
        )
    query, key, value = autocast_inputs(query, key, value)
    with torch.autocast(query.device.type, enabled=False):
        return varlen_tree_attention(
            query,
            key,
            value,
            kv_end,
            scaling=options.scaling,
            attend=flash_attn_varlen_func(),
            sliding_window=options.sliding_window,
            softcap=options.softcap,
        )
