"""Attention over a cached ancestor prefix: the attention half of depth-first execution (``hf_tree.depth_first``).

A depth-first unit (one node piece, or a packed mini-tree of sibling subtrees) is forwarded alone. Its queries see
the keys/values of its ancestors, computed by earlier units and handed in through the model keyword ``kv_prefix``
(a ``KVPrefix``; like ``kv_end`` it reaches the attention function through transformers' ``**kwargs``), then its own
keys under its own ``kv_end``. The attention function also records the unit's own post-RoPE keys/values into the
same object, per ``layer_idx``, for the unit's descendants.

The mask is the tree mask of the concatenated row ``[prefix | unit]``: prefix keys end after the unit (every query
sees them), the unit's keys keep their ``kv_end`` shifted by the prefix length, and key positions are depths, so
sliding windows (depth distance), sinks and soft-capping are those of the packed row (``hf_tree.attention.mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_tree.attention.mask import check_window_depths, tree_mask_mod
from hf_tree.attention.reference import masked_attention


@dataclass(eq=False)
class KVPrefix:
    """The ancestors' cache one depth-first unit attends to, and the unit's own keys/values (a side output).

    Attributes:
        keys, values: per ``layer_idx``, ``[B, Hkv, P, D]`` post-RoPE keys/values of the ancestors (the layer's
            ``key``/``value`` as its attention function receives them); empty for a unit without ancestors.
        position_ids: ``[B, P]`` depths of the prefix keys (sliding windows measure depth distance).
        own_keys, own_values: filled by the attention function: per ``layer_idx``, the unit's ``[B, Hkv, N, D]``
            keys/values (with their autograd graph), the cache its descendants attend to.
    """

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    position_ids: torch.Tensor
    own_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    own_values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """``P``, the number of prefix tokens."""
        return int(self.position_ids.shape[-1])

    def record(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[int, bool]:
        """Keep ``module``'s keys/values for the unit's descendants; ``(layer_idx, whether a prefix exists)``.

        Raises:
            ValueError: when the attention module has no integer ``layer_idx`` (the cache could not be matched to
                its layer).
        """
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(
                f"tree_execution='depth_first': attention module {type(module).__name__} has no integer layer_idx, "
                "so its cached keys/values cannot be matched to its layer. Use tree_execution='packed'."
            )
        # A checkpointed layer records again when it is recomputed in backward; the unit has read its entry by then.
        self.own_keys[layer], self.own_values[layer] = key, value
        return layer, self.length > 0


def prefix_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    prefix_positions: torch.Tensor,
    *,
    scaling: float,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a unit's queries over ``[prefix | unit]`` keys.

    Args:
        query: ``[B, H, N, D]`` the unit's queries.
        key, value: ``[B, Hkv, N, D]`` the unit's keys/values.
        kv_end: ``[B, N]`` the unit's subtree ends, local to the unit (``j < kv_end[j] <= N``).
        prefix_key, prefix_value: ``[B, Hkv, P, D]`` the ancestors' keys/values (every query sees them).
        prefix_positions: ``[B, P]`` depths of the prefix keys.
        scaling, position_ids, sliding_window, softcap, sinks: as in ``reference_tree_attention``.

    Returns:
        ``[B, N, H, D]`` in ``query``'s dtype. PyTorch's SDPA with a boolean mask (GQA without repeating K/V);
        the models' eager math (``masked_attention``) where soft-capping or sinks need it.
    """
    check_window_depths("prefix_tree_attention", position_ids, sliding_window)
    batch, num_prefix, num_own = query.shape[0], prefix_key.shape[2], query.shape[2]
    total = num_prefix + num_own
    full_kv_end = torch.cat([kv_end.new_full((batch, num_prefix), total), kv_end + num_prefix], dim=1)
    positions = None if position_ids is None else torch.cat([prefix_positions.to(position_ids), position_ids], dim=1)
    rows = torch.arange(batch, device=query.device)[:, None, None]
    queries = torch.arange(num_prefix, total, device=query.device)[:, None]
    visible = tree_mask_mod(full_kv_end, positions, sliding_window)(
        rows, None, queries, torch.arange(total, device=query.device)[None, :]
    )[:, None]  # [B, 1, N, P + N]
    keys = torch.cat([prefix_key.to(key.dtype), key], dim=2)
    values = torch.cat([prefix_value.to(value.dtype), value], dim=2)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=True)
    else:
        out = masked_attention(query, keys, values, visible, scaling=scaling, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous()
