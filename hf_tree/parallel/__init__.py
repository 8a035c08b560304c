"""Tree-aware context parallel: shard long packed rows over ranks with the tree mask kept exact.

See docs/context_parallel.md. ``TreeContextParallel`` (accelerate's ``"cp"`` mesh group) is the trainer-facing
entry; ``plan_context_parallel`` + ``shard_batch_for_context_parallel`` + ``tree_context_parallel`` are the
pieces it is made of, usable in custom loops.
"""

from hf_tree.parallel.context import (
    ContextParallelAttention,
    active_context_parallel,
    refuse_torch_context_parallel,
    shard_batch_for_context_parallel,
    tree_context_parallel,
)
from hf_tree.parallel.integration import ContextParallelConfig, TreeContextParallel, skip_accelerate_attention_hooks
from hf_tree.parallel.plan import (
    STRATEGIES,
    ContextParallelPlan,
    plan_context_parallel,
    visible_keys_per_query,
)

__all__ = [
    "STRATEGIES",
    "ContextParallelAttention",
    "ContextParallelConfig",
    "ContextParallelPlan",
    "TreeContextParallel",
    "active_context_parallel",
    "plan_context_parallel",
    "refuse_torch_context_parallel",
    "shard_batch_for_context_parallel",
    "skip_accelerate_attention_hooks",
    "tree_context_parallel",
    "visible_keys_per_query",
]
