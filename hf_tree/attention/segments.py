"""Tree attention as a few fused attention calls: one per segment and one per group of sibling segments.

A packed tree row splits into *segments*: maximal runs ``[s, e)`` of tokens with the same subtree end
``kv_end = E`` (each token's only child is the next one). The tree mask is then a disjoint union of
rectangles with contiguous rows (docs/attention.md):

- ``[s, e) x [s, e)`` causal: a segment sees itself causally;
- ``[s, e) x ancestors`` full: a segment sees every ancestor key (``j < s`` with ``kv_end[j] > s``); consecutive
  sibling segments with the same ancestors (a GRPO group's completions) share one call.

Each rectangle is one call of PyTorch's fused CPU flash-attention kernel (the one causal SDPA runs on), which
returns its log-sum-exp; the parts of a query are merged exactly with their log-sum-exps, and the backward
runs the kernel's own backward on each part with the merged output and log-sum-exp (as ring attention does).
Every visible query-key pair is computed once, no pair outside the mask is. Ancestors that form one range are
views; others are gathered token-major. Segments of one token (padding, one-token leaves) see only themselves
among their own tokens: they run together as one call with the tokens as the batch.

This pays one kernel call per rectangle, so it suits rows of few long segments (GRPO groups, long turns);
``cpu_tree_attention`` sends batches of many short segments, softcapping and sliding windows to the blocked
engine instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from hf_tree.attention.batch_cache import BatchCache
from hf_tree.attention.blocked import blocked_tree_attention
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import (
    autocast_inputs,
    check_sinks,
    compute_dtype,
    has_bidirectional_blocks,
    visible_keys_per_query,
)

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# Rows whose multi-token segments (and groups of siblings with the same ancestors) average fewer tokens than
# this go to the blocked engine: below it, per-call overheads outweigh the fused kernel's speed
# (benchmarks/attention.py's random-tree rows; docs/attention.md).
MIN_TOKENS_PER_CALL = 48


@dataclass(frozen=True)
class _Part:
    """Queries ``[q0, q1)`` of row ``row`` against ``keys``: causal over themselves, or all of the keys."""

    row: int
    q0: int
    q1: int
    keys: slice | torch.Tensor
    """Key indices in the row: a slice, or a LongTensor when the keys are not one contiguous range."""
    causal: bool


@dataclass
class SegmentPlan:
    """The rectangles of a batch of rows."""

    parts: list[_Part]
    """Causal parts (one per multi-token segment) first, then full parts (one per group of sibling segments
    with the same ancestors, against those ancestors)."""
    singletons: torch.Tensor
    """``[S]`` int64 flat indices ``row * N + j`` of one-token segments (each sees itself among its own)."""
    num_tokens: int
    """Tokens of the batch outside padding (tokens that see only themselves and are seen by no other)."""

    @property
    def tokens_per_call(self) -> float:
        """Non-padding tokens per kernel call (the calls on singletons count as one)."""
        return self.num_tokens / max(1, len(self.parts) + bool(self.singletons.numel()))


_plans: BatchCache[SegmentPlan] = BatchCache()


KeyRuns = tuple[tuple[int, int], ...]
"""Ascending disjoint ``[start, stop)`` ranges of key indices in a row."""


def _key_index(runs: KeyRuns, device: torch.device) -> slice | torch.Tensor:
    """Ascending disjoint ``[start, stop)`` runs -> a slice for one run, else the indices."""
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(a, b) for a, b in runs]).to(device)


def row_segments(kv_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The segments of one row ``kv_end [N]`` (CPU int64): their ``starts``, ``stops`` and subtree ends, each
    ``[S]`` int64, in packed order."""
    n = kv_end.shape[0]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(kv_end[1:] != kv_end[:-1]).flatten() + 1])
    stops = torch.cat([starts[1:], torch.tensor([n])])
    return starts, stops, kv_end[starts]


def segment_ancestors(
    starts: list[int], stops: list[int], subtree_ends: list[int]
) -> Iterator[tuple[int, int, KeyRuns]]:
    """Each segment ``[s, e)`` with the key runs of its ancestors (the keys ``j < s`` with ``kv_end[j] > s``), in
    packed order. Segments without ancestors or descendants (padding) may be left out of the input."""
    open_segments: list[tuple[int, KeyRuns]] = []  # (subtree end, key runs of its descendants), innermost last
    for s, e, end in zip(starts, stops, subtree_ends, strict=True):
        while open_segments and open_segments[-1][0] <= s:
            open_segments.pop()
        runs = open_segments[-1][1] if open_segments else ()
        yield s, e, runs
        if end > e:  # its descendants see its ancestors and itself
            joined = (*runs[:-1], (runs[-1][0], e)) if runs and runs[-1][1] == s else (*runs, (s, e))
            open_segments.append((end, joined))


