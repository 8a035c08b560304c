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
per head, with their gradient computed here. Soft-capping, sliding windows, chunks and bidirectional blocks are
refused (``varlen_refusal``): the kernel has no soft-cap, and a window in depth positions would cut a sibling group's
ancestor part by each query's depth, which one ``window_size`` per call cannot express.

The kernel (``hf_tree.attention.varlen_kernels``) is PyTorch's own flash varlen kernel on CUDA (nothing to install)
and a loop of PyTorch's fused CPU kernel on CPU, where the engine runs for tests (the automatic CPU engine is
``segments``). The plan is built on the host once per batch (one host sync per forward) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_tree.attention.batch_cache import BatchCache
from hf_tree.attention.engine import EngineRefused, TreeAttentionOptions
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
class AncestorCall:
    """The ancestors call: one full sequence per group of sibling segments with the same ancestors."""

    call: VarlenCall
    queries: Tokens
    """The groups' query tokens, group after group (``[Tq]``)."""
    keys: Tokens
    """The groups' ancestor key tokens, group after group (``[Tk]``)."""


@dataclass(frozen=True)
class VarlenPlan:
    """The two varlen calls of a batch of packed rows."""

    self_call: VarlenCall
    """One causal sequence per segment, over all ``B * N`` tokens in order."""
    ancestors: AncestorCall | None
    """``None`` when no segment has ancestors (rows of distinct sequences)."""
    num_tokens: int
    """Tokens outside padding (one-token segments that see only themselves and are seen by no other)."""
    num_sequences: int
    """Sequences of both calls outside padding."""

    @property
    def tokens_per_sequence(self) -> float:
        """Non-padding tokens per kernel sequence: short sequences waste most of the kernel's query tiles."""
        return self.num_tokens / max(1, self.num_sequences)


def _ranges(bounds: list[tuple[int, int]]) -> Tokens:
    """Ascending ``[start, stop)`` ranges laid end to end -> a slice when they are one range, else the indices."""
    if all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])):
        return slice(bounds[0][0], bounds[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in bounds])


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


def plan_varlen(kv_end: torch.Tensor, device: torch.device | None = None) -> VarlenPlan:
    """The ``VarlenPlan`` of ``kv_end [B, N]`` (any integer dtype/device); index tensors on ``device`` (default:
    ``kv_end``'s)."""
    rows = kv_end.detach().to("cpu", torch.int64)
    device = kv_end.device if device is None else device
    batch, n = rows.shape
    segment_lengths, queries, keys, key_lengths = [], [], [], []
    num_tokens, num_sequences = 0, 0
    for b in range(batch):
        starts, stops, subtree_ends = row_segments(rows[b])
        segment_lengths += (stops - starts).tolist()
        alone = alone_segments(rows[b], starts, stops, subtree_ends)
        num_tokens += n - int(alone.sum())
        num_sequences += int((~alone).sum())
        offset = b * n
        for q0, q1, runs in ancestor_groups(starts.tolist(), stops.tolist(), subtree_ends.tolist()):
            queries.append((offset + q0, offset + q1))
            keys += [(offset + a, offset + z) for a, z in runs]
            key_lengths.append(sum(z - a for a, z in runs))
    ancestors = None
    if queries:
        num_sequences += len(queries)
        call = _call([q1 - q0 for q0, q1 in queries], key_lengths, device)
        query_index, key_index = _ranges(queries), _ranges(keys)
        ancestors = AncestorCall(
            call=call,
            queries=query_index if isinstance(query_index, slice) else query_index.to(device),
            keys=key_index if isinstance(key_index, slice) else key_index.to(device),
        )
    return VarlenPlan(_call(segment_lengths, segment_lengths, device), ancestors, num_tokens, num_sequences)


_plans: BatchCache[VarlenPlan] = BatchCache()


def cached_varlen_plan(kv_end: torch.Tensor) -> VarlenPlan:
    """``plan_varlen`` once per batch (all layers share it; ``hf_tree.attention.batch_cache``)."""
    return _plans.get((kv_end,), (), lambda: plan_varlen(kv_end))


def _take(x: torch.Tensor, tokens: Tokens) -> torch.Tensor:
    """The rows ``tokens`` of a token-major ``x [T, ...]`` (a view for a slice)."""
    return x[tokens] if isinstance(tokens, slice) else x.index_select(0, tokens)


