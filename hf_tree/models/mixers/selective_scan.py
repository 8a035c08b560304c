"""Tree-aware Mamba-1 selective scan (Mamba, Falcon-Mamba, Jamba and Zamba mixers).

The recurrence, per channel d and state index n, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t``
(then ``+ D x_t`` and ``* silu(z_t)``, token-local), must start each trie segment from its parent segment's final
state (zero at a root). Segments run level by level (``TreeTopology.levels``) as for the Mamba2 scan and the delta
rule; within a level the segments advance together one token per step, the longest first, so the segments still
running at step s are a prefix of the level's state batch.

The per-token arithmetic is that of the models' own torch path (transformers' ``mamba_selective_scan`` fallback:
the same ``dA * h + dBu`` update, the state cast to the input dtype before ``C``). The fallback casts ``B`` and ``x``
to float32; the tree scan computes in float32, or float64 for float64 inputs (as the other tree ops), so a branch of
the tree equals the same scan on the branch alone to float64 rounding, and the fallback to float32 rounding.

Memory: the discretised ``exp(dt A)`` and ``dt B x`` (``[tokens, channels, state]``) and one state per step, as that
fallback keeps. It runs on every device: mamba-ssm's ``selective_scan_fn`` takes no initial state, so it cannot start
a segment from its parent's state; one step per token of the level's longest segment (a Python loop, as the
fallback's) is the price on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_tree.models.mixers.topology import LevelLayout, TreeTopology, scan_levels

if TYPE_CHECKING:
    from hf_tree.attention.prefix import PrefixCache


@contextlib.contextmanager
def _state_key_per_head(prefix: PrefixCache | None, A: torch.Tensor) -> Iterator[None]:
    """Depth-first execution: key this scan's carried state by its convolution and its head.

    Zamba's mixer runs one convolution, then one scan per head on ``A[head]``, a view into the layer's ``[heads, D, N]``
    tensor; the view's offset names the head in every unit. The convolution's id (``PrefixCache.mixer``, consumed by
    ``recurrent_state_key``) is handed on to the next head's scan while the view does not reach the storage's end.
    Without a convolution before it the scan is refused as before (``recurrent_state_key``)."""
    if prefix is None or prefix.mixer is None:
        yield
        return
    convolution = prefix.mixer
    prefix.mixer = (convolution, A.storage_offset())
    yield
    if A.storage_offset() + A.numel() < A.untyped_storage().nbytes() // A.element_size():
        prefix.mixer = convolution


def _level_scan(
    a: torch.Tensor,
    dt: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    x: torch.Tensor,
    input_dtype: torch.dtype,
    initial_state: torch.Tensor,
    layout: LevelLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One level, one token of each running segment per step. ``a [D, N]``; token rows ``dt/x [T, D]``,
    ``b/c [T, N]``; ``initial_state [S, D, N]`` in the layout's segment order (longest first).

    Returns (``[M, D]`` outputs of the level's M tokens, their token indices, ``[S, D, N]`` final states)."""
    index = layout.token_index  # chunk size 1: every slot is a token, step-major
    step_dt = dt[index][..., None]
    decay = torch.exp(a[None] * step_dt)  # [M, D, N], the fallback's discrete_A
    compute = initial_state.dtype
    update = step_dt * b[index][:, None, :].to(compute) * x[index][..., None].to(compute)  # its deltaB_u
    c = c[index][..., None]  # [M, N, 1]
    state, finished, outputs, offset = initial_state, [], [], 0
    for count in layout.step_counts:
        if count < state.shape[0]:  # the shortest segments ended: their final states
            finished.append(state[count:])
            state = state[:count]
        step = slice(offset, offset + count)
        state = decay[step] * state + update[step]
        outputs.append(torch.matmul(state.to(input_dtype), c[step])[..., 0])
        offset += count
    return torch.cat(outputs), index, torch.cat([state, *reversed(finished)])


def tree_mamba_selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    *,
    topology: TreeTopology,
    **kwargs,
) -> torch.Tensor:
    """``mamba_selective_scan`` over a packed tree.

    Args:
        hidden_states: ``[B, D, L]`` (channels first, as the mixers pass it); dt: ``[B, D, L]`` (before bias and
            softplus); A: ``[D, N]``; B, C: ``[B, N, L]``; D, delta_bias: ``[D]``; z: ``[B, D, L]`` gate.
        use_mambapy, use_associative_scan: other algorithms of the same recurrence in the fallback; the tree scan is
            one algorithm for all.
        topology: the batch's ``TreeTopology`` (``[B, L]``).
        kwargs: the model's other keyword arguments, ignored, except ``kv_prefix`` (depth-first execution): the
            rows' roots start from the ancestors' cached state, and the state after each row's last token is
            recorded (``scan_levels``).

    Returns:
        ``[B, D, L]``, in the dtype of the fallback's output.
    """
    if return_last_state:
        raise ValueError(
            "the tree-aware Mamba selective scan got return_last_state=True together with kv_end: a packed tree has "
            "no single final state to cache; call the model with use_cache=False when passing kv_end."
        )
    batch, channels, length = hidden_states.shape
    if topology.shape != (batch, length):
        raise ValueError(
            f"kv_end has shape {list(topology.shape)}; the Mamba selective scan got [batch, seq] = {[batch, length]}."
        )
    input_dtype = hidden_states.dtype
    if delta_bias is not None:  # token-local discretisation, in the fallback's order and dtypes
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    state_dtype = torch.promote_types(
        torch.promote_types(A.dtype, dt.dtype), torch.promote_types(input_dtype, torch.float32)
    )

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, X, L] -> [B * L, X]
        return t.transpose(1, 2).reshape(batch * length, t.shape[1])

    x, dt, b, c = (rows(t) for t in (hidden_states, dt, B, C))
    zeros = torch.zeros(channels, A.shape[-1], dtype=state_dtype, device=hidden_states.device)
    prefix = kwargs.get("kv_prefix")
    with _state_key_per_head(prefix, A):
        out = scan_levels(
            topology,
            1,
            zeros,
            lambda initial, layout: _level_scan(A, dt, b, c, x, input_dtype, initial, layout),
            prefix,
        )
    out = out.reshape(batch, length, channels).transpose(1, 2)
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return out
