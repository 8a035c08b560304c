"""Let an accelerate FSDP2 config take effect on CPU, so CI runs the exact sharded path users run on GPUs.

accelerate never selects FSDP when processes run on CPU. Two things go wrong on a machine without an
accelerator under ``accelerate launch --config_file fsdp2_*.json``: (1) unless told ``ACCELERATE_USE_CPU``
(whose ``--cpu`` flag the launcher refuses next to FSDP) every process sets itself up as a single,
non-distributed run, silently training alone; (2) with it, ``AcceleratorState`` keeps ``MULTI_CPU`` (plain
DDP) and drops the FSDP plugin, since it enables FSDP only for GPU-like distributed types. torch's
``fully_shard`` itself works on CPU with gloo.

``enable_fsdp2_on_cpu`` fixes both, only for a launched FSDP2 run on a machine with no accelerator: it sets
``ACCELERATE_USE_CPU`` (before ``TrainingArguments`` creates the process state: ``TreeArguments`` calls it
first) and wraps ``AcceleratorState.__init__`` to finish the FSDP set-up accelerate does on GPUs (distributed
type, plugin, mixed precision), with a warning. Nothing changes otherwise.

``local_depth_first_model`` lets each rank run its depth-first units (``hf_tree.depth_first``) without collectives
under DDP or FSDP2 (docs/depth_first.md, "Several processes").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import accelerate
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

from hf_tree.versions import TESTED_ACCELERATE, is_tested

logger = logging.getLogger("hf_tree")


def _finish_fsdp2_setup(state: AcceleratorState, fsdp_plugin) -> None:
    """What ``AcceleratorState.__init__`` does for FSDP on GPU-like devices, applied to a ``MULTI_CPU`` state."""
    state.distributed_type = DistributedType.FSDP
    if getattr(state, "fsdp_plugin", None) is fsdp_plugin:
        return
    if state._mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    logger.warning(
        "hf_tree: accelerate would run this FSDP2 config as plain DDP on CPU (MULTI_CPU); FSDP2 is enabled on "
        "CPU (gloo) instead, so this run exercises the same sharded code path as on GPUs. CPU FSDP is for "
        "tests and CI, not for speed."
    )


def _wrap_init(init):
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Every later ``AcceleratorState()`` re-copies the process state (MULTI_CPU) over the distributed type,
        # so the adjustment is re-applied whenever an FSDP2 plugin is (or was) set.
        fsdp_plugin = kwargs.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None)
        if (
            fsdp_plugin is not None
            and getattr(fsdp_plugin, "fsdp_version", 1) == 2
            and self.distributed_type == DistributedType.MULTI_CPU
        ):
            _finish_fsdp2_setup(self, fsdp_plugin)

    wrapper.__hf_tree_patched__ = True
    return wrapper


def launched_fsdp2_without_accelerator() -> bool:
    """Whether this process was started by ``accelerate launch`` with an FSDP2 config and sees no accelerator."""
    return (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        and os.environ.get("FSDP_VERSION") == "2"
        and int(os.environ.get("LOCAL_RANK", -1)) != -1
        and not torch.accelerator.is_available()
    )


def enable_fsdp2_on_cpu() -> bool:
    """Idempotent: install the adjustment (before ``TrainingArguments`` and the ``Accelerator`` are created).

    Returns whether it is installed. Outside the tested accelerate versions it installs nothing and warns, so
    an FSDP2 config on CPU then runs as accelerate decides.
    """
    # TESTED_ACCELERATE: the versions whose AcceleratorState set-up this adjustment was read from.
    version = accelerate.__version__
    if not is_tested(version, TESTED_ACCELERATE):
        logger.warning(
            "hf_tree: FSDP2-on-CPU support was tested with accelerate in [%s, %s), found %s; not enabling it (an "
            "FSDP config on CPU will run as DDP).",
            *TESTED_ACCELERATE,
            version,
        )
        return False
    if launched_fsdp2_without_accelerator():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # gloo process group instead of one run per process
    if not getattr(AcceleratorState.__init__, "__hf_tree_patched__", False):
        AcceleratorState.__init__ = _wrap_init(AcceleratorState.__init__)
    return True


# Multi-process accelerate types that wrap the model in DDP (local_depth_first_model supports them and FSDP2).
DATA_PARALLEL_TYPES = frozenset(
    getattr(DistributedType, name)
    for name in (
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_XPU",
        "MULTI_HPU",
    )
    if hasattr(DistributedType, name)
)


def unsupported_process_layout(accelerator: accelerate.Accelerator) -> str | None:
    """Why several processes cannot run ``local_depth_first_model`` (depth-first units, shared prompts), or ``None``
    where they can: one process, DDP, or FSDP2 without replicated shards or tensor parallel. DeepSpeed is left to
    the callers, which name it with their own reason."""
    distributed_type = accelerator.distributed_type
    data_parallel = distributed_type in DATA_PARALLEL_TYPES or (
        distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
    )
    if accelerator.num_processes > 1 and not data_parallel and distributed_type != DistributedType.DEEPSPEED:
        return f"{accelerator.num_processes} processes under {distributed_type} (DDP and FSDP2 are supported)"
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and (parallelism.dp_replicate_size > 1 or parallelism.tp_size > 1):
        return "FSDP2 with replicated shards (HSDP, dp_replicate_size > 1) or tensor parallel (untested)"
    return None


@contextlib.contextmanager
def local_depth_first_model(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The module to run depth-first units on under several processes: forwards and backwards on it issue no
    collective, so each rank runs as many units as its own trees need; their gradients accumulate locally, unreduced.

    The caller then runs one synchronizing forward and backward on every rank (``TreeTrainerMixin``: the packed rows,
    a placeholder row of zero loss when the micro-batch has none), which reduces the accumulated gradients with its
    own, as DDP's ``no_sync`` and FSDP2's ``set_requires_gradient_sync(False)`` accumulate micro-batches.

    - DDP: the wrapped module (``model.module``): no buffer broadcast, and the reducer ignores backwards of
      forwards it did not run.
    - FSDP2: collective on entry and exit. Every FSDP module is unsharded (all-gathered) on entry and resharded on
      exit; inside, resharding after forward and backward and gradient reduction are off, so FSDP's hooks find their
      parameters unsharded and neither all-gather nor reduce-scatter, however many forwards precede a backward. The
      unsharded gradients stay on the unsharded parameters until the next backward with gradient sync on
      reduce-scatters them. Root parameters (embeddings, a tied or separate head) are plain tensors inside, so the
      head may be read outside module forwards. Memory: the full parameters (and gradients) during the units.
    - Otherwise (one process): ``model`` itself.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        yield model.module
        return
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not modules:
        yield model
        return
    modules[0]._get_fsdp_state()._lazy_init()  # the root's settings as its first forward leaves them
    states = [module._get_fsdp_state() for module in modules]
    groups = [group for state in states for group in state._fsdp_param_groups]
    saved_states = [state._auto_reshard_after_forward for state in states]
    saved_groups = [
        (group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads, group.all_reduce_grads)
        for group in groups
    ]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        for module in modules:  # the same order on every rank
            module.unshard()
        yield model
    finally:
        for state, auto in zip(states, saved_states):
            state._auto_reshard_after_forward = auto
        for group, (mesh_info, after_backward, reduce_grads, all_reduce_grads) in zip(groups, saved_groups):
            group.post_forward_mesh_info = mesh_info
            group.reshard_after_backward = after_backward
            group.reduce_grads = reduce_grads
            group.all_reduce_grads = all_reduce_grads
        for module in modules:
            module.reshard()
