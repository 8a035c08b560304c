"""``TreeContextParallel``: tree context parallel configured the accelerate way, for trainers and custom loops.

``ParallelismConfig(cp_size=..., dp_shard_size=...)`` (or ``--parallelism_config_cp_size`` / a config file's
``parallelism_config`` section) builds accelerate's device mesh; its ``"cp"`` dimension is the group a packed
row is sharded over, and FSDP2 shards parameters over ``"dp_shard_cp"`` exactly as accelerate does.
``TreeContextParallel.prepare`` has the contract of ``transformers.Trainer._prepare_context_parallel_inputs``:
it returns a context-manager factory and the rank's inputs. ``skip_accelerate_attention_hooks`` keeps
``accelerator.prepare`` from attaching accelerate's own context-parallel attention hooks to a model that only
hf_tree's tree context parallel drives (the tree trainers call it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_tree.parallel.context import (
    DEFAULT_QUERY_BLOCK_SIZE,
    shard_batch_for_context_parallel,
    tree_context_parallel,
)
from hf_tree.parallel.plan import DEFAULT_CHUNKS_PER_RANK, STRATEGIES, ContextParallelPlan, plan_context_parallel


@dataclass
class ContextParallelConfig:
    """How hf_tree splits packed rows over the context-parallel group (the group itself comes from accelerate).

    Each field's ``metadata`` holds its ``help`` (and ``choices``); ``hf_tree.config.TreeArguments`` derives its
    ``context_parallel_*`` fields from them.
    """

    strategy: str = field(
        default="balanced",
        metadata={
            "help": f"How packed rows are cut into context-parallel shards, one of {STRATEGIES}: 'balanced' (equal "
            "tokens, balanced attention work), 'zigzag', 'contiguous' (equal work, unequal tokens) or 'naive'.",
            "choices": list(STRATEGIES),
        },
    )
    chunks_per_rank: int = field(
        default=DEFAULT_CHUNKS_PER_RANK,
        metadata={
            "help": "Chunks dealt to each context-parallel rank by 'balanced': more chunks balance work more finely."
        },
    )
    query_block_size: int = field(
        default=DEFAULT_QUERY_BLOCK_SIZE,
        metadata={
            "help": "Query rows per attention call on each context-parallel rank; bounds the per-call mask and score "
            "tiles."
        },
    )
    pad_token_id: int = field(
        default=0,
        metadata={
            "help": "Token id of the padding slots that even out shard lengths (never seen by real tokens, never "
            "scored)."
        },
    )

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be one of {STRATEGIES}.")
        for name in ("chunks_per_rank", "query_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")


class TreeContextParallel:
    """Shards packed tree batches over a context-parallel process group and runs the model forward under
    tree context parallel.

    Args:
        group: the CP process group (``None``: the default group, i.e. every process is one CP group).
        config: the sharding options.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, config: ContextParallelConfig | None = None) -> None:
        self.group = group
        self.config = config or ContextParallelConfig()
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @classmethod
    def from_accelerator(cls, accelerator, config: ContextParallelConfig | None = None) -> TreeContextParallel | None:
        """The CP group of accelerate's device mesh, or ``None`` when ``parallelism_config.cp_size`` is 1."""
        parallelism = accelerator.parallelism_config
        if parallelism is None or not parallelism.cp_enabled:
            return None
        return cls(accelerator.torch_device_mesh["cp"].get_group(), config)

    def plan(self, kv_end: torch.Tensor) -> ContextParallelPlan:
        """The shard plan of a batch (``kv_end [B, N]``); identical on every rank of the group."""
        return plan_context_parallel(kv_end, self.size, self.config.strategy, self.config.chunks_per_rank)

    def prepare(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[Callable[[], AbstractContextManager], dict[str, torch.Tensor]]:
        """``(context factory, this rank's batch)`` for a global ``TreeDataCollator`` batch.

        Call the model (loss) on the returned batch inside ``factory()``, backward included, and keep
        ``num_items_in_batch`` the global divisor (every CP rank holds the same global batch, so a sum of
        ``num_loss_items`` over all processes counts each batch ``size`` times).
        """
        plan = self.plan(batch["kv_end"])
        local = shard_batch_for_context_parallel(batch, plan, self.rank, self.config.pad_token_id)
        factory = functools.partial(
            tree_context_parallel, batch, plan, self.rank, self.group, self.config.query_block_size
        )
        return factory, local


def skip_accelerate_attention_hooks(accelerator) -> None:
    """Make ``accelerator.prepare`` (this accelerator only) skip accelerate's context-parallel attention hooks.

    With ``cp_size > 1``, accelerate 1.15's ``Accelerator._prepare_cp`` calls
    ``big_modeling._attach_context_parallel_hooks`` on every prepared module: the hooks drop each ``self_attn``
    layer's mask and force ``is_causal=True`` for torch's ring attention, so it refuses any model with a
    sliding-window or chunked layer (their masks would be lost). hf_tree's tree context parallel never enters
    torch's ring attention (``accelerator.maybe_context_parallel``; refused around a tree forward): every rank
    computes its shard against all keys under the model's own tree mask, windows and chunks in depth and
    softcapping included, and plain forwards (no ``kv_end``) keep the model's own mask. For a model only hf_tree
    drives the hooks are both unneeded and the one obstacle, so this skips them; the rest of ``_prepare_cp`` (the CP
    context accelerate builds for ``maybe_context_parallel``) still runs. Other accelerators, and modules prepared
    elsewhere, keep accelerate's hooks and its refusal.

    Raises:
        ValueError: when the installed accelerate has no ``Accelerator._prepare_cp`` (the hook attachment moved:
            this function must be updated rather than silently leave the hooks on).
    """
    original = getattr(accelerator, "_prepare_cp", None)
    if original is None:
        raise ValueError(
            f"this accelerate ({type(accelerator).__module__}) has no Accelerator._prepare_cp, where hf_tree skips "
            "accelerate's context-parallel attention hooks for tree models. Use the accelerate version hf_tree was "
            "tested with (1.15) or update hf_tree.parallel.integration.skip_accelerate_attention_hooks."
        )
    if getattr(original, "__hf_tree_skips_hooks__", False):
        return

    def prepare_cp(*args: object) -> Sequence[object]:
        original(*(arg for arg in args if not isinstance(arg, torch.nn.Module)))  # the hooks go on modules only
        return args

    prepare_cp.__hf_tree_skips_hooks__ = True
    accelerator._prepare_cp = prepare_cp
