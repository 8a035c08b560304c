"""A pure-PyTorch stand-in for ``flash_attn.flash_attn_varlen_func`` (tests only): the same call contract, computed
sequence by sequence with an explicit mask, so that the flash engine's gathered tensors and arguments can be checked
on CPU in float64, forward and backward.

The contract (flash-attn >= 2.6 docs): ``q [Tq, H, D]``, ``k/v [Tk, Hkv, D]`` (``H % Hkv == 0``), sequence ``i`` is
``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` against ``k/v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]``; with ``causal`` the
mask is bottom-right aligned (query ``t`` of ``Lq`` sits at key position ``t + Lk - Lq``); ``window_size=(left,
right)`` keeps keys in ``[pos - left, pos + right]`` (``-1``: unbounded); ``softcap > 0`` caps the scaled scores with
``softcap * tanh(s / softcap)``. Returns ``[Tq, H, D]``.
"""

from __future__ import annotations

import torch

from hf_tree.attention.reference import masked_attention


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and cu_seqlens_q.shape == cu_seqlens_k.shape
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0] == v.shape[0]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    outs = []
    for q0, q1, k0, k1 in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:], strict=True):
        num_q, num_k = int(q1 - q0), int(k1 - k0)
        assert 0 < num_q <= max_seqlen_q and 0 < num_k <= max_seqlen_k
        position = torch.arange(num_q)[:, None] + num_k - num_q  # bottom-right aligned
        key_position = torch.arange(num_k)[None, :]
        visible = torch.ones(num_q, num_k, dtype=torch.bool)
        if causal:
            visible &= key_position <= position
        if left >= 0:
            visible &= key_position >= position - left
        if right >= 0:
            visible &= key_position <= position + right
        out = masked_attention(
            *(x[a:b].transpose(0, 1)[None] for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
            visible,
            scaling=scale,
            softcap=softcap if softcap > 0 else None,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
