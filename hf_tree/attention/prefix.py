"""Attention over a cached ancestor prefix: the attention half of depth-first execution (``hf_tree.depth_first``).

A depth-first unit (one node piece, or a packed mini-tree of sibling subtrees) is forwarded alone. Its queries see
the keys/values of its ancestors, computed by earlier units and handed in through the model keyword ``kv_prefix``
(a ``PrefixCache``; like ``kv_end`` it reaches the attention function through transformers' ``**kwargs``), then its own
keys under its own ``kv_end``. The attention function also records the unit's own post-RoPE keys/values into the
same object, per ``layer_idx``, for the unit's descendants.

The mask is the tree mask of the concatenated row ``[prefix | unit]``: prefix keys end after the unit (every query
sees them), the unit's keys keep their ``kv_end`` shifted by the prefix length, and key positions are depths, so
sliding windows (depth distance), sinks and soft-capping are those of the packed row, computed by the row's own tree
engine (or, for a long prefix over a short unit, by the dense mask of ``hf_tree.attention.mask``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import torch
import torch.nn.functional as F

from hf_tree.attention.engine import TreeAttentionEngine, TreeAttentionOptions
from hf_tree.attention.mask import check_window_depths, tree_mask_mod
from hf_tree.attention.reference import masked_attention
from hf_tree.attention.segments import (
    MIN_TOKENS_PER_CALL,
    cached_segment_plan,
    cpu_tree_attention,
    plan_from_query,
    segment_tree_attention,
)


class PrefixCache:
    """The ancestors' cache one depth-first unit reads, and the unit's own entries (a side output for its descendants).

    Entries are keyed by what records them: ``("key", layer_idx)`` and ``("value", layer_idx)`` for an attention layer's
    post-RoPE keys/values ``[B, Hkv, n, D]`` (as its attention function receives them), ``("conv", id)`` for a causal
    convolution's inputs ``[B, C, n]`` (``hf_tree.models.mixers.conv``); tokens are on dim 2 in these entries.
    ``("state", id)`` is a recurrence's state after the last token ``[B, *state]`` (gated delta rule, Mamba2 scan:
    ``hf_tree.models.mixers.topology.scan_levels``), keyed by the convolution its mixer runs first: a unit continues
    the state of its nearest cached ancestor piece, the last one on its path (``join``).

    A plain class, not a dataclass, on purpose: wrappers that rebuild the dataclasses, dicts and lists of a module's
    inputs (FSDP2 wraps every grad-requiring input tensor and rebuilds its container with ``dataclasses.replace``;
    ``to(device)`` helpers copy containers) would hand each layer a copy whose ``own`` the executor never sees, and
    the descendants would silently lose the cache. An opaque object reaches every layer as the same instance.

    Attributes:
        cached: the ancestors' entries (``n = P`` tokens, the prefix); empty for a unit without ancestors.
        row_kv_end: ``[B, P + N]`` int32 subtree ends of the row ``[prefix | unit]``: ``P + N`` for the prefix tokens,
            the unit's own ``kv_end`` shifted by ``P`` after them. One tensor for all layers (engines and mixers cache
            their per-batch plans on it).
        row_position_ids: ``[B, P + N]`` depths of that row (sliding windows measure depth distance).
        own: filled during the unit's forward: its own entries (``n = N`` tokens, with their autograd graph).
        mixer: the id of the convolution recorded last (set by the convolution, taken by the recurrence that
            follows it in the same mixer: ``recurrent_state_key``).
    """

    __slots__ = ("cached", "mixer", "own", "row_kv_end", "row_position_ids")

    def __init__(
        self,
        cached: dict[Hashable, torch.Tensor],
        row_kv_end: torch.Tensor,
        row_position_ids: torch.Tensor,
        own: dict[Hashable, torch.Tensor] | None = None,
        mixer: Hashable | None = None,
    ) -> None:
        self.cached = cached
        self.row_kv_end = row_kv_end
        self.row_position_ids = row_position_ids
        self.own = {} if own is None else own
        self.mixer = mixer

    @classmethod
    def over(
        cls,
        cached: dict[Hashable, torch.Tensor],
        prefix_positions: torch.Tensor,
        kv_end: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> PrefixCache:
        """The cache ``cached`` at depths ``prefix_positions [B, P]`` for a unit with local subtree ends
        ``kv_end [B, N]`` and depths ``position_ids [B, N]``."""
        num_prefix, total = prefix_positions.shape[1], prefix_positions.shape[1] + kv_end.shape[1]
        row_kv_end = torch.cat([kv_end.new_full((kv_end.shape[0], num_prefix), total), kv_end + num_prefix], dim=1)
        return cls(cached, row_kv_end, torch.cat([prefix_positions.to(position_ids), position_ids], dim=1))

    def record(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor | None:
        """Keep the unit's ``tensor`` under ``key`` for its descendants; the ancestors' entry of ``key``, if any.

        A checkpointed layer records again when it is recomputed in backward; the unit has read its entry by then.
        """
        self.own[key] = tensor
        return self.cached.get(key)

    def recurrent_state_key(self) -> Hashable:
        """The key of a recurrence's state entry: ``("state", id)`` of the convolution its mixer ran just before (every
        GatedDeltaNet and Mamba2 mixer convolves its inputs first; the ops get no module). Taken once, so a
        recurrence without its own convolution is refused instead of reading another layer's state.

        Raises:
            ValueError: when no convolution was recorded since the last recurrence.
        """
        if self.mixer is None:
            raise ValueError(
                "tree_execution='depth_first': a recurrent mixer ran without a causal convolution before it, so its "
                "carried state cannot be matched to its layer. Use tree_execution='packed'."
            )
        key, self.mixer = ("state", self.mixer), None
        return key

    @staticmethod
    def join(key: Hashable, entries: list[torch.Tensor]) -> torch.Tensor:
        """The ancestors' entry of ``key`` from the entries of the cached pieces on a unit's path (root first): per
        token entries concatenated on dim 2, a recurrent state the last piece's (the state entering the unit)."""
        if isinstance(key, tuple) and key[0] == "state":
            return entries[-1]
        return torch.cat(entries, dim=2)