def alone_segments(
    kv_end: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor, subtree_ends: torch.Tensor
) -> torch.Tensor:
    """``[S]`` bool: which segments of ``kv_end [N]`` (CPU; ``row_segments``) are one token that sees only itself and
    is seen by no other (padding, one-token trees)."""
    has_ancestors = visible_keys_per_query(kv_end)[starts] > 1
    return (stops - starts == 1) & ~has_ancestors & (subtree_ends == stops)


def ancestor_groups(starts: list[int], stops: list[int], subtree_ends: list[int]) -> Iterator[tuple[int, int, KeyRuns]]:
    """The queries ``[q0, q1)`` that see the same ancestors, with those ancestors' key runs, in packed order: runs of
    consecutive sibling segments with the same ancestors (a GRPO group's completions), one rectangle each. Segments
    without ancestors are left out."""
    group: list | None = None  # [q0, q1, runs] of the group being grown
    for s, e, runs in segment_ancestors(starts, stops, subtree_ends):
        if not runs:
            continue
        if group is not None and group[1] == s and group[2] == runs:
            group[1] = e
            continue
        if group is not None:
            yield tuple(group)
        group = [s, e, runs]
    if group is not None:
        yield tuple(group)


def _plan_row(kv_end: torch.Tensor, row: int, device: torch.device) -> tuple[list[_Part], list[_Part], list[int], int]:
    """Causal parts, full parts, one-token segment starts and non-padding tokens of ``kv_end [N]`` (CPU)."""
    starts, stops, subtree_ends = row_segments(kv_end)
    # Padding (and one-token trees): one token that sees only itself and has no descendant; no loop over them.
    alone = alone_segments(kv_end, starts, stops, subtree_ends)
    singles = starts[stops - starts == 1].tolist()
    segments = [x[~alone].tolist() for x in (starts, stops, subtree_ends)]
    causal = [_Part(row, s, e, slice(s, e), True) for s, e in zip(segments[0], segments[1], strict=True) if e - s > 1]
    full = [_Part(row, q0, q1, _key_index(runs, device), False) for q0, q1, runs in ancestor_groups(*segments)]
    return causal, full, singles, kv_end.shape[0] - int(alone.sum())


def plan_segments(kv_end: torch.Tensor, device: torch.device | None = None) -> SegmentPlan:
    """The rectangles of ``kv_end [B, N]`` (any integer dtype/device); index tensors on ``device``."""
    rows = kv_end.detach().to("cpu", torch.int64)
    device = kv_end.device if device is None else device
    causal, full, singles, tokens = [], [], [], 0
    for b in range(rows.shape[0]):
        row_causal, row_full, row_singles, row_tokens = _plan_row(rows[b], b, device)
        causal += row_causal
        full += row_full
        singles += [b * rows.shape[1] + j for j in row_singles]
        tokens += row_tokens
    return SegmentPlan(causal + full, torch.tensor(singles, dtype=torch.int64, device=device), tokens)


def plan_from_query(plan: SegmentPlan, first_query: int, row_length: int) -> SegmentPlan:
    """``plan`` restricted to the queries ``>= first_query`` of each row (``row_length`` tokens), keys unchanged.

    Parts of earlier queries are dropped; a segment that starts before ``first_query`` keeps its later queries, causal
    over their own keys and in full over its keys before ``first_query``. Depth-first execution runs a unit's queries
    over the row ``[prefix | unit]`` this way (``hf_tree.attention.prefix``): the prefix is never a query.
    """
    causal, full = [], []
    for part in plan.parts:
        if part.q1 <= first_query:
            continue
        if part.q0 >= first_query:
            (causal if part.causal else full).append(part)
            continue
        if part.causal:
            causal.append(_Part(part.row, first_query, part.q1, slice(first_query, part.q1), True))
            full.append(_Part(part.row, first_query, part.q1, slice(part.q0, first_query), False))
        else:
            full.append(_Part(part.row, first_query, part.q1, part.keys, False))
    singletons = plan.singletons[plan.singletons % row_length >= first_query]
    return SegmentPlan(causal + full, singletons, plan.num_tokens)


def cached_segment_plan(kv_end: torch.Tensor) -> SegmentPlan:
    """``plan_segments`` once per batch (all layers share it; ``hf_tree.attention.batch_cache``)."""
    return _plans.get((kv_end,), (), lambda: plan_segments(kv_end))


