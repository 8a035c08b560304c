"""Reference tree attention: explicit math over the dense mask. Slow, O(N^2) memory, obviously right.

Every fast engine is tested against this one, and tests can force it (see ``hf_tree.attention``).
"""

from __future__ import annotations

import torch

from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import check_sinks, compute_dtype, dense_tree_mask


def reference_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """Attention of a packed tree row, a ``TreeAttentionEngine``: ``query [B, H, N, D]``, ``key/value
    [B, Hkv, N, D]`` (``H % Hkv == 0``), ``kv_end [B, N]`` -> ``[B, N, H, D]`` in ``query``'s dtype, honouring every
    option (``TreeAttentionOptions``)."""
    check_sinks("reference_tree_attention", options.sinks, query.shape[1])
    visible = dense_tree_mask(
        kv_end, options.position_ids, options.sliding_window, options.bidirectional_block, options.attention_chunk
    )[:, None]
    out = masked_attention(
        query, key, value, visible, scaling=options.scaling, softcap=options.softcap, sinks=options.sinks
    )
    return out.transpose(1, 2).contiguous()


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention under a given boolean mask, the models' eager math (soft-capping, sinks, half-precision
    softmax in float32): ``query [B, H, Q, D]``, ``key/value [B, Hkv, K, D]``, ``visible`` broadcastable to
    ``[B, H, Q, K]`` -> ``[B, H, Q, D]`` in ``value``'s dtype. Shared by the reference engine and context
    parallel's query blocks."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more softmax column per head, dropped after the softmax (as eager attention does)
        sink_column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(scores.dtype))
    if sinks is not None:
        probs = probs[..., :-1]  # the sink takes its share of each row and contributes no value
    return torch.matmul(probs.to(value.dtype), value)
