"""The refusal of torch's own context parallel around a tree forward (it would shard the row and force a
causal mask). It lives with the attention entry point that calls it; ``hf_tree.parallel`` re-exports it."""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F


def _torch_context_parallel_active() -> bool:
    """Whether torch's own context parallel (``accelerator.maybe_context_parallel`` / ``context_parallel``) is
    on: it swaps ``F.scaled_dot_product_attention`` for its ring version and records the swap in the private
    ``_replaced_functions`` of the module defining the public ``context_parallel`` (found through the function
    itself, wherever torch keeps it). Nothing is imported when torch's context parallel was never imported.

    Raises:
        ValueError: the installed torch no longer keeps that record (the refusal cannot see torch's context
            parallel any more and must not pass silently).
    """
    experimental = sys.modules.get("torch.distributed.tensor.experimental")
    if experimental is None:
        return False
    context_parallel = getattr(experimental, "context_parallel", None)
    namespace = getattr(inspect.unwrap(context_parallel), "__globals__", {}) if context_parallel else {}
    replaced = namespace.get("_replaced_functions")
    if not isinstance(replaced, dict):
        raise ValueError(
            f"torch {torch.__version__} no longer records its context parallel's swap of "
            "F.scaled_dot_product_attention in _replaced_functions next to "
            "torch.distributed.tensor.experimental.context_parallel, so hf_tree cannot check that it is off "
            "during a tree forward (it would break the tree mask). Use the torch version hf_tree was tested "
            "with (2.13) or update hf_tree.attention.torch_cp._torch_context_parallel_active."
        )
    return F.scaled_dot_product_attention in replaced


def refuse_torch_context_parallel() -> None:
    """``ValueError`` when torch's/accelerate's context parallel is active around a tree forward: it shards
    the row and forces a causal mask, so sibling branches would silently see each other."""
    if _torch_context_parallel_active():
        raise ValueError(
            "accelerate's context parallel (accelerator.maybe_context_parallel, i.e. torch's context_parallel) is "
            "active during a tree_flash forward with kv_end. It shards the row evenly and forces a causal mask, "
            "which breaks the tree mask (sibling branches would see each other). Do not enter "
            "accelerator.maybe_context_parallel for tree batches; keep ParallelismConfig(cp_size=...) and use "
            "hf_tree's tree context parallel instead (hf_tree.parallel.TreeContextParallel; see "
            "docs/context_parallel.md)."
        )
