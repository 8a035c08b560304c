"""Variable-length attention kernels that return the log-sum-exp and take it back in their backward.

One interface, ``VarlenKernel``, with flash-attn's varlen layout: ``q [Tq, H, D]``, ``k/v [Tk, Hkv, D]``, sequence
``i`` is ``q[cu_q[i]:cu_q[i + 1]]`` against ``k/v[cu_k[i]:cu_k[i + 1]]``, causal (aligned bottom-right, with an optional
window) or full; the forward returns the
output and each query's log-sum-exp ``[H, Tq]``, and the backward takes any output and log-sum-exp (the merged ones
of several parts, as ring attention does) besides the output gradient. Two implementations:

- CUDA: the flash kernel PyTorch ships (``aten::_flash_attention_forward``/``_backward`` with ``cu_seq`` offsets,
  the pair ``torch.nn.attention.varlen.varlen_attn`` runs; float16/bfloat16, sm80+). The aten pair is called, not
  ``varlen_attn``: its backward drops the log-sum-exp's gradient and cannot take a merged output, and a forward
  taken from another backend (``varlen_attn`` may pick cuDNN in some releases) would not match this backward.
  GQA is native from torch 2.13 (where ``varlen_attn`` declares ``enable_gqa``); before, K/V are repeated per group
  and their gradients summed back. Calls whose sequences all have one query are given repeated K/V too:
  FlashAttention-2's varlen forward takes a decoding path for them with GQA (``seqlenq_ngroups_swapped``: query
  heads moved into the sequence dimension) and hands its log-sum-exp back through a bare ``reshape``; that its
  varlen backward reads that layout back is not established (and not checked on a GPU), so that path is avoided.
- CPU: the same contract as a loop of PyTorch's fused CPU kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu``: float64 and GQA, returns the log-sum-exp) over the
  sequences, so that the engine's plan, calls and merge run on CPU in float64 in the tests.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# The CUDA kernel's limits (PyTorch's vendored FlashAttention-2).
CUDA_DTYPES = (torch.float16, torch.bfloat16)
MAX_CUDA_HEAD_DIM = 256
CUDA_HEAD_DIM_MULTIPLE = 8
MIN_CUDA_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class VarlenCall:
    """The sequences of one varlen call."""

    cu_q: torch.Tensor
    """``[S + 1]`` int32 query offsets (on the tensors' device)."""
    cu_k: torch.Tensor
    """``[S + 1]`` int32 key offsets."""
    max_q: int
    """Queries of the longest sequence."""
    max_k: int
    """Keys of the longest sequence."""
    bounds: tuple[tuple[int, int, int, int], ...]
    """``(q0, q1, k0, k1)`` per sequence, on the host (the CPU kernel's loop)."""


class VarlenKernel(Protocol):
    """A varlen attention kernel with the log-sum-exp (module docstring)."""

    def takes_grouped_kv(self, call: VarlenCall) -> bool:
        """Whether ``call``'s ``k/v`` may have fewer heads than ``q`` (GQA/MQA); else the caller repeats them."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: VarlenCall,
        causal: bool,
        scale: float,
        window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(out [Tq, H, D] in q's dtype, lse [H, Tq] in the softmax dtype, state for backward)``. ``causal``: aligned
        bottom-right (query ``t`` of ``Lq`` sits at key position ``t + Lk - Lq``); ``window`` (causal only): keys at
        most ``window`` positions before their query, or ``None``."""
        ...

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: VarlenCall,
        causal: bool,
        scale: float,
        window: int | None,
        state: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` for the output gradient ``grad_out [Tq, H, D]`` given the softmax's ``out`` and
        ``lse [H, Tq]`` (contiguous), which may be those of a larger softmax this call is part of."""
        ...


def _window(window: int | None) -> dict:
    """The flash ops' window arguments: ``window`` keys back, none ahead (or no window)."""
    return {} if window is None else {"window_size_left": window, "window_size_right": 0}


class CudaFlashVarlen:
    """PyTorch's flash varlen kernel on CUDA (module docstring)."""

    def __init__(self, native_gqa: bool) -> None:
        self.native_gqa = native_gqa

    def takes_grouped_kv(self, call: VarlenCall) -> bool:
        return self.native_gqa and call.max_q > 1  # one-query calls: the decoding path (module docstring)

    def forward(self, q, k, v, call: VarlenCall, causal: bool, scale: float, window: int | None):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0, causal, False, scale=scale, **_window(window)
        )
        if lse.shape != (q.shape[1], q.shape[0]):  # older layouts ([S, H, max_q]) would merge wrong rows
            raise RuntimeError(
                f"torch's flash varlen kernel returned a log-sum-exp of shape {tuple(lse.shape)}, expected "
                f"[heads, tokens] = {[q.shape[1], q.shape[0]]}: this torch is not supported by the 'varlen' engine."
            )
        return out, lse, (rng_state, unused)

    def backward(self, grad_out, q, k, v, out, lse, call: VarlenCall, causal: bool, scale: float, window, state):
        rng_state, unused = state
        return torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0, causal, rng_state, unused,
            scale=scale, **_window(window),
        )  # fmt: skip


_cpu_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _mask(q0: int, q1: int, k0: int, k1: int, causal: bool, window: int | None, dtype: torch.dtype) -> dict:
    """The CPU kernel's mask arguments for the sequence ``q[q0:q1]`` against ``k[k0:k1]``."""
    if causal and (q1 - q0 != k1 - k0 or window is not None):
        return {"is_causal": False, "attn_mask": _bottom_right_mask(q1 - q0, k1 - k0, window, dtype)}
    return {"is_causal": causal}


def _sequence(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``x [T, h, d]`` -> the tokens ``[start, stop)`` as one batch of the CPU kernel, ``[1, h, L, d]`` (a view)."""
    return x[start:stop].transpose(0, 1).unsqueeze(0)


def _bottom_right_mask(num_q: int, num_k: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``[Lq, Lk]`` additive mask (the CPU kernel's form): causal aligned bottom-right, within ``window`` if any."""
    position = torch.arange(num_q)[:, None] + (num_k - num_q)
    key = torch.arange(num_k)[None, :]
    visible = key <= position
    if window is not None:
        visible &= key >= position - window
    return torch.zeros(num_q, num_k, dtype=dtype).masked_fill_(~visible, float("-inf"))


class CpuVarlen:
    """The varlen contract on CPU: PyTorch's fused CPU flash-attention kernel, one call per sequence. Its own causal
    mask is aligned top-left, the contract's for square sequences; others, and windows, get an explicit mask."""

    def takes_grouped_kv(self, call: VarlenCall) -> bool:
        return True

    def forward(self, q, k, v, call: VarlenCall, causal: bool, scale: float, window: int | None):
        outs, lses = [], []
        for q0, q1, k0, k1 in call.bounds:
            parts = (_sequence(q, q0, q1), _sequence(k, k0, k1), _sequence(v, k0, k1))
            out, lse = _cpu_forward(*parts, **_mask(q0, q1, k0, k1, causal, window, q.dtype), scale=scale)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1), None

    def backward(self, grad_out, q, k, v, out, lse, call: VarlenCall, causal: bool, scale: float, window, state):
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for q0, q1, k0, k1 in call.bounds:
            part = _cpu_backward(
                _sequence(grad_out, q0, q1),
                _sequence(q, q0, q1),
                _sequence(k, k0, k1),
                _sequence(v, k0, k1),
                _sequence(out, q0, q1),
                lse[:, q0:q1].unsqueeze(0).contiguous(),
                0.0,
                **_mask(q0, q1, k0, k1, causal, window, q.dtype),
                scale=scale,
            )
            for total, grad, (a, b) in zip(grads, part, ((q0, q1), (k0, k1), (k0, k1)), strict=True):
                total[a:b] += grad[0].transpose(0, 1)  # keys of distinct sequences do not overlap
        return tuple(grads)


@functools.cache
def _varlen_attn_parameters() -> frozenset[str]:
    """The parameters of this torch's ``torch.nn.attention.varlen.varlen_attn`` (empty before torch 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_declares_varlen_gqa() -> bool:
    """Whether this torch's ``varlen_attn`` takes ``enable_gqa`` (2.13+): its flash kernel then takes fewer K/V
    heads than query heads."""
    return "enable_gqa" in _varlen_attn_parameters()


def cuda_kernel_refusal(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why the CUDA kernel cannot run inputs of ``dtype`` and ``head_dim`` on ``device``, or ``None``."""
    if dtype not in CUDA_DTYPES:
        return f"{dtype}: the flash kernel takes float16/bfloat16 only (casting would change the results)"
    if head_dim > MAX_CUDA_HEAD_DIM or head_dim % CUDA_HEAD_DIM_MULTIPLE:
        return f"head dim {head_dim}: the flash kernel needs a multiple of 8 of at most {MAX_CUDA_HEAD_DIM}"
    if "window_size" not in _varlen_attn_parameters():  # the flash ops' varlen and window arguments as used here
        return f"torch {torch.__version__} has no varlen attention with windows (torch.nn.attention.varlen, 2.11+)"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without its flash-attention kernels"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        return f"compute capability {capability}: the flash kernel needs sm80 or newer"
    return None


def varlen_kernel(device: torch.device) -> VarlenKernel:
    """The kernel for tensors on ``device`` (CUDA or CPU; others are refused by the engine first)."""
    if device.type == "cuda":
        return CudaFlashVarlen(native_gqa=torch_declares_varlen_gqa())
    return CpuVarlen()
