"""Tree attention as two calls of a fused varlen kernel, merged by log-sum-exp: the ``varlen`` engine.

The segments decomposition (``hf_tree.attention.segments``) tiles the tree mask with rectangles: every segment is
causal on itself, and every group of sibling segments with the same ancestors sees those ancestors in full. A varlen
kernel takes many sequences with separate query and key offsets (``cu_q``/``cu_k``), so all rectangles of a kind are
one call:

- *self*, causal: every segment of the batch is one sequence, queries and keys the segment's own tokens. Segments
  tile the rows in order, so the call reads the batch's query/key/value tokens in place (no copy); padding and
  one-token segments are sequences of one token.
- *ancestors*, full: every group of sibling segments with the same ancestors is one sequence, queries the group's
  tokens, keys the ancestors'. Queries and keys are views where they form one range of the batch (a GRPO group's
  completions and prompt), else gathered.

A query in both calls is merged exactly with the two log-sum-exps (``merge_softmax_part``), and the backward runs
the kernel's own backward on each call with the merged output and log-sum-exp (as ring attention does), so every
visible pair is computed once, forward and backward, by the kernel. Sinks join the merge as one more softmax column
per head, with their gradient computed here.

A sliding window (in depth positions) cuts a sibling group's ancestors by each query's depth, which one
``window_size`` per call cannot express; with a window the plan is one call instead (``plan_varlen_paths``): each
segment against its gathered root-to-segment path, causal and aligned bottom-right, where the gathered position is
the depth and the window is the kernel's own (the flash-attn engine's layout; a segment of ``Lq`` tokens gathers only
the last ``Lq + window - 1`` keys of its path). Soft-capping, chunks and bidirectional blocks are refused
(``varlen_refusal``): the kernel has none of them.

The kernel (``hf_tree.attention.varlen_kernels``) is PyTorch's own flash varlen kernel on CUDA (nothing to install)
and a loop of PyTorch's fused CPU kernel on CPU, where the engine runs for tests (the automatic CPU engine is
``segments``). The plan is built on the host once per batch (one host sync per forward) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_tree.attention.batch_cache import BatchCache
from hf_tree.attention.engine import EngineRefused, TreeAttentionOptions
from hf_tree.attention.flash import varlen_tree_index
from hf_tree.attention.mask import autocast_inputs, check_sinks, compute_dtype, has_bidirectional_blocks
from hf_tree.attention.segments import (
    alone_segments,
    ancestor_groups,
    merge_sinks,
    merge_softmax_part,
    row_segments,
    sink_gradient,
)
from hf_tree.attention.varlen_kernels import VarlenCall, VarlenKernel, cuda_kernel_refusal, varlen_kernel

Tokens = slice | torch.Tensor
"""Flat token indices ``row * N + j`` of a call's queries or keys: a slice when they form one range, else int64."""


class VarlenRefused(EngineRefused):
    """The ``varlen`` engine was asked for what its kernel cannot compute exactly (the message says what)."""


@dataclass(frozen=True)
class VarlenPart:
    """One kernel call of a plan."""

    call: VarlenCall
    queries: Tokens
    """The query tokens, sequence after sequence (``[Tq]``)."""
    keys: Tokens
    """The key tokens, sequence after sequence (``[Tk]``)."""
    causal: bool
    """Causal, aligned bottom-right (query ``t`` of ``Lq`` sees the first ``Lk - Lq + t + 1`` keys), with the call's
    sliding window if any; else full."""


@dataclass(frozen=True)
class VarlenPlan:
    """The kernel calls of a batch of packed rows."""

    parts: tuple[VarlenPart, ...]
    """The first reads every token of the batch as a query, in order (it writes each query's output and log-sum-exp);
    the others merge theirs into their queries'."""
    num_tokens: int
    """Tokens outside padding (one-token segments that see only themselves and are seen by no other)."""
    num_sequences: int
    """Sequences of all calls outside padding."""

    @property
    def tokens_per_sequence(self) -> float:
        """Non-padding tokens per kernel sequence: short sequences waste most of the kernel's query tiles."""
        return self.num_tokens / max(1, self.num_sequences)


def _ranges(bounds: list[tuple[int, int]]) -> Tokens:
    """Ascending ``[start, stop)`` ranges laid end to end -> a slice when they are one range, else the indices."""
    if all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])):
        return slice(bounds[0][0], bounds[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in bounds])


