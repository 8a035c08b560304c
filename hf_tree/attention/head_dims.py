"""Attention whose value head size differs from the query/key head size (MLA: DeepSeek V2/V3, Kimi K2, GLM-MoE-DSA,
LongCat...), on engines whose kernels need one head size.

Multi-head latent attention scores with ``Dqk = qk_nope_head_dim + qk_rope_head_dim`` but mixes values of
``Dv = v_head_dim``. PyTorch's fused CPU kernel (the segments engine) and flash-attn refuse ``Dqk != Dv``. Padding
is exact: zero value columns mix to exact zeros (sliced off), and zero query/key columns add exact zeros to every
score (the scale is passed explicitly, never derived from the padded size). The gradient of a pad is a slice, so
the unpadded columns' gradients are the engine's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def equal_head_dims(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``query [B, H, N, Dqk]``, ``key [B, Hkv, N, Dqk]``, ``value [B, Hkv, N, Dv]`` zero-padded to one head size
    ``max(Dqk, Dv)``, and ``Dv`` (slice the ``[..., D]`` output back to it)."""
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        query, key = F.pad(query, (0, v_dim - qk_dim)), F.pad(key, (0, v_dim - qk_dim))
    return query, key, value, v_dim
