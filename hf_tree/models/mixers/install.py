"""Plug the tree-aware mixer ops into transformers' hybrid models (``import hf_tree`` does it for each covered
modeling module as it is imported; idempotent).

The mixers of these models call module-level functions that transformers lets kernels replace
(``use_kernel_func_from_hub_with_fallback``) and pass them the model's keyword arguments, ``kv_end`` included.
Each such name in each modeling module is rebound to a dispatcher: with ``kv_end`` (a packed tree batch) it runs
the tree-aware op, without it the original function, so generation and ordinary batches are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Protocol, runtime_checkable

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_tree.attention import scoped_attention_engine
from hf_tree.models.hybrid_modules import TREE_MIXER_MODULES, modeling_module
from hf_tree.models.mixers.conv import tree_causal_conv1d
from hf_tree.models.mixers.delta_rule import tree_chunk_gated_delta_rule
from hf_tree.models.mixers.selective_scan import tree_mamba_selective_scan
from hf_tree.models.mixers.ssd import tree_mamba2_chunk_scan
from hf_tree.models.mixers.topology import tree_topology


def _skip_fused(*args, **kwargs) -> None:
    """Tree mode of ``mamba2_split_conv1d_scan_combined`` and ``mamba_inner_fn``: ``None`` makes the mixer take its
    unfused path, whose convolution and scan are tree-aware."""
    return None


def _refuse_cached_step(name: str) -> Callable[..., None]:
    def refuse(*args, **kwargs) -> None:
        raise ValueError(
            f"{name} (one cached decoding step) was called with kv_end: packed trees are trained without a cache; "
            "call the model with use_cache=False when passing kv_end, and without kv_end when generating."
        )

    return refuse


TREE_OPS: dict[str, Callable[..., object]] = {
    "causal_conv1d_fn": tree_causal_conv1d,
    "torch_chunk_gated_delta_rule": tree_chunk_gated_delta_rule,
    "chunk_kimi_delta_attention": tree_chunk_gated_delta_rule,  # the same rule, a decay per key channel
    "mamba2_chunk_scan": tree_mamba2_chunk_scan,
    "mamba_selective_scan": tree_mamba_selective_scan,
    "mamba2_split_conv1d_scan_combined": _skip_fused,
    "mamba_inner_fn": _skip_fused,
    "causal_conv1d_update": _refuse_cached_step("causal_conv1d_update"),
    "torch_recurrent_gated_delta_rule": _refuse_cached_step("torch_recurrent_gated_delta_rule"),
    "recurrent_kimi_delta_attention": _refuse_cached_step("recurrent_kimi_delta_attention"),
    "mamba2_selective_state_update": _refuse_cached_step("mamba2_selective_state_update"),
    "mamba_selective_state_update": _refuse_cached_step("mamba_selective_state_update"),
}


# Per tree op: its sequence arguments with their sequence dimension, the output's, and whether it returns
# ``(output, None)`` (the delta rule's ``(output, final state)``).
SEQUENCE_DIMS: dict[Callable[..., object], tuple[dict[str, int], int, bool]] = {
    tree_causal_conv1d: ({"hidden_states": 2}, 2, False),
    tree_chunk_gated_delta_rule: ({name: 1 for name in ("query", "key", "value", "g", "beta")}, 1, True),
    tree_mamba2_chunk_scan: ({name: 1 for name in ("hidden_states", "dt", "B", "C")}, 1, False),
    tree_mamba_selective_scan: ({name: 2 for name in ("hidden_states", "dt", "B", "C", "z")}, 2, False),
}


@runtime_checkable
class ShardedRows(Protocol):
    """A scoped attention engine whose rank holds a shard of each row (``hf_tree.parallel``'s context parallel,
    ``ContextParallelAttention``): what the tree mixers need of it to run on the whole row. Declared here, on the
    mixers' floor, so that they find it through ``hf_tree.attention.attention_engine_scope`` without importing
    ``hf_tree.parallel``."""

    def gather_sequence(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slots of ``tensor`` along ``dim`` -> the whole row's (autograd all-gather)."""
        ...

    def local_slots(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole row's ``tensor`` along ``dim`` -> this rank's slots."""
        ...

    def row_kv_end(self, device: torch.device) -> torch.Tensor:
        """``[B, num_slots]`` subtree ends of the whole row on ``device``."""
        ...


def sharded_rows() -> ShardedRows | None:
    """The enclosing scope's engine when it shards rows (tree context parallel), else ``None``."""
    engine = scoped_attention_engine()
    return engine if engine is not None and isinstance(engine, ShardedRows) else None


def context_parallel_tree_op(tree_op: Callable[..., object], context: ShardedRows, args: tuple, kwargs: dict) -> object:
    """``tree_op`` on this rank's shard under hf_tree's context parallel, exactly.

    A token's convolution window and recurrent state come from its ancestors, which may sit on other ranks. The
    op's sequence inputs (``SEQUENCE_DIMS``) are all-gathered into the whole row (an autograd all-gather, as for
    attention's keys and values: its backward reduce-scatters, so each rank receives the gradients every rank's
    outputs sent to its tokens), the op runs on the whole row's topology, and the rank keeps its own slots. The
    op runs under activation checkpointing: per layer autograd keeps the gathered inputs only (``O(N)`` like the
    gathered keys/values). The mixer's compute is repeated on every rank (only attention's is split).
    """
    arguments, output_dim, returns_pair = SEQUENCE_DIMS[tree_op]
    bound = inspect.signature(tree_op).bind_partial(*args, **kwargs)
    names = [name for name in arguments if bound.arguments.get(name) is not None]
    gathered = [context.gather_sequence(bound.arguments[name], arguments[name]) for name in names]
    kv_end = context.row_kv_end(gathered[0].device)

    def whole_row(*tensors: torch.Tensor) -> torch.Tensor:
        bound.arguments.update(zip(names, tensors))
        out = tree_op(*bound.args, **bound.kwargs, topology=tree_topology(kv_end))
        return context.local_slots(out[0] if returns_pair else out, output_dim)

    local = checkpoint(whole_row, *gathered, use_reentrant=False)
    return (local, None) if returns_pair else local


def tree_dispatch(original: Callable[..., object], tree_op: Callable[..., object]) -> Callable[..., object]:
    """``original`` without ``kv_end`` (exactly as before), ``tree_op(..., topology=...)`` with it (on the whole row
    under hf_tree's context parallel, ``context_parallel_tree_op``)."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        kwargs = {**_scoped_keywords.get(), **kwargs}
        kv_end = kwargs.pop("kv_end", None)
        if kv_end is None:
            return original(*args, **kwargs)
        if tree_op not in SEQUENCE_DIMS:  # the fused kernel's switch, the cached steps' refusals: no topology
            return tree_op(*args, **kwargs)
        context = sharded_rows()
        if context is not None:
            return context_parallel_tree_op(tree_op, context, args, kwargs)
        return tree_op(*args, topology=tree_topology(kv_end), **kwargs)

    dispatch.__hf_tree_original__ = original
    return dispatch


def is_tree_dispatch(function: object) -> bool:
    """Whether ``function`` is a ``tree_dispatch`` (a mixer op this module installed)."""
    return hasattr(function, "__hf_tree_original__")


# The keywords a depth-first or packed tree batch hands its layers (``kv_end`` the trie, ``kv_prefix`` the cached
# ancestors of a depth-first unit).
TREE_KEYWORDS = ("kv_end", "kv_prefix")
ATTENTION_KEYWORDS = (*TREE_KEYWORDS, "bidirectional_block")

# Classes whose forward drops the model's keyword arguments instead of passing them on, so kv_end would never reach
# the mixers or tree_flash: class name -> (where they go, keywords handed on). Where: a submodule attribute (each
# module of a ModuleList), or None for the mixer ops the forward calls (``_scoped_keywords``).
# - Mamba2ForCausalLM drops them before its backbone; Nemotron's and StableLM's decoder layers (transformers 5.24)
#   call their attention with named arguments only, so the packed row ran as one causal sequence (siblings leaked:
#   the first-use probe refused both at a difference of 1.08 and 0.64).
# - Mamba and Falcon-Mamba drop them at every level (causal LM, backbone, block), Jamba at its Mamba decoder layer;
#   the Mamba-1 mixers call their scan (and Zamba's its convolution) without them.
KWARG_DROPPING_CLASSES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "Mamba2ForCausalLM": ("backbone", TREE_KEYWORDS),
    "NemotronDecoderLayer": ("self_attn", ATTENTION_KEYWORDS),
    "StableLmDecoderLayer": ("self_attn", ATTENTION_KEYWORDS),
    **{f"{name}ForCausalLM": ("backbone", TREE_KEYWORDS) for name in ("Mamba", "FalconMamba")},
    **{f"{name}Model": ("layers", TREE_KEYWORDS) for name in ("Mamba", "FalconMamba")},
    **{f"{name}Block": ("mixer", TREE_KEYWORDS) for name in ("Mamba", "FalconMamba")},
    "JambaMambaDecoderLayer": ("mamba", TREE_KEYWORDS),
    **{f"{name}Mixer": (None, TREE_KEYWORDS) for name in ("Mamba", "FalconMamba", "JambaMamba", "ZambaMamba")},
}

# The tree keywords of the mixer forward running now, for the ops it calls without them (a context variable: set for
# that forward's duration only, so a checkpointed layer's recompute, which runs the forward again, sets it again).
_scoped_keywords: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "hf_tree_mixer_keywords", default=MappingProxyType({})
)


def pass_tree_keywords(forward: Callable[..., object], submodule: str | None, keywords: tuple[str, ...]) -> Callable:
    """``forward`` of a module that hands ``keywords`` (``kv_end``, ...) on to its ``submodule`` attribute's forward
    (each module's of a ``ModuleList``), or with ``submodule=None`` to the mixer ops it calls; unchanged when none is
    given."""

    @functools.wraps(forward)
    def tree_forward(self, *args, **kwargs):
        given = {name: kwargs.pop(name) for name in keywords if kwargs.get(name) is not None}
        if not given:
            return forward(self, *args, **kwargs)
        if submodule is None:
            token = _scoped_keywords.set(given)
            try:
                return forward(self, *args, **kwargs)
            finally:
                _scoped_keywords.reset(token)

        def add_keywords(_module, module_args, module_kwargs):
            return module_args, module_kwargs | given

        target = getattr(self, submodule)
        targets = list(target) if isinstance(target, torch.nn.ModuleList) else [target]
        with contextlib.ExitStack() as stack:
            for module in targets:
                stack.callback(module.register_forward_pre_hook(add_keywords, with_kwargs=True).remove)
            return forward(self, *args, **kwargs)

    return tree_forward


def _wrap_forward(cls: type, submodule: str | None, keywords: tuple[str, ...]) -> None:
    """``cls.forward = pass_tree_keywords(cls.forward, ...)``. A ``GradientCheckpointingLayer`` checkpoints its forward
    only while that wrapper of transformers is ``cls.forward`` itself: its inner forward is wrapped instead, and the
    wrapper put back around it, so a checkpointed layer stays checkpointed and its recompute hands the keywords on too.
    """
    original = cls.forward
    # transformers 5.x wraps each subclass's forward in __init_subclass__ (earlier releases checkpointed __call__)
    rewrap = GradientCheckpointingLayer.__dict__.get("__init_subclass__")
    if rewrap is not None and issubclass(cls, GradientCheckpointingLayer) and hasattr(original, "__wrapped__"):
        cls.forward = pass_tree_keywords(original.__wrapped__, submodule, keywords)
        rewrap.__func__(cls)  # puts transformers' checkpointing wrapper back around it
    else:
        cls.forward = pass_tree_keywords(original, submodule, keywords)
    cls.forward.__hf_tree_original__ = original


def install_module_mixers(module: ModuleType) -> None:
    """Rebind the mixer ops (``TREE_OPS``) that one modeling module defines, and let its classes pass ``kv_end`` on
    where they drop it (``KWARG_DROPPING_CLASSES``). Idempotent."""
    for op_name, tree_op in TREE_OPS.items():
        original = getattr(module, op_name, None)
        if original is None or is_tree_dispatch(original):
            continue
        setattr(module, op_name, tree_dispatch(original, tree_op))
    for class_name, (submodule, keywords) in KWARG_DROPPING_CLASSES.items():
        cls = getattr(module, class_name, None)
        if cls is not None and not hasattr(cls.forward, "__hf_tree_original__"):
            _wrap_forward(cls, submodule, keywords)


def install_tree_mixers(modules: tuple[str, ...] = TREE_MIXER_MODULES) -> list[str]:
    """Import ``transformers.models.<name>.modeling_<name>`` for each name and rebind its mixer ops; returns the
    modules patched. Idempotent; a module missing from the installed transformers is skipped."""
    patched = []
    for name in modules:
        try:
            module = importlib.import_module(modeling_module(name))
        except ImportError:
            continue
        install_module_mixers(module)
        patched.append(name)
    return patched


def uninstall_tree_mixers(modules: tuple[str, ...] = TREE_MIXER_MODULES) -> None:
    """Restore the original functions (tests use it to compare behaviour before and after installing)."""
    for name in modules:
        try:
            module = importlib.import_module(modeling_module(name))
        except ImportError:
            continue
        for op_name in TREE_OPS:
            current = getattr(module, op_name, None)
            if current is not None and is_tree_dispatch(current):
                setattr(module, op_name, current.__hf_tree_original__)
        for class_name in KWARG_DROPPING_CLASSES:
            cls = getattr(module, class_name, None)
            if cls is not None and hasattr(cls.forward, "__hf_tree_original__"):
                cls.forward = cls.forward.__hf_tree_original__
