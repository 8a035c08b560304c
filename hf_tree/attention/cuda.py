"""The automatic tree engine on CUDA: one rule, per call, over ``varlen``, ``flash_attn`` and ``flex``.

1. ``varlen`` (PyTorch's own flash varlen kernel, nothing to install) when it computes the call exactly
   (``varlen_refusal``: half precision, head dim a multiple of 8 up to 256, no soft-cap, chunks or bidirectional
   blocks; sinks and sliding windows are fine) and the batch's segments are long enough for its tiles: at least
   ``VARLEN_MIN_TOKENS_PER_SEQUENCE`` non-padding tokens per kernel sequence (``VarlenPlan.tokens_per_sequence``).
2. ``flash_attn`` where flash-attn is installed and computes the call exactly (it adds soft-capping).
3. ``flex`` (compiled FlexAttention) for the rest: many short segments, soft-capping without flash-attn, chunks,
   bidirectional blocks, float32.

The threshold is a first estimate, not a GPU measurement (none was lent when the rule was written): the kernels
tile queries by 64-128 rows per sequence, so a sequence of ``L`` tokens keeps about ``L / 128`` of a tile busy, while
FlexAttention's 128 x 128 blocks pay for partial tiles too but without the second call and the merge. Tune it on a
GPU with ``python benchmarks/varlen_threshold.py``, which prints the value to set.
"""

from __future__ import annotations

import torch

from hf_tree.attention import flash
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.flex import flex_tree_attention
from hf_tree.attention.varlen import cached_varlen_plan, torch_varlen_tree_attention, varlen_refusal

# Batches whose kernel sequences (segments, sibling groups) average fewer non-padding tokens than this go to flash-attn
# or flex. An unmeasured first estimate, to be tuned on a GPU (module docstring, docs/attention.md).
VARLEN_MIN_TOKENS_PER_SEQUENCE = 64


def cuda_engine_choice(
    query: torch.Tensor, value: torch.Tensor, kv_end: torch.Tensor, options: TreeAttentionOptions
) -> str:
    """The engine ``cuda_tree_attention`` runs for a call (``query [B, H, N, D]``, ``value [B, Hkv, N, Dv]``,
    ``kv_end [B, N]``): ``"varlen"``, ``"flash_attn"`` or ``"flex"`` (module docstring)."""
    if varlen_refusal(query, options) is None:
        plan = cached_varlen_plan(kv_end, options.sliding_window)
        if plan.tokens_per_sequence >= VARLEN_MIN_TOKENS_PER_SEQUENCE:
            return "varlen"
    reason = flash.flash_attn_refusal(query, value, options.sinks, options.bidirectional_block, options.attention_chunk)
    return "flash_attn" if reason is None else "flex"


def cuda_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    options: TreeAttentionOptions,
) -> torch.Tensor:
    """The automatic engine on CUDA (``cuda_engine_choice``), a ``TreeAttentionEngine`` honouring every option."""
    engines = {
        "varlen": torch_varlen_tree_attention,
        "flash_attn": flash.flash_tree_attention,
        "flex": flex_tree_attention,
    }
    return engines[cuda_engine_choice(query, value, kv_end, options)](query, key, value, kv_end, options)
