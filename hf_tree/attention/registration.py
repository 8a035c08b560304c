"""Registers ``attn_implementation="tree_flash"`` with transformers (``import hf_tree`` does it as soon as
``transformers.modeling_utils`` is imported: ``hf_tree.post_import``)."""

from __future__ import annotations

import functools
from types import ModuleType

from hf_tree.attention import tree_attention_forward
from hf_tree.attention.dual import tree_mask_function
from hf_tree.attention.families import refuse_family
from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.post_import import when_imported

# Modules whose ``is_flash_attention_requested`` checks refuse what tree_flash does (its name contains "flash", so
# transformers takes it for a flash-attn kernel): Llama 4's chunked masks ("Flash attention cannot handle chunked
# attention", masking_utils) and HRM-text's PrefixLM overlay (its config and model). tree_flash builds every mask
# itself (hf_tree.attention.dual/options), so there it is not flash attention. Elsewhere the name keeps meaning
# flash: vision towers then pass flash-attn's varlen packing (cu_seq_lens), which dual mode honours as a mask.
NOT_FLASH_IN = (
    "transformers.masking_utils",
    "transformers.models.hrm_text.configuration_hrm_text",
    "transformers.models.hrm_text.modeling_hrm_text",
)


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


def _tree_flash_is_not_flash(module: ModuleType) -> None:
    """Make ``module``'s ``is_flash_attention_requested`` answer ``False`` for tree_flash (idempotent)."""
    predicate = module.is_flash_attention_requested
    if getattr(predicate, "__hf_tree_patched__", False):
        return

    @functools.wraps(predicate)
    def wrapper(config=None, requested_attention_implementation=None, version=None):
        name = requested_attention_implementation if config is None else getattr(config, "_attn_implementation", None)
        if name == TREE_ATTENTION_NAME:
            return False
        return predicate(config, requested_attention_implementation, version)

    wrapper.__hf_tree_patched__ = True
    module.is_flash_attention_requested = wrapper


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
    for module_name in NOT_FLASH_IN:
        when_imported(module_name, _tree_flash_is_not_flash)
