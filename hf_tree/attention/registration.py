"""Registers ``attn_implementation="tree_flash"`` with transformers (done on ``import hf_tree``)."""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_tree.attention import tree_attention_forward

TREE_ATTENTION_NAME = "tree_flash"


def tree_mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask factory for ``tree_flash``: no mask for an unpadded, cache-free forward (packed trees carry
    their mask in ``kv_end``, and plain batches use causal SDPA); otherwise exactly SDPA's mask, so
    padded batches and ``generate()`` keep working."""
    if attention_mask is None and isinstance(q_offset, int) and q_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def _allow_tree_flash(check):
    """transformers treats any name containing "flash" as a flash-attn kernel to import and fails to load
    it; let exactly ``tree_flash`` through and leave every other name to the original check."""

    @functools.wraps(check)
    def wrapper(self, attn_implementation, *args, **kwargs):
        if attn_implementation == TREE_ATTENTION_NAME:
            return TREE_ATTENTION_NAME
        return check(self, attn_implementation, *args, **kwargs)

    wrapper.__hf_tree_patched__ = True
    return wrapper


def register_tree_attention() -> None:
    """Idempotent: register the attention and mask functions and the narrow loading override."""
    AttentionInterface.register(TREE_ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION_NAME, tree_mask_function)
    check = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(check, "__hf_tree_patched__", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _allow_tree_flash(check)
