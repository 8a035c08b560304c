"""Tree-aware chunked gated delta rule: GatedDeltaNet (Qwen3.5 / Qwen3-Next / OLMo-hybrid) and Kimi delta attention
(Kimi Linear), which is the same rule with a decay per key channel instead of one per head.

The recurrence over a state ``S [K, V]``: ``S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T``,
``o_t = S_t^T q_t``, with ``D_t = exp(g_t) I`` (GatedDeltaNet, ``g [.., H]``) or ``D_t = diag(exp(g_t))`` (Kimi,
``g [.., H, K]``). It must start each trie segment from its parent segment's final state (zero at a root). Segments
run level by level (``TreeTopology.levels``): one batched call per level whose initial states are gathered from the
previous level's final states. The gather is differentiable, so in backward the state gradients of siblings add up.

The torch path is the models' own chunked algorithm (intra-chunk UT transform, then a scan over chunks), written for
variable-length segments cut into chunks and for either decay (a per-head decay is a per-channel one shared by every
channel); it computes in ``float32`` or in ``float64`` for ``float64`` inputs. On CUDA with ``flash-linear-attention``
installed each level is one varlen FLA call (``chunk_gated_delta_rule`` or ``chunk_kda``) with per-segment initial
states.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from hf_tree.models.mixers.topology import LevelLayout, TreeTopology, gather_chunks, scan_levels, scatter_index


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The models' (and FLA's) query/key normalisation."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _unit_lower_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of unit lower-triangular ``[..., C, C]`` matrices (C a power of two; the strictly upper part is
    ignored): blockwise, ``inv([[A, 0], [X, B]]) = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]`` for block sizes 1, 2, 4, ...
    log2(C) rounds of batched matmuls; on CPU much faster than ``solve_triangular``, which solves each small matrix
    with its own LAPACK call."""
    size = matrix.shape[-1]
    lead = matrix.shape[:-2]
    blocks = torch.ones(*lead, size, 1, 1, dtype=matrix.dtype, device=matrix.device)  # inverses of 1x1 diagonals
    width = 1
    while width < size:
        count = size // (2 * width)
        diagonal = matrix.reshape(*lead, count, 2 * width, count, 2 * width).diagonal(dim1=-4, dim2=-2)
        lower = diagonal.movedim(-1, -3)[..., width:, :width]  # [..., count, width, width]
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        top = torch.cat([first, torch.zeros_like(first)], dim=-1)
        bottom = torch.cat([-(second @ lower @ first), second], dim=-1)
        blocks = torch.cat([top, bottom], dim=-2)
        width *= 2
    return blocks[..., 0, :, :]


def _solve_unit_lower(matrix: torch.Tensor, *rights: torch.Tensor) -> list[torch.Tensor]:
    """``matrix^-1 @ right`` for each right-hand side (unit lower-triangular ``matrix [..., C, C]``)."""
    size = matrix.shape[-1]
    if size & (size - 1) == 0:
        inverse = _unit_lower_inverse(matrix)
        return [inverse @ right for right in rights]
    return [torch.linalg.solve_triangular(matrix, r, upper=False, unitriangular=True) for r in rights]


# Kimi's per-channel decays within a chunk are taken explicitly (a [C, C, K] tensor, like the model's own torch path)
# only inside blocks of this many tokens; across blocks they factor through the block's first token.
DECAY_BLOCK = 16


