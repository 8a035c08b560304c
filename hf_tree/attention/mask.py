"""The tree mask as a small pure factory over ``kv_end`` (one int per key; see DESIGN.md).

Query ``i`` sees key ``j`` iff ``j <= i < kv_end[j]`` (and, with a sliding window, iff
``depth(i) - depth(j) < window``). Only tests, the reference engine and debugging pictures may
materialise the ``N x N`` mask.
"""

from __future__ import annotations

import torch


def check_window_depths(where: str, position_ids: torch.Tensor | None, sliding_window: int | None) -> None:
    """Raise (naming ``where``) when a sliding window is asked for without the depths it measures."""
    if sliding_window is not None and position_ids is None:
        raise ValueError(f"{where}: a sliding_window needs position_ids (depths) to measure distance.")


def check_sinks(where: str, sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raise (naming ``where``) unless ``sinks`` is ``None`` or one sink logit per query head, ``[H]``."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"{where}: attention sinks must be one logit per query head, shape ({num_heads},); got "
            f"{tuple(sinks.shape)}. Per-token sinks are not supported by the tree engines."
        )


def tree_mask_mod(kv_end: torch.Tensor, position_ids: torch.Tensor | None = None, sliding_window: int | None = None):
    """A FlexAttention-style ``mask_mod(b, h, q, kv) -> bool`` for a batch of packed rows.

    Args:
        kv_end: ``[B, N]`` integer, packed index where the subtree of each key's node ends.
        position_ids: ``[B, N]`` depth of each token; needed only with ``sliding_window``.
        sliding_window: keys more than ``sliding_window - 1`` depth positions above the query are hidden.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])
        if sliding_window is not None:
            visible = visible & (position_ids[b, q_idx] - position_ids[b, kv_idx] < sliding_window)
        return visible

    return mask_mod


def dense_tree_mask(
    kv_end: torch.Tensor, position_ids: torch.Tensor | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """``[B, N, N]`` bool mask, ``True`` where query (dim 1) sees key (dim 2). For tests and the reference."""
    check_window_depths("dense_tree_mask", position_ids, sliding_window)
    n = kv_end.shape[-1]
    q = torch.arange(n, device=kv_end.device)[None, :, None]
    kv = torch.arange(n, device=kv_end.device)[None, None, :]
    visible = (kv <= q) & (q < kv_end[:, None, :])
    if sliding_window is not None:
        visible = visible & (position_ids[:, :, None] - position_ids[:, None, :] < sliding_window)
    return visible


def render_mask(kv_end: torch.Tensor, max_size: int = 64) -> str:
    """A text picture of one row's mask (``#`` visible, ``.`` hidden) to debug packing by eye."""
    mask = dense_tree_mask(kv_end[None, :max_size])[0]
    return "\n".join("".join("#" if v else "." for v in row) for row in mask.tolist())
