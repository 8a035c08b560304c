"""Registers ``attn_implementation="tree_flash"`` with transformers (``import hf_tree`` does it as soon as
``transformers.modeling_utils`` is imported: ``hf_tree.post_import``)."""

from __future__ import annotations

import functools

from hf_tree.attention import tree_attention_forward
from hf_tree.attention.dual import tree_mask_function
from hf_tree.attention.families import refuse_family
from hf_tree.attention.names import TREE_ATTENTION_NAME


def _allow_tree_flash(check):
    """transformers treats any name containing "flash" as a flash-attn kernel to import and fails to load
    it; let exactly ``tree_flash`` through (refusing the families of ``hf_tree.attention.families`` by name) and leave
    every other name to the original check."""

    @functools.wraps(check)
    def wrapper(self, attn_implementation, *args, **kwargs):
        if attn_implementation == TREE_ATTENTION_NAME:
            refuse_family(self.config, type(self).__name__)
            return TREE_ATTENTION_NAME
        return check(self, attn_implementation, *args, **kwargs)

    wrapper.__hf_tree_patched__ = True
    return wrapper


def register_tree_attention() -> None:
    """Idempotent: register the attention and mask functions and the narrow loading override."""
    # imported here: importing transformers.modeling_utils calls this function (hf_tree.post_import)
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION_NAME, tree_mask_function)
    check = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(check, "__hf_tree_patched__", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _allow_tree_flash(check)
