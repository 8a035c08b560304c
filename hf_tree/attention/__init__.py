"""The one attention entry point behind ``attn_implementation="tree_flash"``.

``tree_attention_forward`` is what transformers calls in every attention layer. With a ``kv_end``
keyword (packed trees) it runs a tree engine; without one (generation, ordinary batches) it is exactly the
model's own attention (``sdpa``, or ``eager`` where the model needs it: softcapping, sinks), with the mask of
every layer kind (sliding, chunked, padded), so a tree-trained model evaluates and generates unchanged.

Engines share one interface, ``TreeAttentionEngine`` (``hf_tree.attention.engine``): ``engine(query, key, value,
kv_end, options)`` with one ``TreeAttentionOptions``. The engine is chosen once per call
from the device, unless forced with ``HF_TREE_ATTENTION_BACKEND`` or ``set_attention_backend``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator

import torch

from hf_tree.attention.blocked import blocked_tree_attention
from hf_tree.attention.cuda import cuda_tree_attention
from hf_tree.attention.dual import DeferredMask, model_attention_forward
from hf_tree.attention.engine import EngineRefused, TreeAttentionEngine, TreeAttentionOptions
from hf_tree.attention.flash import flash_tree_attention
from hf_tree.attention.flex import flex_tree_attention
from hf_tree.attention.head_dims import equal_head_dims
from hf_tree.attention.mask import (
    dense_tree_mask,
    render_mask,
    tree_mask_mod,
    visible_keys_per_query,
)
from hf_tree.attention.options import tree_mode_options
from hf_tree.attention.prefix import PrefixCache, attention_layer, prefix_tree_attention
from hf_tree.attention.reference import reference_tree_attention
from hf_tree.attention.segments import cpu_tree_attention, segment_tree_attention
from hf_tree.attention.torch_cp import refuse_torch_context_parallel
from hf_tree.attention.varlen import torch_varlen_tree_attention

ENGINES: dict[str, TreeAttentionEngine] = {
    "cpu": cpu_tree_attention,  # automatic off CUDA: "segments" where the row suits it, else "blocked"
    "cuda": cuda_tree_attention,  # automatic on CUDA: "varlen", "flash_attn" or "flex" by hf_tree.attention.cuda
    "blocked": blocked_tree_attention,  # any device: block-skipping PyTorch, custom autograd
    "flash_attn": flash_tree_attention,  # CUDA: flash-attn varlen over each segment's gathered root-to-segment path
    "flex": flex_tree_attention,  # CUDA: compiled FlexAttention with a cached BlockMask
    "reference": reference_tree_attention,  # dense mask, for tests
    "segments": segment_tree_attention,  # CPU: PyTorch's fused attention kernel on the mask's rectangles
    "varlen": torch_varlen_tree_attention,  # CUDA: PyTorch's flash varlen kernel, calls merged by lse (CPU: tests)
}
BACKEND_ENV_VAR = "HF_TREE_ATTENTION_BACKEND"
_forced_backend: str | None = None
_UNSET = object()
# The engine of an enclosing ``attention_engine_scope`` (tree context parallel registers its per-batch engine
# here); a ContextVar, so that threads and async tasks each see their own scope.
_scoped_engine: contextvars.ContextVar[TreeAttentionEngine | None] = contextvars.ContextVar(
    "hf_tree_scoped_attention_engine"
)


@contextlib.contextmanager
def attention_engine_scope(engine: TreeAttentionEngine | None) -> Iterator[None]:
    """Run every tree-mode attention call of the block (forward and its backward recomputation) on ``engine``
    (a ``TreeAttentionEngine``, as ``ENGINES``' entries); ``None`` restores the automatic choice inside an outer
    scope."""
    token = _scoped_engine.set(engine)
    try:
        yield
    finally:
        _scoped_engine.reset(token)


def scoped_attention_engine() -> TreeAttentionEngine | None:
    """The engine of the enclosing ``attention_engine_scope``, or ``None``.

    Checkpoint recomputation runs on autograd's device threads, which do not enter the context of the thread
    that called ``backward()``; torch keeps a copy of that context in its thread-local state (propagated to
    those threads), so a scope the current thread never set is looked up there.
    """
    engine = _scoped_engine.get(_UNSET)
    if engine is _UNSET and torch._C._is_key_in_tls("context"):
        launched = torch._C._get_obj_in_tls("context")  # contextvars.Context of the backward() caller
        engine = launched.get(_scoped_engine, None) if launched is not None else None
    return None if engine is _UNSET else engine


def set_attention_backend(name: str | None) -> None:
    """Force an engine for every later call (``None`` restores automatic choice)."""
    global _forced_backend
    if name is not None and name not in ENGINES:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {sorted(ENGINES)} or None.")
    _forced_backend = name


def select_backend(device: torch.device) -> str:
    """The engine name for tensors on ``device``: forced > environment > automatic ("cuda" on CUDA: varlen, flash-attn
    or flex by ``hf_tree.attention.cuda``'s rule; "cpu" elsewhere)."""
    name = _forced_backend or os.environ.get(BACKEND_ENV_VAR) or "auto"
    if name == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if name not in ENGINES:
        raise ValueError(f"{BACKEND_ENV_VAR}={name!r} is unknown; choose one of {sorted(ENGINES)} or 'auto'.")
    return name


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: DeferredMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_end: torch.Tensor | None = None,
    kv_prefix: PrefixCache | None = None,
    bidirectional_block: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention interface: ``query [B, H, N, D]``, ``key/value [B, Hkv, N, D]`` ->
    ``([B, N, H, D], weights or None)``. ``kv_end [B, N]`` selects tree mode; without it this is the model's own
    attention (``hf_tree.attention.dual``). ``position_ids``, ``sliding_window``, ``softcap``, ``s_aux`` and
    the other keywords of transformers' attention calls arrive in ``kwargs`` (see ``hf_tree.attention.options``).
    ``kv_prefix`` (with ``kv_end``; depth-first execution, ``hf_tree.depth_first``): the ancestors' cached keys and
    values every query also sees; the layer's own keys/values are recorded into it. ``bidirectional_block [B, N]``
    (with ``kv_end``): a bidirectional overlay, the block id of each token (``-1``: none), tokens of one block seeing
    each other both ways (Gemma 3's image tokens; ``hf_tree.attention.mask.tree_mask_mod``)."""
    if kv_end is None:
        if kv_prefix is not None:
            raise ValueError("kv_prefix (depth-first execution) needs kv_end: pass the unit's subtree ends too.")
        if bidirectional_block is not None:
            raise ValueError(
                "bidirectional_block (a tree mask overlay) needs kv_end; without it the model builds its own mask "
                "(pass its own inputs for that, e.g. Gemma 3's token_type_ids)."
            )
        return model_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    refuse_torch_context_parallel()  # torch's CP would shard the row and force a causal mask
    engine = scoped_attention_engine()  # e.g. hf_tree.parallel's context parallel: local rows, all keys
    # An engine that runs a shard of a longer row (tree context parallel) names the row's length: packed-index
    # checks measure the whole row, and it takes the row's depths from its own batch.
    shard_of_row = getattr(engine, "row_tokens", None)
    row_tokens = shard_of_row if kv_prefix is None else kv_prefix.row_kv_end.shape[1]  # depth-first: the unit's
    options = tree_mode_options(
        module, query, key, kv_end, attention_mask, scaling, dropout, kwargs, row_tokens, bidirectional_block
    )
    if bidirectional_block is not None and (engine is not None or kv_prefix is not None):
        raise ValueError(
            "bidirectional_block (e.g. Gemma 3's image blocks) is supported by the packed tree engines only, not "
            "inside an attention_engine_scope (tree context parallel) or with kv_prefix (depth-first execution). "
            "Use tree_execution='packed' without context parallel."
        )
    if engine is not None and kv_prefix is not None:
        raise ValueError(
            "kv_prefix (tree_execution='depth_first') inside an attention_engine_scope (tree context parallel): the "
            "scoped engine runs sharded rows, not a unit over its cache. Use tree_execution='packed' with context "
            "parallel."
        )
    if engine is None:
        engine = ENGINES[select_backend(query.device)]
    # MLA (value head size != query/key head size): every engine runs one padded head size, exactly
    query, key, value, value_dim = equal_head_dims(query, key, value)
    if kv_prefix is not None:  # depth-first execution: this unit's keys/values are its descendants' cache
        layer = attention_layer(module)
        prefix_key, prefix_value = kv_prefix.record(("key", layer), key), kv_prefix.record(("value", layer), value)
        if prefix_key is not None:
            out = prefix_tree_attention(query, key, value, prefix_key, prefix_value, kv_prefix, engine, options)
            return out[..., :value_dim], None
    if options.position_ids is None and options.attention_chunk is not None and shard_of_row is None:
        # Llama 4's layers do not pass position_ids; a token's index in its branch (what transformers' chunks count)
        # is its depth, the number of its ancestors (a shard engine counts them on the whole row)
        options = dataclasses.replace(options, position_ids=visible_keys_per_query(kv_end) - 1)
    out = engine(query, key, value, kv_end, options)
    return out[..., :value_dim], None


__all__ = [
    "ENGINES",
    "EngineRefused",
    "PrefixCache",
    "TreeAttentionEngine",
    "TreeAttentionOptions",
    "attention_engine_scope",
    "scoped_attention_engine",
    "blocked_tree_attention",
    "cpu_tree_attention",
    "cuda_tree_attention",
    "DeferredMask",
    "dense_tree_mask",
    "flash_tree_attention",
    "flex_tree_attention",
    "model_attention_forward",
    "prefix_tree_attention",
    "reference_tree_attention",
    "render_mask",
    "segment_tree_attention",
    "select_backend",
    "torch_varlen_tree_attention",
    "set_attention_backend",
    "tree_attention_forward",
    "tree_mask_mod",
]