def _tokens_as_batch(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``x [B, H, N, (D)]`` -> ``[S, H, 1, (D)]``: the tokens ``flat`` (``row * N + j``) as one-token rows."""
    tokens = x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], *x.shape[1:2], *x.shape[3:])
    return tokens.index_select(0, flat).unsqueeze(2)


def _select(x: torch.Tensor, part: _Part) -> torch.Tensor:
    """The keys (or values) of a part: ``x [B, Hkv, N, D]`` -> ``[1, Hkv, n_keys, D]`` (a view for a slice; gathered
    token-major, the layout of transformers' projections, otherwise)."""
    if isinstance(part.keys, slice):
        return x[part.row, :, part.keys].unsqueeze(0)
    return x[part.row].transpose(0, 1).index_select(0, part.keys).transpose(0, 1).unsqueeze(0)


def _token_buffer(
    batch: int, heads: int, n: int, *tail: int, dtype: torch.dtype, device: torch.device, zeroed: bool = True
) -> torch.Tensor:
    """A token-major ``[B, N, H, *tail]`` buffer (one-token parts index it by ``row * N + j``)."""
    return (torch.zeros if zeroed else torch.empty)(batch, n, heads, *tail, dtype=dtype, device=device)


def merge_softmax_part(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """``out [..., L, D]``, ``lse [..., L]`` (in place) := the softmax over their keys and a part's other keys.

    ``lse`` is in the softmax statistics' dtype (float32 for half outputs, as the kernel returns it); a half
    ``out`` is merged in that dtype and rounded once, as the kernel rounds its own output."""
    merged = torch.logaddexp(lse, part_lse)
    keep, take = (lse - merged).exp_().unsqueeze(-1), (part_lse - merged).exp_().unsqueeze(-1)
    if out.dtype == lse.dtype:
        out.mul_(keep).add_(part_out * take)
    else:
        out.copy_(out * keep + part_out * take)
    lse.copy_(merged)


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """``out [..., H, L, D]``, ``lse [..., H, L]`` (in place) := with one more softmax column per head, the sink logit
    ``sinks [H]``, whose value is zero."""
    merge_softmax_part(out, lse, torch.zeros_like(out), sinks.detach().to(lse.dtype).view(-1, 1).expand_as(lse))


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits ``sinks [H]``: ``-sum over queries of P_sink * rowsum(dO * O)``, from
    ``grad_out``/``out [..., H, L, D]`` and the merged ``lse [..., H, L]`` (sink included)."""
    # A sum over every query of the batch: accumulated in float64 (cheap, [..., H, L]).
    row_dot = (grad_out.double() * out.double()).sum(-1)
    sink_probs = (sinks.double().view(-1, 1) - lse.double()).exp()
    heads, length = lse.shape[-2:]
    return -(sink_probs * row_dot).reshape(-1, heads, length).sum((0, 2)).to(sinks.dtype)


class _SegmentTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, plan: SegmentPlan, scaling: float):
        batch, heads, n, dim = query.shape
        # The output in the model's dtype, as SDPA returns it; only the softmax statistics (log-sum-exps) are
        # float32 for half inputs, as the kernel keeps them. Every query's first part (a causal part or the
        # one-token call) writes, later ones merge.
        stats_dtype = compute_dtype(query.dtype)
        out_tokens = _token_buffer(batch, heads, n, dim, dtype=query.dtype, device=query.device, zeroed=False)
        lse_tokens = _token_buffer(batch, heads, n, dtype=stats_dtype, device=query.device, zeroed=False)
        out, lse = out_tokens.transpose(1, 2), lse_tokens.transpose(1, 2)  # [B, H, N, D], [B, H, N] views
        if plan.singletons.numel():  # each query's first part: written, not merged
            flat = plan.singletons
            part_out, part_lse = _flash_forward(
                _tokens_as_batch(query, flat), _tokens_as_batch(key, flat), _tokens_as_batch(value, flat), scale=scaling
            )
            out_tokens.view(batch * n, heads, dim).index_copy_(0, flat, part_out.squeeze(2))
            lse_tokens.view(batch * n, heads).index_copy_(0, flat, part_lse.squeeze(2).to(stats_dtype))
        for part in plan.parts:
            rows = slice(part.q0, part.q1)
            part_out, part_lse = _flash_forward(
                query[part.row, :, rows].unsqueeze(0),
                _select(key, part),
                _select(value, part),
                is_causal=part.causal,
                scale=scaling,
            )
            target, target_lse = out[part.row, :, rows], lse[part.row, :, rows]
            if part.causal:  # its queries' first part (plan order)
                target.copy_(part_out[0])
                target_lse.copy_(part_lse[0])
            else:
                merge_softmax_part(target, target_lse, part_out[0], part_lse[0])
        if sinks is not None:  # one more softmax column per head, with a zero value
            merge_sinks(out, lse, sinks)
        ctx.save_for_backward(query, key, value, sinks, out_tokens, lse_tokens)
        ctx.plan, ctx.scaling = plan, scaling
        return out_tokens

    @staticmethod
    def backward(ctx, grad_result):
        query, key, value, sinks, result, lse_tokens = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        batch, heads, n, dim = query.shape
        # Token-major accumulators of the query, key and value gradients, in the model's dtype as SDPA's backward
        # writes them: a token's parts (at most two for a query, its own and its descendants' for a key) add up
        # there, as per-branch training adds each branch's gradients up in the weights' dtype.
        grad_tokens = [
            _token_buffer(batch, x.shape[1], n, dim, dtype=x.dtype, device=x.device) for x in (query, key, value)
        ]
        grads = [g.transpose(1, 2) for g in grad_tokens]
        grad_out, out, lse = grad_result.transpose(1, 2), result.transpose(1, 2), lse_tokens.transpose(1, 2)
        for part in plan.parts:
            rows, b = slice(part.q0, part.q1), part.row
            part_grads = _flash_backward(
                grad_out[b, :, rows].unsqueeze(0),
                query[b, :, rows].unsqueeze(0),
                _select(key, part),
                _select(value, part),
                out[b, :, rows].unsqueeze(0),
                lse[b, :, rows].unsqueeze(0).contiguous(),
                0.0,
                part.causal,
                scale=scaling,
            )
            grads[0][b, :, rows] += part_grads[0][0]
            for total, part_grad in zip(grad_tokens[1:], part_grads[1:], strict=True):
                if isinstance(part.keys, slice):
                    total[b, part.keys] += part_grad[0].transpose(0, 1)
                else:  # token-major: whole [Hkv, D] rows per index
                    total[b].index_add_(0, part.keys, part_grad[0].transpose(0, 1))
        if plan.singletons.numel():
            flat = plan.singletons
            part_grads = _flash_backward(
                *(_tokens_as_batch(x, flat) for x in (grad_out, query, key, value, out)),
                _tokens_as_batch(lse, flat).contiguous(),
                0.0,
                False,
                scale=scaling,
            )
            for total, part_grad in zip(grad_tokens, part_grads, strict=True):
                total.view(batch * n, *total.shape[2:]).index_add_(0, flat, part_grad.squeeze(2))
        grad_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
        return (*grads, grad_sinks, None, None)


@torch.compiler.disable  # data-dependent plans: run eagerly inside a compiled model
def segment_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
    *,
    plan: SegmentPlan | None = None,
) -> torch.Tensor:
    """Tree attention from fused flash-attention calls on contiguous rectangles (CPU), a ``TreeAttentionEngine``
    (``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]`` never repeated, ``kv_end [B, N]`` -> ``[B, N, H, D]`` in
    ``query``'s dtype) honouring ``scaling`` and ``sinks`` only: softcapping, sliding windows, attention chunks and a
    bidirectional overlay are refused (``cpu_tree_attention`` sends those to the blocked engine). ``plan``: the
    rectangles to run (default: all of ``kv_end``'s)."""
    check_sinks("segment_tree_attention", options.sinks, query.shape[1])
    blocks = has_bidirectional_blocks(options.bidirectional_block)
    local = options.sliding_window is not None or options.attention_chunk is not None
    if local or options.softcap is not None or blocks:
        raise ValueError(
            f"segment_tree_attention got sliding_window={options.sliding_window}, softcap={options.softcap}, "
            f"bidirectional_block={'set' if blocks else None}, attention_chunk={options.attention_chunk}: its causal "
            "rectangles have none of them; use blocked_tree_attention for such layers."
        )
    # position_ids are not read: depths matter only for sliding windows and chunks
    if plan is None:
        plan = cached_segment_plan(kv_end)
    query, key, value = autocast_inputs(query, key, value)
    with torch.autocast(query.device.type, enabled=False):
        return _SegmentTreeAttention.apply(query, key, value, options.sinks, plan, options.scaling)


def cpu_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """The automatic engine off CUDA: ``segment_tree_attention`` on CPU batches whose segments are long enough
    (``MIN_TOKENS_PER_CALL`` tokens per kernel call), else ``blocked_tree_attention`` (short segments,
    softcapping, sliding windows, attention chunks, bidirectional blocks, other devices). A ``TreeAttentionEngine``
    honouring every option."""
    if not has_bidirectional_blocks(options.bidirectional_block):
        options = replace(options, bidirectional_block=None)
    local = options.sliding_window is not None or options.attention_chunk is not None
    if query.device.type == "cpu" and not local and options.softcap is None and options.bidirectional_block is None:
        plan = cached_segment_plan(kv_end)
        if plan.tokens_per_call >= MIN_TOKENS_PER_CALL:
            return segment_tree_attention(query, key, value, kv_end, options, plan=plan)
    return blocked_tree_attention(query, key, value, kv_end, options)
