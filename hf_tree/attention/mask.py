"""The tree mask as a small pure factory over ``kv_end`` (one int per key; see docs/design.md).

Query ``i`` sees key ``j`` iff ``j <= i < kv_end[j]`` or, with a bidirectional overlay, both lie in the same
bidirectional block (``block[i] == block[j] >= 0``: e.g. Gemma 3's image tokens, one block per image); and, with a
sliding window, iff ``depth(i) - depth(j) < window`` (the window cuts the overlay too, as Gemma 3's local layers do:
``AND(window, OR(causal, block))``); with chunked attention (Llama 4), iff ``depth(i) // chunk == depth(j) // chunk``:
a token's chunk is a function of its depth, so every branch keeps the chunks it has alone. This module holds the
only definitions of that rule
(``tree_mask_mod``), of the number of keys a query sees (``visible_keys_per_query``) and of the dtype
attention computes its softmax in (``compute_dtype``); dense masks, block masks, the engines' per-block
masks and the pictures are derived from them (the attention-gym pattern). Only tests, the reference
engine and debugging pictures may materialise the ``N x N`` mask.
"""

from __future__ import annotations

import torch


def check_window_depths(
    where: str, position_ids: torch.Tensor | None, sliding_window: int | None, attention_chunk: int | None = None
) -> None:
    """Raise (naming ``where``) when a sliding window or attention chunks are asked for without the depths they
    measure."""
    if (sliding_window is not None or attention_chunk is not None) and position_ids is None:
        raise ValueError(
            f"{where}: a sliding_window or attention_chunk needs position_ids (depths) to measure distance."
        )


def lowest_visible_depth(
    depth: torch.Tensor, sliding_window: int | None, attention_chunk: int | None
) -> torch.Tensor | None:
    """The shallowest key depth each query ``depth [...]`` may see on its own path (window and chunk start), or
    ``None`` without either. Along one branch, where a key is never deeper than its query, this is the whole
    local rule of ``tree_mask_mod``; engines use it to skip keys per query block."""
    if sliding_window is None and attention_chunk is None:
        return None
    lowest = torch.full_like(depth, torch.iinfo(torch.int64).min)
    if sliding_window is not None:
        lowest = torch.maximum(lowest, depth - (sliding_window - 1))
    if attention_chunk is not None:
        lowest = torch.maximum(lowest, depth - depth % attention_chunk)
    return lowest


def check_sinks(where: str, sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raise (naming ``where``) unless ``sinks`` is ``None`` or one sink logit per query head, ``[H]``."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"{where}: attention sinks must be one logit per query head, shape ({num_heads},); got "
            f"{tuple(sinks.shape)}. Per-token sinks are not supported by the tree engines."
        )


def check_bidirectional_block(where: str, kv_end: torch.Tensor, bidirectional_block: torch.Tensor | None) -> None:
    """Raise (naming ``where``) unless ``bidirectional_block`` is ``None`` or an integer ``[B, N]`` like ``kv_end``."""
    if bidirectional_block is None:
        return
    if bidirectional_block.shape != kv_end.shape or bidirectional_block.is_floating_point():
        raise ValueError(
            f"{where}: bidirectional_block must be an integer tensor shaped like kv_end {tuple(kv_end.shape)} (one "
            f"block id per token, -1 for none); got {bidirectional_block.dtype} {tuple(bidirectional_block.shape)}."
        )


def has_bidirectional_blocks(bidirectional_block: torch.Tensor | None) -> bool:
    """Whether a bidirectional overlay ``[B, N]`` marks any token (all ``-1``: the plain tree mask)."""
    return bidirectional_block is not None and bool((bidirectional_block >= 0).any())


def tree_mask_mod(
    kv_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    bidirectional_block: torch.Tensor | None = None,
    attention_chunk: int | None = None,
):
    """A FlexAttention-style ``mask_mod(b, h, q, kv) -> bool`` for a batch of packed rows.

    Args:
        kv_end: ``[B, N]`` integer, packed index where the subtree of each key's node ends.
        position_ids: ``[B, N]`` depth of each token; needed only with ``sliding_window``.
        sliding_window: keys more than ``sliding_window - 1`` depth positions above the query are hidden.
        bidirectional_block: ``[B, N]`` integer block of each token, ``-1`` for none: tokens of one block see each
            other both ways (each block must lie inside one tree node; ``hf_tree.vision.forward`` checks it).
        attention_chunk: keys in another chunk of ``attention_chunk`` depth positions than the query are hidden
            (Llama 4's chunked attention, transformers' ``chunked_overlay`` measured in depths).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        # Any broadcastable index tensors work: FlexAttention's scalars, or whole grids (dense_tree_mask).
        visible = (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])
        if bidirectional_block is not None:
            block = bidirectional_block[b, q_idx]
            visible = visible | ((block == bidirectional_block[b, kv_idx]) & (block >= 0))
        if sliding_window is not None:
            visible = visible & (position_ids[b, q_idx] - position_ids[b, kv_idx] < sliding_window)
        if attention_chunk is not None:
            visible = visible & (
                position_ids[b, q_idx] // attention_chunk == position_ids[b, kv_idx] // attention_chunk
            )
        return visible

    return mask_mod


def dense_tree_mask(
    kv_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    bidirectional_block: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """``[B, N, N]`` bool mask, ``True`` where query (dim 1) sees key (dim 2). For tests and the reference."""
    check_window_depths("dense_tree_mask", position_ids, sliding_window, attention_chunk)
    check_bidirectional_block("dense_tree_mask", kv_end, bidirectional_block)
    batch, n = kv_end.shape
    rows = torch.arange(batch, device=kv_end.device)[:, None, None]
    positions = torch.arange(n, device=kv_end.device)
    mask_mod = tree_mask_mod(kv_end, position_ids, sliding_window, bidirectional_block, attention_chunk)
    return mask_mod(rows, None, positions[:, None], positions[None, :])


def visible_keys_per_query(kv_end: torch.Tensor) -> torch.Tensor:
    """Keys each query sees under the tree mask, in O(N) (a difference array over ``kv_end``).

    Args:
        kv_end: ``[..., N]`` integer subtree ends (``j < kv_end[j] <= N``).

    Returns:
        ``[..., N]`` int64: ``#{j <= i : kv_end[j] > i}`` for every query ``i`` (its depth + 1 in a packed row).
    """
    kv_end = kv_end.long()
    n = kv_end.shape[-1]
    # Key j is seen by queries [j, kv_end[j]): +1 at j, -1 at kv_end[j], then a running sum.
    delta = torch.zeros(*kv_end.shape[:-1], n + 1, dtype=torch.int64, device=kv_end.device)
    delta[..., :n] = 1
    delta.scatter_add_(-1, kv_end, torch.full_like(kv_end, -1))
    return delta.cumsum(-1)[..., :n]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores are soft-maxed and accumulated in: float32 for half types (as HF eager attention and
    the log-softmax over a vocabulary need), the input dtype otherwise (float32, float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in the enclosing autocast's dtype (unchanged without autocast), for kernels that then run with
    autocast off: autocast would otherwise recast their float32 accumulators per op (SDPA casts its inputs once
    the same way)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def render_mask(kv_end: torch.Tensor, max_size: int = 64) -> str:
    """A text picture of one row's mask (``#`` visible, ``.`` hidden) to debug packing by eye."""
    mask = dense_tree_mask(kv_end[None, :max_size])[0]
    return "\n".join("".join("#" if v else "." for v in row) for row in mask.tolist())
