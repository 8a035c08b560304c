"""Dual mode: ``tree_flash`` without ``kv_end`` is exactly the model's own attention.

transformers builds each layer type's mask (causal, sliding window, chunked, padded, packed...) once per
forward, through the mask function registered for the attention implementation, before any layer runs. That
function cannot see ``kv_end``, so ``tree_mask_function`` returns a ``DeferredMask`` holding transformers'
arguments. Packed-tree forwards never build it (``kv_end`` carries their mask: no ``N x N`` tensor); ordinary
forwards build exactly the mask ``sdpa`` or ``eager`` would have received (``None`` for a plain causal sdpa
forward), once per layer type. It is never ``None`` itself: a model that computes with its mask outside the
attention interface (Bloom, Falcon, GPT-J...) then fails loudly instead of reading ``None`` as "no mask".

An ordinary forward then runs the model's own attention (``model_attention_forward``): ``sdpa`` when the model
supports it and the layer asks for nothing SDPA cannot do (logit softcapping, attention sinks), else the
``eager_attention_forward`` of the layer's own modeling module, i.e. what ``attn_implementation="eager"`` runs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

# Keywords of transformers' attention calls that sdpa cannot honour (it raises on softcap, ignores sinks).
EAGER_ONLY_KEYWORDS = ("softcap", "s_aux", "sinks")


class DeferredMask:
    """The mask arguments transformers gave the mask function for one layer type; the mask is built on first
    use, for the attention that uses it (``sdpa``: bool ``[B, 1, Q, KV]`` or ``None``; ``eager``: additive)."""

    def __init__(self, arguments: dict) -> None:
        self.arguments = arguments
        self._built: dict[str, torch.Tensor | None] = {}
        self._padded: bool | None = None

    def build(self, flavour: str) -> torch.Tensor | None:
        """The mask ``attn_implementation=flavour`` ("sdpa" or "eager") would have received."""
        if flavour not in self._built:
            make = sdpa_mask if flavour == "sdpa" else eager_mask
            self._built[flavour] = make(**self.arguments)
        return self._built[flavour]

    @property
    def padded(self) -> bool:
        """Whether the 2D ``attention_mask`` given to the model hides any token."""
        if self._padded is None:
            padding = self.arguments.get("attention_mask")
            self._padded = padding is not None and not bool(padding.all())
        return self._padded

    # Enough of a 4D mask's face for transformers to pass a prepared one through: generate() with a static cache
    # prepares masks in advance (and makes them contiguous), and the model's mask creation then sees one again.
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``[B, 1, Q, KV]``, the shape of the mask it stands for."""
        arguments = self.arguments
        return arguments["batch_size"], 1, arguments["q_length"], arguments["kv_length"]

    def contiguous(self) -> DeferredMask:
        return self

    # Model code that computes with its mask instead of handing it to the attention function cannot work with
    # a deferred one: say so instead of failing inside torch.
    def _used_outside_attention(self, *args, **kwargs):
        raise ValueError(
            "this model computes with its attention mask outside the attention function, which "
            "attn_implementation='tree_flash' does not support (its mask is built inside attention); load the "
            "model with attn_implementation='sdpa' or 'eager'."
        )

    __getitem__ = __add__ = __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = _used_outside_attention

    def __getattr__(self, name: str):
        raise AttributeError(
            f"tree_flash's deferred attention mask has no attribute {name!r}: the model computes with its attention "
            "mask outside the attention function, which attn_implementation='tree_flash' does not support; load it "
            "with attn_implementation='sdpa' or 'eager'."
        )


def tree_mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> DeferredMask:
    """Mask factory of ``tree_flash`` (``AttentionMaskInterface``; arguments as ``sdpa_mask``): a
    ``DeferredMask`` of the arguments; a deferred mask prepared earlier (static-cache generation) as it is."""
    if isinstance(attention_mask, DeferredMask):
        return attention_mask
    return DeferredMask(
        dict(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            attention_mask=attention_mask,
            **kwargs,
        )
    )


