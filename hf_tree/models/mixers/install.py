"""Plug the tree-aware mixer ops into transformers' hybrid models (``import hf_tree`` does it for each covered
modeling module as it is imported; idempotent).

The mixers of these models call module-level functions that transformers lets kernels replace
(``use_kernel_func_from_hub_with_fallback``) and pass them the model's keyword arguments, ``kv_end`` included.
Each such name in each modeling module is rebound to a dispatcher: with ``kv_end`` (a packed tree batch) it runs
the tree-aware op, without it the original function, so generation and ordinary batches are unchanged.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from hf_tree.models.hybrid_modules import TREE_MIXER_MODULES, modeling_module
from hf_tree.models.mixers.conv import tree_causal_conv1d
from hf_tree.models.mixers.delta_rule import tree_chunk_gated_delta_rule
from hf_tree.models.mixers.ssd import tree_mamba2_chunk_scan
from hf_tree.models.mixers.topology import tree_topology
from hf_tree.parallel.context import active_context_parallel


def _skip_fused(*args, **kwargs) -> None:
    """Tree mode of ``mamba2_split_conv1d_scan_combined``: ``None`` makes the mixer take its unfused path, whose
    convolution and scan are tree-aware."""
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
    "mamba2_chunk_scan": tree_mamba2_chunk_scan,
    "mamba2_split_conv1d_scan_combined": _skip_fused,
    "causal_conv1d_update": _refuse_cached_step("causal_conv1d_update"),
    "torch_recurrent_gated_delta_rule": _refuse_cached_step("torch_recurrent_gated_delta_rule"),
    "mamba2_selective_state_update": _refuse_cached_step("mamba2_selective_state_update"),
}


# Why the tree mixers refuse hf_tree's context parallel (docs/hybrids.md, docs/context_parallel.md).
CONTEXT_PARALLEL_REFUSAL = (
    "hf_tree context parallelism shards the packed row over ranks, but a tree mixer reads its ancestors across the "
    "cut: the short convolution needs the inputs of the tokens before it on its branch, and a GatedDeltaNet/Mamba2 "
    "scan starts each segment from its parent's final state, which may live on another rank. Carrying those inputs "
    "and states (and their gradients) between ranks is not built, so a shard would restart them from zero and train "
    "wrongly. Train hybrid models (Qwen3.5, Qwen3-Next, LFM2, Bamba, Nemotron-H, Granite-4, Falcon-H1, Zamba2, "
    "Mamba2) with parallelism_config cp_size=1 (data parallel or FSDP2 sharding still apply)."
)
# The sequence-mixing ops of TREE_OPS (the others are the cached decoding steps and the fused kernel's switch).
MIXER_OPS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", "mamba2_chunk_scan")


def refuse_tree_mixers_under_context_parallel(model: torch.nn.Module) -> None:
    """``ValueError`` naming the tree mixers of ``model`` (any module of a ``TREE_MIXER_MODULES`` modeling module
    that defines a ``MIXER_OPS`` op), for a trainer about to run hf_tree's context parallel; a model without them
    passes. Called before the first step, so a hybrid is refused with the reason rather than at its first forward
    (or by accelerate's generic "layers of type ['linear_attention']")."""
    mixers = {
        f"{name}.{op}"
        for name in TREE_MIXER_MODULES
        if modeling_module(name) in {type(module).__module__ for module in model.modules()}
        for op in MIXER_OPS
        if hasattr(importlib.import_module(modeling_module(name)), op)
    }
    if mixers:
        raise ValueError(
            f"parallelism_config cp_size>1 with {type(model).__name__}, whose tree mixers {sorted(mixers)} cannot run "
            f"under context parallel: {CONTEXT_PARALLEL_REFUSAL}"
        )


def tree_dispatch(original: Callable[..., object], tree_op: Callable[..., object]) -> Callable[..., object]:
    """``original`` without ``kv_end`` (exactly as before), ``tree_op(..., topology=...)`` with it."""

    @functools.wraps(original)
    def dispatch(*args, kv_end: torch.Tensor | None = None, **kwargs):
        if kv_end is None:
            return original(*args, **kwargs)
        if active_context_parallel() is not None:
            raise ValueError(f"{original.__name__}: {CONTEXT_PARALLEL_REFUSAL}")
        return tree_op(*args, topology=tree_topology(kv_end), **kwargs)

    dispatch.__hf_tree_original__ = original
    return dispatch


def install_module_mixers(module: ModuleType) -> None:
    """Rebind the mixer ops (``TREE_OPS``) that one modeling module defines. Idempotent."""
    for op_name, tree_op in TREE_OPS.items():
        original = getattr(module, op_name, None)
        if original is None or hasattr(original, "__hf_tree_original__"):
            continue
        setattr(module, op_name, tree_dispatch(original, tree_op))


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
            if current is not None and hasattr(current, "__hf_tree_original__"):
                setattr(module, op_name, current.__hf_tree_original__)