def _decayed_scores(cum: torch.Tensor, right: torch.Tensor, *lefts: torch.Tensor) -> list[torch.Tensor]:
    """``scores[..., i, j] = sum_c left[i, c] right[j, c] exp(cum[i, c] - cum[j, c])`` for ``j <= i``, zero above the
    diagonal, for each ``left`` against one ``right`` (``[..., C, K]`` chunks); ``cum [..., C, 1]`` (one decay per
    head) or ``[..., C, K]`` (one per key channel) cumulative log decays (non-increasing along C). Returns
    ``[..., C, C]`` each.

    Per channel, ``exp(cum_i - cum_j)`` cannot be split into ``exp(cum_i) exp(-cum_j)`` (the second factor overflows
    over a long chunk). Within a block of ``DECAY_BLOCK`` tokens it is taken as is; for ``j`` in an earlier block it
    is ``exp(cum_i - cum_s) exp(cum_s - cum_j)`` with ``s`` the first token of ``i``'s block, both factors ``<= 1``:
    a matmul instead of a ``[C, C, K]`` tensor. The decayed ``right`` is shared by every ``left``."""
    size = cum.shape[-2]
    upper = torch.ones(size, size, dtype=torch.bool, device=cum.device).triu(1)
    if cum.shape[-1] == 1:  # one decay for every channel: one [C, C] decay matrix
        pairwise = (cum[..., :, None, 0] - cum[..., None, :, 0]).masked_fill(upper, float("-inf")).exp()
        return [(left @ right.transpose(-1, -2)) * pairwise for left in lefts]
    block = DECAY_BLOCK if size % DECAY_BLOCK == 0 else size
    count = size // block
    blocks = cum.unflatten(-2, (count, block))  # [..., nb, b, K]
    within = (blocks[..., :, None, :] - blocks[..., None, :, :]).masked_fill(upper[:block, :block, None], float("-inf"))
    decayed_right = within.exp() * right.unflatten(-2, (count, block))[..., None, :, :]  # [..., nb, b, b, K]
    if count > 1:
        starts = blocks[..., :1, :]  # [..., nb, 1, K]: the first token of each block
        to_start = (blocks - starts).exp().flatten(-3, -2)  # [..., C, K]: exp(cum_i - cum_s(i))
        earlier = torch.arange(size, device=cum.device) < torch.arange(0, size, block, device=cum.device)[:, None]
        from_start = (starts - cum[..., None, :, :]).masked_fill(~earlier[..., None], float("-inf")).exp()
        earlier_right = (right[..., None, :, :] * from_start).transpose(-1, -2)  # [..., nb, K, C]
        identity = torch.eye(count, dtype=cum.dtype, device=cum.device)[:, None, :, None]  # [nb, 1, nb, 1]
    scores = []
    for left in lefts:
        left_blocks = left.unflatten(-2, (count, block))[..., None]  # [..., nb, b, K, 1]
        diagonal = (decayed_right @ left_blocks)[..., 0]  # [..., nb, b, b]
        if count == 1:
            scores.append(diagonal.flatten(-3, -2))
            continue
        across = (left * to_start).unflatten(-2, (count, block)) @ earlier_right  # [..., nb, b, C]
        block_diagonal = diagonal[..., :, :, None, :] * identity  # [..., nb, b, nb, b]
        scores.append((across + block_diagonal.flatten(-2, -1)).flatten(-3, -2))
    return scores


