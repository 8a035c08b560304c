"""What a packed-tree attention call (``kv_end`` given) may ask for: each attention-affecting keyword that
transformers' attention callers pass (checked against every ``attention_interface(...)`` call of transformers
5.23's and 5.24's models; 5.24 adds only flash-attn's ``deterministic`` and output plumbing) is either honoured by
the tree engines or refused here with a ``ValueError``; none is dropped.

Honoured: ``scaling``, ``sliding_window`` (in depth positions), ``softcap``, ``s_aux`` (one sink logit per query
head), ``position_ids`` (depths), causal masks of any layer type whose window the call passes, and chunked attention
(Llama 4: the layer's mask is chunked by the config's ``attention_chunk_size``; chunks are taken by depth). Refused:
the keywords in ``REFUSED_KEYWORDS``, non-causal attention, dropout, a KV cache, padding or custom masks beside
``kv_end``, other local masks the call does not pass as ``sliding_window``, and query scales computed from packed
indices (Llama 4's attention temperature tuning, on rows as long as its ``floor_scale``).
"""

from __future__ import annotations

import torch

from hf_tree.attention.dual import DeferredMask
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import check_bidirectional_block

# Keyword -> what it would do, for keywords tree mode cannot honour (refused when given and not None).
REFUSED_KEYWORDS = {
    "position_bias": "an additive position bias (T5-style relative attention)",
    "indices": "sparse top-k key indices (DeepSeek sparse attention)",
    "block_indices": "sparse key blocks",
    "sinks": "per-token attention sinks",
    "cu_seq_lens_q": "flash-attention varlen packing",
    "cu_seq_lens_k": "flash-attention varlen packing",
    "max_length_q": "flash-attention varlen packing",
    "max_length_k": "flash-attention varlen packing",
}


def _refuse(module: torch.nn.Module, what: str, fix: str) -> None:
    raise ValueError(f"tree_flash with kv_end (packed trees) in {type(module).__name__}: {what}. {fix}")


def _check_mask(module: torch.nn.Module, attention_mask, sliding_window: int | None) -> int | None:
    """The layer's mask must be one the tree engines reproduce from ``kv_end`` (+ ``sliding_window``); returns the
    chunk size of a chunked-attention mask (``None`` otherwise)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, DeferredMask):
        _refuse(
            module,
            f"it received a ready-made attention mask ({type(attention_mask).__name__}), which tree mode would ignore",
            "Packed trees carry their whole mask in kv_end: do not pass a 4D attention_mask with kv_end.",
        )
    arguments = attention_mask.arguments
    if "allow_is_bidirectional_skip" in arguments:
        _refuse(module, "the layer attends bidirectionally", "Tree training needs causal attention.")
    if arguments.get("use_vmap"):
        _refuse(
            module,
            "the layer's mask has a custom overlay (or_mask_function/and_mask_function, e.g. image tokens or "
            "bidirectional windows) that tree mode cannot reproduce",
            "Train this model without kv_end, or drop the inputs that add the overlay.",
        )
    local_size = arguments.get("local_size")
    # transformers' chunked masks (create_chunked_causal_mask) pass the config's attention_chunk_size as local_size;
    # only configs with chunked_attention layers build them
    config = arguments.get("config")
    chunk = getattr(config, "attention_chunk_size", None)
    chunked_layers = "chunked_attention" in (getattr(config, "layer_types", None) or ())
    chunked = chunked_layers and local_size is not None and local_size != sliding_window and local_size == chunk
    if local_size is not None and local_size != sliding_window and not chunked:
        _refuse(
            module,
            f"the layer's mask limits attention to local_size={local_size}, a window the layer does not pass to "
            f"attention as sliding_window={sliding_window} (and not the config's attention_chunk_size={chunk})",
            "Tree mode reproduces sliding windows the layer passes and chunked attention only.",
        )
    if attention_mask.padded:
        _refuse(
            module,
            "attention_mask hides some tokens",
            "Padding of packed rows is marked in kv_end (kv_end[j] = j + 1), as TreeDataCollator does; drop "
            "attention_mask from tree forwards.",
        )
    return local_size if chunked else None


def _check_packed_index_scale(module: torch.nn.Module, num_tokens: int) -> None:
    """Llama 4's NoPE layers scale queries by ``log1p(floor((i + 1) / floor_scale))`` of the packed index ``i``, not
    of ``position_ids``: the same as each branch alone (every depth is at most its packed index) only while every
    packed index stays below ``floor_scale - 1``. ``num_tokens`` counts the row, or for a depth-first unit the unit
    with its cached ancestors: a unit's index restarts at 0 while its depths go on, and that row bounds them."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    floor_scale = getattr(module, "floor_scale", None)
    if floor_scale is not None and num_tokens >= floor_scale:
        _refuse(
            module,
            f"its attention temperature tuning scales queries by packed index (not depth) and a packed row (or a "
            f"depth-first unit with its cached ancestors) of {num_tokens} tokens reaches floor_scale={floor_scale}",
            f"Pack rows shorter than {floor_scale} tokens (max_packed_tokens < floor_scale; trees deeper than that "
            "cannot run depth-first either), or set the config's attn_temperature_tuning=False.",
        )


def tree_mode_options(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    kv_end: torch.Tensor,
    attention_mask,
    scaling: float | None,
    dropout: float,
    kwargs: dict,
    row_tokens: int | None = None,
    bidirectional_block: torch.Tensor | None = None,
) -> TreeAttentionOptions:
    """Validate a tree attention call (``query [B, H, N, D]``, ``key [B, Hkv, N, D]``, ``kv_end [B, N]``) and
    return the options the engines honour; ``ValueError`` for anything they would otherwise drop. ``row_tokens``:
    the length of the row the queries belong to when longer than ``N`` (a depth-first unit's ``[prefix | unit]``).
    ``bidirectional_block [B, N]``: the call's bidirectional overlay, or ``None``."""
    if dropout > 0.0:
        raise ValueError(
            f"tree_flash attention does not support attention dropout (got dropout={dropout}); "
            "set the model config's attention_dropout to 0.0."
        )
    if kv_end.shape != query.shape[:1] + query.shape[2:3]:
        raise ValueError(
            f"kv_end has shape {tuple(kv_end.shape)}; expected [batch, seq] = "
            f"{[query.shape[0], query.shape[2]]} matching input_ids."
        )
    if key.shape[2] != query.shape[2]:
        _refuse(
            module,
            f"it got {key.shape[2]} keys for {query.shape[2]} queries (a KV cache with earlier tokens)",
            "Tree forwards cannot continue a cache; pass use_cache=False and no past_key_values with kv_end.",
        )
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        _refuse(module, "the layer is not causal (is_causal=False)", "Tree training needs causal attention.")
    for name, meaning in REFUSED_KEYWORDS.items():
        if kwargs.get(name) is not None:
            _refuse(module, f"the layer passes {name}= ({meaning})", "Tree mode cannot apply it exactly.")
    sliding_window = kwargs.get("sliding_window")
    attention_chunk = _check_mask(module, attention_mask, sliding_window)
    _check_packed_index_scale(module, query.shape[2] if row_tokens is None else row_tokens)
    check_bidirectional_block("tree_flash", kv_end, bidirectional_block)
    return TreeAttentionOptions(
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        sliding_window=sliding_window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        position_ids=kwargs.get("position_ids"),
        attention_chunk=attention_chunk,
        bidirectional_block=bidirectional_block,
    )