def _add_at(total: torch.Tensor, tokens: Tokens, part: torch.Tensor) -> None:
    """``total[tokens] += part`` on a token-major ``total [T, ...]``; repeated indices add up (the ancestors of two
    sibling groups that are not consecutive, such as children before and after an earlier child's subtree)."""
    if isinstance(tokens, slice):
        total[tokens] += part
    else:
        total.index_add_(0, tokens, part)


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
    def forward(ctx, query, key, value, sinks, plan: VarlenPlan, scale: float, kernel: VarlenKernel):
        # query [T, H, D], key/value [T, Hkv, D]: the batch's tokens, row after row
        groups = query.shape[1] // key.shape[1]
        self_call = plan.self_call
        key_in, value_in = (_kv_heads(x, groups, kernel, self_call) for x in (key, value))
        out, lse, self_state = kernel.forward(query, key_in, value_in, self_call, True, scale)
        ancestor_state = None
        if plan.ancestors is not None:
            call, part = plan.ancestors, plan.ancestors.call
            key_in, value_in = (_kv_heads(_take(x, call.keys), groups, kernel, part) for x in (key, value))
            part_out, part_lse, ancestor_state = kernel.forward(
                _take(query, call.queries), key_in, value_in, part, False, scale
            )
            if isinstance(call.queries, slice):  # merged in place, on views
                target, target_lse = out[call.queries].transpose(0, 1), lse[:, call.queries]
                merge_softmax_part(target, target_lse, part_out.transpose(0, 1), part_lse)
            else:
                target, target_lse = out.index_select(0, call.queries), lse.index_select(1, call.queries)
                merge_softmax_part(target.transpose(0, 1), target_lse, part_out.transpose(0, 1), part_lse)
                out.index_copy_(0, call.queries, target)
                lse.index_copy_(1, call.queries, target_lse)
        if sinks is not None:
            merge_sinks(out.transpose(0, 1), lse, sinks)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.plan, ctx.scale, ctx.kernel, ctx.states = plan, scale, kernel, (self_state, ancestor_state)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks, out, lse = ctx.saved_tensors
        plan, scale, kernel = ctx.plan, ctx.scale, ctx.kernel
        groups = query.shape[1] // key.shape[1]
        grad_out = grad_out.contiguous()
        self_call = plan.self_call
        key_in, value_in = (_kv_heads(x, groups, kernel, self_call) for x in (key, value))
        grad_query, grad_key, grad_value = kernel.backward(
            grad_out, query, key_in, value_in, out, lse, self_call, True, scale, ctx.states[0]
        )
        grad_key, grad_value = (_kv_heads_grad(g, groups, kernel, self_call) for g in (grad_key, grad_value))
        if plan.ancestors is not None:
            call, part = plan.ancestors, plan.ancestors.call
            part_lse = lse[:, call.queries] if isinstance(call.queries, slice) else lse.index_select(1, call.queries)
            part_grads = kernel.backward(
                _take(grad_out, call.queries),
                _take(query, call.queries),
                *(_kv_heads(_take(x, call.keys), groups, kernel, part) for x in (key, value)),
                _take(out, call.queries),
                part_lse.contiguous(),
                part,
                False,
                scale,
                ctx.states[1],
            )
            _add_at(grad_query, call.queries, part_grads[0])
            _add_at(grad_key, call.keys, _kv_heads_grad(part_grads[1], groups, kernel, part))
            _add_at(grad_value, call.keys, _kv_heads_grad(part_grads[2], groups, kernel, part))
        grad_sinks = None
        if sinks is not None:
            grad_sinks = sink_gradient(grad_out.transpose(0, 1), out.transpose(0, 1), lse, sinks)
        return grad_query, grad_key, grad_value, grad_sinks, None, None, None


def varlen_refusal(query: torch.Tensor, options: TreeAttentionOptions) -> str | None:
    """Why the ``varlen`` engine cannot compute a call exactly (``query [B, H, N, D]`` as the kernel would receive
    it: under an autocast, in its dtype), or ``None`` when it can."""
    if options.softcap is not None:
        return f"softcap={options.softcap}: the flash varlen kernel has no soft-capping"
    if options.sliding_window is not None:
        return (
            f"sliding_window={options.sliding_window}: a window in depth positions cuts a sibling group's ancestor "
            "part by each query's depth, which one window_size per call cannot express"
        )
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
    """Tree attention from two varlen kernel calls merged by log-sum-exp (module docstring), a
    ``TreeAttentionEngine``: ``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]`` (never repeated on torch 2.13+),
    ``kv_end [B, N]`` -> ``[B, N, H, D]`` in ``query``'s dtype, honouring ``scaling`` and ``sinks``. Raises
    ``VarlenRefused`` (a ``ValueError``) with the reason for what the kernel cannot compute exactly
    (``varlen_refusal``); ``position_ids`` are not read. ``plan``: the calls to run (default: ``kv_end``'s)."""
    check_sinks("torch_varlen_tree_attention", options.sinks, query.shape[1])
    reason = varlen_refusal(query, options)
    if reason is not None:
        raise VarlenRefused(
            f"attention backend 'varlen' cannot run this call: {reason}. Use the automatic choice ('cuda' on CUDA, "
            "'cpu' elsewhere), which sends such calls to an engine that computes them."
        )
    if plan is None:
        plan = cached_varlen_plan(kv_end)
    batch, heads, n, dim = query.shape
    query, key, value = autocast_inputs(query, key, value)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, h, N, d] -> [B * N, h, d] (a view for transformers' layout)
        return x.transpose(1, 2).reshape(batch * n, x.shape[1], x.shape[3])

    with torch.autocast(query.device.type, enabled=False):
        out = _VarlenTreeAttention.apply(
            tokens(query), tokens(key), tokens(value), options.sinks, plan, options.scaling, varlen_kernel(query.device)
        )
    return out.view(batch, n, heads, dim)
