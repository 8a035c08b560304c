"""Tree-aware Mamba2 SSD scan (Mamba2, Nemotron-H, Falcon-H1, Bamba, Granite-MoE-hybrid mixers).

The state space recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t`` must start each
trie segment from its parent segment's final state (zero at a root). As for the delta rule, segments run level by
level (``TreeTopology.levels``), each level one batched chunked scan whose initial states are gathered
(differentiably) from the previous level's final states.

The torch path is the models' SSD algorithm (intra-chunk "attention" with the segment-sum decay mask, chunk end
states, a scan over chunks, the state read-out) on variable-length segments cut into chunks. It runs on every
device: mamba-ssm's fused varlen kernel takes one initial state per batch row, not per packed sequence, so it
cannot hand a parent's state to several children in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_tree.models.mixers.topology import LevelLayout, TreeTopology, gather_chunks, scan_levels, scatter_index


def _level_scan(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    initial_state: torch.Tensor,
    layout: LevelLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bucket of a level. Token rows ``x [T+1, H, P]`` (already times dt), ``a [T+1, H]`` (``A * dt``),
    ``b/c [T+1, H, N]`` (row T zero); ``initial_state [S, H, P, N]`` in the layout's segment order.

    Returns (``[M, H, P]`` outputs of the bucket's M tokens, their token indices, ``[S, H, P, N]`` final states)."""
    chunk_size = layout.chunk_size
    valid, index = scatter_index(layout, x.shape[0] - 1)
    x, b, c = (gather_chunks(t, layout).transpose(1, 2) for t in (x, b, c))  # [NC, C, H, *]
    a_cumsum = gather_chunks(a, layout).cumsum(dim=-1)  # [NC, H, C]
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).triu(1)
    decay = (a_cumsum[..., :, None] - a_cumsum[..., None, :]).masked_fill(strictly_upper, float("-inf")).exp()
    scores = torch.einsum("clhn,cshn->chls", c, b) * decay
    y_diag = torch.einsum("chls,cshp->clhp", scores, x)
    decay_to_end = (a_cumsum[..., -1:] - a_cumsum).exp()  # [NC, H, C]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", b, decay_to_end, x)
    chunk_decay = a_cumsum[..., -1].exp()[..., None, None]  # [NC, H, 1, 1]
    decay_in = a_cumsum.exp().transpose(1, 2)[..., None]  # [NC, C, H, 1]

    state, outputs, offset = initial_state, [], 0
    for count in layout.step_counts:  # step s: chunk s of the `count` longest segments
        block = slice(offset, offset + count)
        running = state[:count]
        outputs.append(torch.einsum("clhn,chpn->clhp", c[block], running) * decay_in[block])
        updated = running * chunk_decay[block] + chunk_states[block]
        state = torch.cat([updated, state[count:]]) if count < state.shape[0] else updated
        offset += count
    out = y_diag + torch.cat(outputs)  # [NC, C, H, P]
    return out.reshape(-1, *out.shape[2:])[valid], index, state


def tree_mamba2_chunk_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    topology: TreeTopology,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs,
) -> torch.Tensor:
    """``mamba2_chunk_scan`` over a packed tree.

    Args:
        hidden_states: ``[B, N, H, P]``; dt: ``[B, N, H]`` (before bias/softplus); A, D, dt_bias: ``[H]``;
        B, C: ``[B, N, G, N_state]`` (G groups, each serving ``H // G`` heads).
        topology: the batch's ``TreeTopology`` (``[B, N]``).
        kwargs: the model's other keyword arguments, ignored, except ``kv_prefix`` (depth-first execution): the
            rows' roots start from the ancestors' cached state, and the state after each row's last token is
            recorded (``scan_levels``).

    Returns:
        ``[B, N, H, P]`` in float32 (float64 for float64 inputs), like the models' torch path.
    """
    if initial_states is not None or return_final_states or kwargs.get("seq_idx") is not None:
        raise ValueError(
            "the tree-aware Mamba2 scan got initial_states/return_final_states/seq_idx together with kv_end: packed "
            "trees carry their own sequence boundaries and cannot be cached; call the model with use_cache=False."
        )
    batch, length, num_heads, head_dim = hidden_states.shape
    if topology.shape != (batch, length):
        raise ValueError(
            f"kv_end has shape {list(topology.shape)}; the Mamba2 scan got [batch, seq] = {[batch, length]}."
        )
    # Token-local discretisation, in the order and dtypes of the models' torch path.
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    compute = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(compute)
    residual = D.to(compute)[:, None] * x if D is not None else None
    heads_per_group = num_heads // B.shape[2]
    b, c = (t.to(compute).repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    x = x * dt[..., None].to(compute)
    a = A.to(compute) * dt.to(compute)

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, N, ...] -> [B*N + 1, ...] with a zero row last
        t = t.reshape(batch * length, *t.shape[2:])
        return torch.cat([t, t.new_zeros(1, *t.shape[1:])])

    x, a, b, c = (rows(t) for t in (x, a, b, c))
    zeros = x.new_zeros(num_heads, head_dim, b.shape[-1])
    out = scan_levels(
        topology,
        chunk_size,
        zeros,
        lambda initial, layout: _level_scan(x, a, b, c, initial, layout),
        kwargs.get("kv_prefix"),
    )
    out = out.reshape(batch, length, num_heads, head_dim)
    return out + residual if residual is not None else out