def _on(tokens: Tokens, device: torch.device) -> Tokens:
    """``tokens`` with an index tensor moved to ``device``."""
    return tokens if isinstance(tokens, slice) else tokens.to(device)


def _call(query_lengths: list[int], key_lengths: list[int], device: torch.device) -> VarlenCall:
    """The ``VarlenCall`` of sequences laid end to end with these query and key counts."""
    cu_q = torch.tensor([0, *query_lengths]).cumsum(0)
    cu_k = torch.tensor([0, *key_lengths]).cumsum(0)
    bounds = tuple(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True))
    return VarlenCall(
        cu_q=cu_q.to(device, torch.int32),
        cu_k=cu_k.to(device, torch.int32),
        max_q=max(query_lengths),
        max_k=max(key_lengths),
        bounds=bounds,
    )


def _row_segments(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``row_segments`` of ``row [N]`` (CPU int64), with its tokens and segments outside padding."""
    starts, stops, subtree_ends = row_segments(row)
    alone = alone_segments(row, starts, stops, subtree_ends)
    return starts, stops, subtree_ends, row.shape[0] - int(alone.sum()), int((~alone).sum())


def plan_varlen(kv_end: torch.Tensor, device: torch.device | None = None) -> VarlenPlan:
    """The two-call ``VarlenPlan`` of ``kv_end [B, N]`` (module docstring; any integer dtype/device): the segments,
    causal, then the sibling groups against their ancestors, in full. Index tensors on ``device`` (default:
    ``kv_end``'s)."""
    rows = kv_end.detach().to("cpu", torch.int64)
    device = kv_end.device if device is None else device
    batch, n = rows.shape
    segment_lengths, queries, keys, key_lengths = [], [], [], []
    num_tokens, num_sequences = 0, 0
    for b in range(batch):
        starts, stops, subtree_ends, row_tokens, row_segment_count = _row_segments(rows[b])
        segment_lengths += (stops - starts).tolist()
        num_tokens += row_tokens
        num_sequences += row_segment_count
        offset = b * n
        for q0, q1, runs in ancestor_groups(starts.tolist(), stops.tolist(), subtree_ends.tolist()):
            queries.append((offset + q0, offset + q1))
            keys += [(offset + a, offset + z) for a, z in runs]
            key_lengths.append(sum(z - a for a, z in runs))
    every_token = slice(0, batch * n)
    parts = [VarlenPart(_call(segment_lengths, segment_lengths, device), every_token, every_token, causal=True)]
    if queries:
        num_sequences += len(queries)
        call = _call([q1 - q0 for q0, q1 in queries], key_lengths, device)
        parts.append(VarlenPart(call, _on(_ranges(queries), device), _on(_ranges(keys), device), causal=False))
    return VarlenPlan(tuple(parts), num_tokens, num_sequences)


def plan_varlen_paths(kv_end: torch.Tensor, window: int | None, device: torch.device | None = None) -> VarlenPlan:
    """The one-call ``VarlenPlan`` of ``kv_end [B, N]`` for a sliding window of ``window`` depth positions: each
    segment against its gathered root-to-segment path, causal (``hf_tree.attention.flash.varlen_tree_index``, the
    flash-attn engine's layout). Along a path the gathered position grows by one per depth, so the window is the
    kernel's own; only the last ``Lq + window - 1`` keys of a segment of ``Lq`` tokens are gathered (the earliest its
    first token sees). ``window=None``: whole paths (``benchmarks/varlen_threshold.py`` times this plan against the
    two calls of ``plan_varlen``, which the engine runs without a window)."""
    device = kv_end.device if device is None else device
    index = varlen_tree_index(kv_end, device=torch.device("cpu"))
    query_lengths, key_lengths = index.cu_seqlens_q.diff().long(), index.cu_seqlens_k.diff().long()
    kept = key_lengths if window is None else torch.minimum(key_lengths, query_lengths + window - 1)
    # sequence i keeps path positions [cu_k[i + 1] - kept_i, cu_k[i + 1]), laid end to end
    first, offsets = index.cu_seqlens_k[1:].long() - kept, kept.cumsum(0) - kept
    key_index = index.key_index[torch.repeat_interleave(first - offsets, kept) + torch.arange(int(kept.sum()))]
    total = kv_end.numel()
    keys = slice(0, total) if torch.equal(key_index, torch.arange(total)) else key_index.to(device)
    call = _call(query_lengths.tolist(), kept.tolist(), device)
    counts = [_row_segments(row)[3:] for row in kv_end.detach().to("cpu", torch.int64)]
    num_tokens, num_sequences = (sum(c) for c in zip(*counts, strict=True))
    return VarlenPlan((VarlenPart(call, slice(0, total), keys, causal=True),), num_tokens, num_sequences)


_plans: BatchCache[VarlenPlan] = BatchCache()


def cached_varlen_plan(kv_end: torch.Tensor, window: int | None = None) -> VarlenPlan:
    """``plan_varlen`` (with a sliding ``window``: ``plan_varlen_paths``) once per batch (all layers share it;
    ``hf_tree.attention.batch_cache``)."""
    if window is None:
        return _plans.get((kv_end,), (None,), lambda: plan_varlen(kv_end))
    return _plans.get((kv_end,), (window,), lambda: plan_varlen_paths(kv_end, window))


def _take(x: torch.Tensor, tokens: Tokens) -> torch.Tensor:
    """The rows ``tokens`` of a token-major ``x [T, ...]`` (a view for a slice)."""
    return x[tokens] if isinstance(tokens, slice) else x.index_select(0, tokens)


def _add_at(total: torch.Tensor | None, tokens: Tokens, part: torch.Tensor, size: int) -> torch.Tensor:
    """``total[tokens] += part`` on a token-major ``total [size, ...]`` (``None``: zeros, or ``part`` itself when it
    covers every token); repeated indices add up (a key on the paths, or among the ancestors, of several
    sequences)."""
    if total is None:
        if tokens == slice(0, size):
            return part
        total = part.new_zeros(size, *part.shape[1:])
    if isinstance(tokens, slice):
        total[tokens] += part
    else:
        total.index_add_(0, tokens, part)
    return total


def _kv_heads(x: torch.Tensor, groups: int, kernel: VarlenKernel, call: VarlenCall) -> torch.Tensor:
    """K/V ``[T, Hkv, D]`` for ``call``: as they are, or each head repeated ``groups`` times where the kernel takes
    no grouped K/V for it."""
    return x if groups == 1 or kernel.takes_grouped_kv(call) else x.repeat_interleave(groups, dim=1)


def _kv_heads_grad(grad: torch.Tensor, groups: int, kernel: VarlenKernel, call: VarlenCall) -> torch.Tensor:
    """The gradient of ``_kv_heads``' result -> ``[T, Hkv, D]`` (each group's heads summed in float32 for half types,
    as a kernel with grouped K/V accumulates them)."""
    if groups == 1 or kernel.takes_grouped_kv(call):
        return grad
    return grad.unflatten(1, (-1, groups)).sum(2, dtype=compute_dtype(grad.dtype)).to(grad.dtype)


class _VarlenTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, plan: VarlenPlan, scale: float, window: int | None, kernel):
        # query [T, H, D], key/value [T, Hkv, D]: the batch's tokens, row after row
        groups = query.shape[1] // key.shape[1]
        out = lse = None
        states = []
        for part in plan.parts:
            key_in, value_in = (_kv_heads(_take(x, part.keys), groups, kernel, part.call) for x in (key, value))
            part_window = window if part.causal else None
            part_out, part_lse, state = kernel.forward(
                _take(query, part.queries), key_in, value_in, part.call, part.causal, scale, part_window
            )
            states.append(state)
            if out is None:  # the first part: every query, in order
                out, lse = part_out, part_lse
            elif isinstance(part.queries, slice):  # merged in place, on views
                target, target_lse = out[part.queries].transpose(0, 1), lse[:, part.queries]
                merge_softmax_part(target, target_lse, part_out.transpose(0, 1), part_lse)
            else:
                target, target_lse = out.index_select(0, part.queries), lse.index_select(1, part.queries)
                merge_softmax_part(target.transpose(0, 1), target_lse, part_out.transpose(0, 1), part_lse)
                out.index_copy_(0, part.queries, target)
                lse.index_copy_(1, part.queries, target_lse)
        if sinks is not None:
            merge_sinks(out.transpose(0, 1), lse, sinks)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.plan, ctx.scale, ctx.window, ctx.kernel, ctx.states = plan, scale, window, kernel, states
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks, out, lse = ctx.saved_tensors
        kernel, tokens = ctx.kernel, query.shape[0]
        groups = query.shape[1] // key.shape[1]
        grad_out = grad_out.contiguous()
        grad_query = grad_key = grad_value = None
        for part, state in zip(ctx.plan.parts, ctx.states, strict=True):
            part_lse = lse[:, part.queries] if isinstance(part.queries, slice) else lse.index_select(1, part.queries)
            part_grads = kernel.backward(
                _take(grad_out, part.queries),
                _take(query, part.queries),
                *(_kv_heads(_take(x, part.keys), groups, kernel, part.call) for x in (key, value)),
                _take(out, part.queries),
                part_lse.contiguous(),
                part.call,
                part.causal,
                ctx.scale,
                ctx.window if part.causal else None,
                state,
            )
            grad_query = _add_at(grad_query, part.queries, part_grads[0], tokens)
            grad_key = _add_at(grad_key, part.keys, _kv_heads_grad(part_grads[1], groups, kernel, part.call), tokens)
            grad_value = _add_at(
                grad_value, part.keys, _kv_heads_grad(part_grads[2], groups, kernel, part.call), tokens
            )
        grad_sinks = None
        if sinks is not None:
            grad_sinks = sink_gradient(grad_out.transpose(0, 1), out.transpose(0, 1), lse, sinks)
        return grad_query, grad_key, grad_value, grad_sinks, None, None, None, None


def varlen_refusal(query: torch.Tensor, options: TreeAttentionOptions) -> str | None:
    """Why the ``varlen`` engine cannot compute a call exactly (``query [B, H, N, D]`` as the kernel would receive
    it: under an autocast, in its dtype), or ``None`` when it can."""
    if options.softcap is not None:
        return f"softcap={options.softcap}: PyTorch's flash varlen kernel has no soft-capping"
    if options.attention_chunk is not None:
        return f"attention_chunk={options.attention_chunk}: the kernel has no chunked attention"
    if has_bidirectional_blocks(options.bidirectional_block):
        return "bidirectional blocks: causal and full rectangles cannot let a block's tokens see its later tokens"
    if query.device.type == "cuda":
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
        return cuda_kernel_refusal(dtype, query.shape[3], query.device)
    if query.device.type != "cpu":
        return f"device {query.device.type!r}: the varlen kernels run on CUDA (and on CPU for tests)"
    return None


@torch.compiler.disable  # data-dependent plans: run eagerly inside a compiled model
def torch_varlen_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
    *,
    plan: VarlenPlan | None = None,
) -> torch.Tensor:
    """Tree attention from varlen kernel calls merged by log-sum-exp (module docstring), a ``TreeAttentionEngine``:
    ``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]`` (not repeated in memory where the kernel takes grouped K/V),
    ``kv_end [B, N]`` -> ``[B, N, H, D]`` in ``query``'s dtype, honouring ``scaling``, ``sinks`` and
    ``sliding_window`` (measured along the gathered paths, which are the depths: ``position_ids`` are not read).
    Raises ``VarlenRefused`` (a ``ValueError``) with the reason for what the kernel cannot compute exactly
    (``varlen_refusal``). ``plan``: the calls to run (default: ``kv_end``'s, ``cached_varlen_plan``)."""
    check_sinks("torch_varlen_tree_attention", options.sinks, query.shape[1])
    reason = varlen_refusal(query, options)
    if reason is not None:
        raise VarlenRefused(
            f"attention backend 'varlen' cannot run this call: {reason}. Use the automatic choice ('cuda' on CUDA, "
            "'cpu' elsewhere), which sends such calls to an engine that computes them."
        )
    window = options.sliding_window
    if plan is None:
        plan = cached_varlen_plan(kv_end, window)
    batch, heads, n, dim = query.shape
    query, key, value = autocast_inputs(query, key, value)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, h, N, d] -> [B * N, h, d] (a view for transformers' layout)
        return x.transpose(1, 2).reshape(batch * n, x.shape[1], x.shape[3])

    with torch.autocast(query.device.type, enabled=False):
        out = _VarlenTreeAttention.apply(
            tokens(query),
            tokens(key),
            tokens(value),
            options.sinks,
            plan,
            options.scaling,
            None if window is None else window - 1,  # keys within window - 1 positions before the query
            varlen_kernel(query.device),
        )
    return out.view(batch, n, heads, dim)