def _level_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    layout: LevelLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bucket of a level. Token rows ``query/key [T+1, H, K]``, ``value [T+1, H, V]``, ``beta [T+1, H]``, ``g
    [T+1, H]`` (a decay per head) or ``[T+1, H, K]`` (per key channel) (scaled, normalised, compute dtype; row T
    zero); ``initial_state [S, H, K, V]`` in the layout's segment order.

    Returns (``[M, H, V]`` outputs of the bucket's M tokens, their token indices, ``[S, H, K, V]`` final states)."""
    q, k, v = (gather_chunks(x, layout) for x in (query, key, value))
    beta = gather_chunks(beta, layout)  # [NC, H, C]
    cum_decay = gather_chunks(g, layout).cumsum(dim=2)  # [NC, H, C] or [NC, H, C, K]
    if cum_decay.dim() == 3:
        cum_decay = cum_decay[..., None]  # one decay shared by every key channel
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    ut_system, intra = _decayed_scores(cum_decay, k, k_beta, q)
    decayed_k_beta = k_beta * cum_decay.exp()
    new_values, k_cumdecay = _solve_unit_lower(ut_system, v_beta, decayed_k_beta)
    q = q * cum_decay.exp()
    k = k * (cum_decay[..., -1:, :] - cum_decay).exp()
    chunk_decay = cum_decay[..., -1, :].exp()[..., None]  # [NC, H, 1 or K, 1]: scales the state's key rows

    state, outputs, offset = initial_state, [], 0
    for count in layout.step_counts:  # step s: chunk s of the `count` longest segments
        block = slice(offset, offset + count)
        running = state[:count]
        v_new = new_values[block] - k_cumdecay[block] @ running
        outputs.append(q[block] @ running + intra[block] @ v_new)
        updated = running * chunk_decay[block] + k[block].transpose(-1, -2) @ v_new
        state = torch.cat([updated, state[count:]]) if count < state.shape[0] else updated
        offset += count
    out = torch.cat(outputs).transpose(1, 2)  # [NC, C, H, V]
    valid, index = scatter_index(layout, query.shape[0] - 1)
    return out.reshape(-1, *out.shape[2:])[valid], index, state


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _level_delta_rule_fla(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    layout: LevelLayout,
    use_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA: one varlen ``fla`` call per level with per-segment initial states (FLA's ``dh0`` carries their
    gradients back to the parents): ``chunk_gated_delta_rule`` for a decay per head (``g [T+1, Hv]``),
    ``chunk_kda`` for one per key channel (``g [T+1, Hv, K]``). Token rows in the model's dtype, unscaled and
    un-normalised (FLA does both; ``[T+1, Hk, K]`` queries/keys, ``[T+1, Hv, V]`` values: FLA applies grouped values
    itself).

    Returns (``[M, Hv, V]`` outputs of the bucket's M tokens, their token indices, ``[S, Hv, K, V]`` float32 final
    states)."""
    if g.dim() == 3:
        from fla.ops.kda import chunk_kda as chunk_delta_rule
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_delta_rule

    starts, lengths = layout.segment_start, layout.segment_length
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
    within = torch.arange(int(cu_seqlens[-1]), device=starts.device) - torch.repeat_interleave(cu_seqlens[:-1], lengths)
    index = torch.repeat_interleave(starts, lengths) + within
    out, final = chunk_delta_rule(
        query[index][None],
        key[index][None],
        value[index][None],
        g=g[index][None],
        beta=beta[index][None],
        initial_state=initial_state.contiguous(),  # roots' zero states are a stride-0 view; kernels want memory
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk,
    )
    return out[0], index, final


def tree_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    topology: TreeTopology,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``torch_chunk_gated_delta_rule`` (GatedDeltaNet) or ``chunk_kimi_delta_attention`` (Kimi delta attention)
    over a packed tree.

    Args:
        query, key: ``[B, N, Hk, K]``; value: ``[B, N, Hv, V]``; beta: ``[B, N, Hv]``; g (log decay, <= 0):
            ``[B, N, Hv]`` (one per head, GatedDeltaNet) or ``[B, N, Hv, K]`` (one per key channel, Kimi).
        topology: the batch's ``TreeTopology`` (``[B, N]``).
        kwargs: the model's other keyword arguments, ignored, except ``kv_prefix`` (depth-first execution): the
            rows' roots start from the ancestors' cached state, and the state after each row's last token is
            recorded (``scan_levels``).

    Returns:
        ``([B, N, Hv, V]`` in ``query.dtype``, None); a tree batch has no single final state to cache.
    """
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise ValueError(
            "the tree-aware gated delta rule got initial_state/output_final_state/cu_seqlens together with kv_end: "
            "packed trees carry their own sequence boundaries and cannot be cached; call the model with "
            "use_cache=False and without cu_seq_lens when passing kv_end."
        )
    input_dtype = query.dtype
    batch, length, num_k_heads, _ = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    if topology.shape != (batch, length):
        raise ValueError(
            f"kv_end has shape {list(topology.shape)}; the delta rule got [batch, seq] = {[batch, length]}."
        )
    # FLA kernels take half precision only; float32/float64 models (and CPU) use the torch path.
    use_fla = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _fla_available()
    if num_k_heads != num_v_heads and not use_fla:  # grouped values: each q/k head serves several value heads
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    compute = torch.promote_types(query.dtype, torch.float32)  # the state's dtype (float32, float64 for float64)

    def rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, N, ...] -> [B*N + 1, ...], zero row last
        x = x.reshape(batch * length, *x.shape[2:]).to(dtype)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    token_dtype = input_dtype if use_fla else compute
    query, key, value, beta = (rows(x, token_dtype) for x in (query, key, value, beta))
    g = rows(g, compute)
    if not use_fla:
        if use_qk_l2norm_in_kernel:
            query, key = _l2norm(query), _l2norm(key)
        query = query * query.shape[-1] ** -0.5
    zeros = torch.zeros(num_v_heads, key.shape[-1], v_dim, dtype=compute, device=query.device)
    if use_fla:
        level_fn = functools.partial(_level_delta_rule_fla, query, key, value, g, beta, use_qk=use_qk_l2norm_in_kernel)
    else:
        level_fn = functools.partial(_level_delta_rule, query, key, value, g, beta)
    out = scan_levels(topology, chunk_size, zeros, level_fn, kwargs.get("kv_prefix"))
    return out.reshape(batch, length, num_v_heads, v_dim).to(input_dtype), None
