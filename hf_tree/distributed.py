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
"""

from __future__ import annotations

import functools
import logging
import os

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