@functools.cache
def _modeling_module_refuses_sdpa(attention_class: type) -> bool:
    """Whether a ``PreTrainedModel`` of the attention class's modeling module refuses sdpa (so transformers
    would load the model with ``eager``)."""
    # imported here: transformers.modeling_utils registers tree_flash on import (hf_tree.post_import), which needs
    # this package fully imported
    from transformers import PreTrainedModel

    namespace = vars(sys.modules[attention_class.__module__])
    return any(
        isinstance(obj, type)
        and issubclass(obj, PreTrainedModel)
        and obj.__module__ == attention_class.__module__
        and not obj._supports_sdpa
        for obj in namespace.values()
    )


def own_eager_attention(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the module's modeling file (where softcapping and sinks live)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} ({type(module).__module__}) runs eager attention without kv_end (it passes one "
            f"of {', '.join(EAGER_ONLY_KEYWORDS)} or its model refuses sdpa) but its module defines no "
            "eager_attention_forward; load the model with attn_implementation='eager' for such forwards."
        )
    return eager


def uses_eager(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the model's own attention for this call is ``eager`` rather than ``sdpa``."""
    return any(kwargs.get(name) is not None for name in EAGER_ONLY_KEYWORDS) or _modeling_module_refuses_sdpa(
        type(module)
    )


def _eager_mask(attention_mask, query: torch.Tensor, key: torch.Tensor, causal: bool = True) -> torch.Tensor | None:
    """The additive mask eager attention expects: ``eager_mask``'s for a deferred mask; for ``None`` (a model
    that passes none: sdpa would run ``is_causal``) an explicit causal mask aligned top-left, as SDPA's is, or none
    for a non-causal call (``causal=False``: e.g. Inkling2's attention over layer states)."""
    if isinstance(attention_mask, DeferredMask):
        return attention_mask.build("eager")
    if attention_mask is None and not causal:
        return None
    if attention_mask is None:
        q_length, kv_length = query.shape[2], key.shape[2]
        if q_length == 1:
            return None
        visible = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril()[None, None]
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        return attention_mask
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(visible, zero, torch.finfo(query.dtype).min)


def varlen_mask(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``[1, 1, Q, KV]`` bool mask of flash-attention's varlen packing (``cu_seq_lens_q/k``: cumulative sequence
    starts along the packed axis): each sequence attends within itself, causally (aligned bottom-right, as
    flash-attention does) when the layer is causal. Vision towers pass these because "tree_flash" names flash."""
    cu_q = kwargs["cu_seq_lens_q"].to(query.device, torch.int64)
    cu_k = kwargs.get("cu_seq_lens_k", cu_q).to(query.device, torch.int64)
    q_ids = torch.arange(query.shape[2], device=query.device)
    k_ids = torch.arange(key.shape[2], device=query.device)
    q_seq = torch.searchsorted(cu_q, q_ids, right=True) - 1
    k_seq = torch.searchsorted(cu_k, k_ids, right=True) - 1
    visible = q_seq[:, None] == k_seq[None, :]
    if kwargs.get("is_causal", getattr(module, "is_causal", True)):
        # a key at most as far from its sequence's end as the query is from its own
        visible &= (cu_k[k_seq + 1] - k_ids)[None, :] >= (cu_q[q_seq + 1] - q_ids)[:, None]
    return visible[None, None]


def model_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own attention (sdpa or its eager function) with the mask that implementation would get;
    ``kwargs`` (``scaling``, ``dropout``, ``sliding_window``, ``softcap``, ``s_aux``...) are passed unchanged."""
    if kwargs.get("cu_seq_lens_q") is not None:  # flash-attention varlen packing: sdpa/eager need it as a mask
        if attention_mask is not None:
            raise ValueError(
                f"{type(module).__name__} passes both an attention mask and cu_seq_lens_q (flash-attention varlen "
                "packing); tree_flash without kv_end supports one of them. Use attn_implementation='sdpa'."
            )
        attention_mask = varlen_mask(module, query, key, kwargs)
    if uses_eager(module, kwargs):
        if kwargs.get("scaling") is None:
            kwargs["scaling"] = query.shape[-1] ** -0.5
        # sdpa_attention_forward reads causality the same way (the call's is_causal, else the module's)
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
        mask = _eager_mask(attention_mask, query, key, causal)
        return own_eager_attention(module)(module, query, key, value, mask, **kwargs)
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build("sdpa")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