def attention_layer(module: torch.nn.Module) -> int:
    """The ``layer_idx`` of an attention module (its cache key).

    Raises:
        ValueError: when the module has no integer ``layer_idx`` (its cache could not be matched to its layer).
    """
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(
            f"tree_execution='depth_first': attention module {type(module).__name__} has no integer layer_idx, so its "
            "cached keys/values cannot be matched to its layer. Use tree_execution='packed'."
        )
    return layer


def prefix_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    prefix: PrefixCache,
    engine: TreeAttentionEngine,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """Attention of a unit's queries over the row ``[prefix | unit]`` (``prefix.row_kv_end``, ``row_position_ids``).

    Args:
        query: ``[B, H, N, D]`` the unit's queries.
        key, value: ``[B, Hkv, N, D]`` the unit's keys/values.
        prefix_key, prefix_value: ``[B, Hkv, P, D]`` the ancestors' (``prefix``'s entries for this layer).
        prefix: the unit's cache (its row's ``kv_end`` and depths).
        engine: the tree engine of the call.
        options: the call's options; their ``position_ids`` are not read (the row's depths are the prefix's) and a
            ``bidirectional_block`` is refused.

    Returns:
        ``[B, N, H, D]`` in ``query``'s dtype. Where ``engine`` would run ``segments`` (CPU, no window, soft-cap or
        sinks), its rectangles of the unit's queries only (``plan_from_query``). Otherwise, when the prefix's own
        causal pairs cost at most as much as the unit's queries, ``engine`` on the whole row with zero queries at the
        prefix (their outputs dropped: they receive no gradient); else, for a long prefix over a short unit, the
        unit's queries against all keys with the dense mask: PyTorch's SDPA, or the models' eager math
        (``masked_attention``) for soft-capping or sinks.
    """
    if options.bidirectional_block is not None:
        raise ValueError("prefix_tree_attention (depth-first execution) has no bidirectional_block overlay.")
    num_prefix = prefix.row_kv_end.shape[1] - query.shape[2]
    keys = torch.cat([prefix_key.to(key.dtype), key], dim=2)
    values = torch.cat([prefix_value.to(value.dtype), value], dim=2)
    options = replace(options, position_ids=prefix.row_position_ids)
    queries = torch.cat([query.new_zeros(*query.shape[:2], num_prefix, query.shape[3]), query], dim=2)
    if _runs_segments(engine, query, prefix.row_kv_end, options):  # the unit's rectangles only
        plan = plan_from_query(cached_segment_plan(prefix.row_kv_end), num_prefix, keys.shape[2])
        out = segment_tree_attention(queries, keys, values, prefix.row_kv_end, options, plan=plan)
        return out[:, num_prefix:]
    if num_prefix * num_prefix <= 2 * query.shape[2] * keys.shape[2]:
        out = engine(queries, keys, values, prefix.row_kv_end, options)
        return out[:, num_prefix:]
    sliding_window, attention_chunk = options.sliding_window, options.attention_chunk
    check_window_depths("prefix_tree_attention", prefix.row_position_ids, sliding_window, attention_chunk)
    rows = torch.arange(query.shape[0], device=query.device)[:, None, None]
    positions = torch.arange(keys.shape[2], device=query.device)
    mask_mod = tree_mask_mod(
        prefix.row_kv_end, prefix.row_position_ids, sliding_window, attention_chunk=attention_chunk
    )
    visible = mask_mod(rows, None, positions[num_prefix:, None], positions[None, :])[:, None]  # [B, 1, N, P + N]
    scaling, softcap, sinks = options.scaling, options.softcap, options.sinks
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=True)
    else:
        out = masked_attention(query, keys, values, visible, scaling=scaling, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous()


def _runs_segments(
    engine: TreeAttentionEngine, query: torch.Tensor, row_kv_end: torch.Tensor, options: TreeAttentionOptions
) -> bool:
    """Whether ``engine`` would run the ``segments`` engine on this row (``cpu_tree_attention``'s choice), and no
    sinks are asked for (the engine merges them into every row, the prefix's unwritten ones included)."""
    if engine not in (cpu_tree_attention, segment_tree_attention) or query.device.type != "cpu":
        return False
    if any(getattr(options, name) is not None for name in ("sliding_window", "softcap", "sinks", "attention_chunk")):
        return False
    return engine is segment_tree_attention or cached_segment_plan(row_kv_end).tokens_per_call >= MIN_TOKENS_PER_CALL
