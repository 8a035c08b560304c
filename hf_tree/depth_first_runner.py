"""``DepthFirstRunner``: depth-first execution (``hf_tree.depth_first``) inside a training loop, on one process or
several.

One object holds what a trainer needs beyond the executor itself:

- **planning**: whether this setup can run depth-first at all, decided before the first step (``plan``: process layout,
  context parallel, DeepSpeed, fp16, reentrant checkpointing, the model's refusals and its depth-first probe); where it
  cannot, ``tree_execution="auto"`` packs (``hf_tree.packing.packed_fallback``) and ``"depth_first"`` is refused;
- **running**: one micro-batch's trees beside Trainer's step on its packed rows (``training_step``,
  ``evaluation_loss``), with the step's divisor, and the figures that depend on it (``rows_run``,
  ``forwarded_tokens``);
- **several processes** (DDP, FSDP2): the layouts that can run units carrying prefix state (``process_obstacle``),
  and the module to run them on without collectives (``local_model``).

``TreeTrainerMixin`` holds one (``tree_depth_first``; ``None`` when trees run packed). The shared prompt pieces of
``hf_tree.trl.shared_prompts`` are such units too and use its process and model checks (``process_obstacle``,
``refuse_model``, ``check_model``, ``local_model``). docs/depth_first.md, "Several processes", says why the order of
the two parts of a micro-batch differs between one process and several.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType
from transformers import PreTrainedModel, TrainingArguments

from hf_tree.depth_first import DepthFirstConfig, check_depth_first, depth_first_backward, refuse_for_depth_first
from hf_tree.models.check import check_model_for_trees, self_check_enabled
from hf_tree.models.head import LogitHead
from hf_tree.models.introspection import causal_lm_of
from hf_tree.packing import DEPTH_FIRST_KEY, Normalization, packed_fallback
from hf_tree.tree import Tree

# Multi-process accelerate types that wrap the model in DDP (``local_model`` supports them and FSDP2).
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


class DepthFirstRunner:
    """Depth-first execution of the trees a collator leaves whole (batch key ``depth_first_trees``) on one
    ``accelerate.Accelerator``'s processes.

    Args:
        accelerator: the trainer's accelerator (its process count and distributed type).
        self_check: the ``self_check`` of the tree loss (``None``: ``HF_TREE_SELF_CHECK``).
        config: the unit size (the trainers use ``max_packed_tokens``; the shared prompt pieces plan no units).
        normalization, token_loss: the loss weights and per-token loss, as in ``tree_causal_lm_loss``.
    """

    def __init__(
        self,
        accelerator: accelerate.Accelerator,
        self_check: bool | None,
        config: DepthFirstConfig | None = None,
        normalization: Normalization = "token",
        token_loss: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.self_check = self_check
        self.config = config or DepthFirstConfig()
        self.normalization = normalization
        self.token_loss = token_loss

    # ------------------------------------------------------------------------------------------ planning
    @classmethod
    def plan(
        cls,
        collator: Any,
        model: torch.nn.Module,
        accelerator: accelerate.Accelerator,
        args: TrainingArguments,
        *,
        context_parallel: bool,
        self_check: bool | None,
        token_loss: Callable[..., torch.Tensor] | None,
    ) -> DepthFirstRunner | None:
        """The runner of the collator's ``tree_execution`` (``None`` when trees run packed), decided before the first
        step (the depth-first self-check probe included). Where this setup cannot run depth-first, ``"auto"`` sets the
        collator's packing to ``packed_fallback`` (one log line naming why) and returns ``None``.

        Raises:
            ValueError: naming ``tree_execution``, the reason and the fix, for ``"depth_first"`` on several processes
                other than DDP or FSDP2 (FSDP1, HSDP, tensor parallel, ...), under context parallel or DeepSpeed, with
                fp16 loss scaling, reentrant gradient checkpointing or an MoE router loss, or for a model whose
                depth-first probe differs from its packed pass.
        """
        packing = getattr(collator, "packing", None)
        if packing is None or packing.tree_execution == "packed":
            return None
        config = DepthFirstConfig(max_unit_tokens=packing.max_packed_tokens)
        runner = cls(accelerator, self_check, config, packing.normalization, token_loss)
        why = runner.training_obstacle(model, args, context_parallel)
        if why is None:
            return runner
        if packing.tree_execution == "auto":
            collator.packing = packed_fallback(packing, why)
            return None
        raise ValueError(
            f"tree_execution={packing.tree_execution!r} cannot run here: {why}. Set tree_execution='packed' or 'auto' "
            "(trees larger than max_packed_tokens are then split by their branches), or train with DDP/FSDP2 or on "
            "one process (bf16 or float32)."
        )

    def training_obstacle(self, model: torch.nn.Module, args: TrainingArguments, context_parallel: bool) -> str | None:
        """Why this training setup cannot run depth-first execution, or ``None`` when it can (one process, DDP or
        FSDP2, without loss scaling, context parallel, reentrant checkpointing or an MoE router loss, and a model that
        passes the depth-first probe)."""
        layout = self.process_obstacle()
        if layout is not None:
            return layout
        checkpointing = args.gradient_checkpointing_kwargs or {}
        unsupported = {
            "context parallel": context_parallel,
            "fp16 (loss scaling)": args.fp16,
            # reentrant checkpointing would drop the gradient of the cached keys and values
            f"gradient_checkpointing_kwargs={checkpointing} (reentrant; set {{'use_reentrant': False}})": (
                args.gradient_checkpointing and checkpointing.get("use_reentrant", False)
            ),
        }
        for what, present in unsupported.items():
            if present:
                return what
        try:
            self.refuse_model(causal_lm_of(model))
        except ValueError as error:  # a model depth-first units would train wrongly (MoE router loss, ...)
            return str(error)
        return self._probe_failure(model)

    def _probe_failure(self, model: torch.nn.Module) -> str | None:
        """The depth-first self-check probe (``hf_tree.depth_first.probe_depth_first``), run now rather than at the
        first tree larger than a row, so that ``"auto"`` decides (and ``"depth_first"`` refuses) before the first
        step: why it failed, or ``None``. Skipped with the self-check off, and under FSDP, whose ranks may hold no
        weights before the first step (the probe then runs at the first depth-first tree, on every rank). A model the
        packed self-check refuses is left to that check, which refuses it at its first batch whatever the execution."""
        if not self_check_enabled(self.self_check) or self.accelerator.distributed_type == DistributedType.FSDP:
            return None
        try:
            logit_head = check_model_for_trees(model, self.self_check)
        except ValueError:
            return None
        try:
            self.check_model(model, causal_lm_of(model), logit_head)
        except ValueError as error:
            return str(error)
        return None

    def process_obstacle(self) -> str | None:
        """Why these processes cannot run units carrying prefix state (``local_model``), or ``None`` where they can:
        one process, DDP, or FSDP2 without replicated shards or tensor parallel; never under DeepSpeed, whose engine
        owns the backward."""
        accelerator = self.accelerator
        distributed_type = accelerator.distributed_type
        if distributed_type == DistributedType.DEEPSPEED:
            return "DeepSpeed (its engine owns the backward)"
        data_parallel = distributed_type in DATA_PARALLEL_TYPES or (
            distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
        )
        if accelerator.num_processes > 1 and not data_parallel:
            return f"{accelerator.num_processes} processes under {distributed_type} (DDP and FSDP2 are supported)"
        parallelism = getattr(accelerator, "parallelism_config", None)
        if parallelism is not None and (parallelism.dp_replicate_size > 1 or parallelism.tp_size > 1):
            return "FSDP2 with replicated shards (HSDP, dp_replicate_size > 1) or tensor parallel (untested)"
        return None

    @staticmethod
    def refuse_model(causal_lm: PreTrainedModel) -> None:
        """``ValueError`` for models whose units would train wrongly (``hf_tree.depth_first.refuse_for_depth_first``:
        an MoE router loss, reentrant gradient checkpointing)."""
        refuse_for_depth_first(causal_lm)

    def check_model(self, model: torch.nn.Module, causal_lm: PreTrainedModel, logit_head: LogitHead) -> None:
        """``refuse_model``, then (with the self-check on, once per model) the depth-first probe
        (``hf_tree.depth_first.check_depth_first``)."""
        check_depth_first(model, causal_lm, logit_head, self.self_check)

    # ------------------------------------------------------------------------------------------ running
    @property
    def several_processes(self) -> bool:
        """Whether the units run on several processes (each rank its own trees, ``local_model``)."""
        return self.accelerator.num_processes > 1

    def rows_run(self, batch: dict[str, Any]) -> bool:
        """Whether the packed rows of a training batch are forwarded: not the placeholder row of a batch whose trees
        all run depth-first, on one process (several run it: it is the synchronizing backward)."""
        all_depth_first = bool(batch.get(DEPTH_FIRST_KEY)) and not len(batch["loss_positions"])
        return not all_depth_first or self.several_processes

    def training_step(
        self,
        model: torch.nn.Module,
        trees: Sequence[Tree],
        num_items_in_batch: torch.Tensor | float | None,
        packed_step: Callable[[], torch.Tensor] | None,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> torch.Tensor:
        """One micro-batch: Trainer's step on its packed rows (``packed_step``; ``None`` where ``rows_run`` says they
        are not forwarded) and the units of its depth-first ``trees``, which run their own backward under
        ``autocast()``. Returns the sum of both losses (the units' detached).

        On one process the rows run first. On several (DDP, FSDP2) this rank's units run first, alone, on
        ``local_model`` (no collective, however many units each rank has; their gradients accumulate unreduced); then
        the rows on every rank, the placeholder row of an all-depth-first micro-batch included (zero loss): the
        micro-batch's one synchronizing backward, which under Trainer's gradient accumulation (``no_sync`` but for the
        step's last micro-batch) reduces everything the step accumulated, as for packed rows alone. The units are then
        divided by the step's global divisor times the number of processes, as Trainer's loss is, since DDP and FSDP2
        average gradients over ranks."""
        if self.several_processes:
            assert packed_step is not None, "several processes always forward the packed rows"
            depth_first = None
            if self._on_any_rank(trees):
                divisor = None if num_items_in_batch is None else num_items_in_batch / self.accelerator.num_processes
                with self.local_model(model) as local:
                    # the first-use self-check forwards the model: inside, on every rank, or a rank without trees
                    # would run it in the packed step below, all-gathering alone
                    check_model_for_trees(local, self.self_check)
                    if trees:
                        local.train()
                        with autocast():
                            depth_first = self.backward(local, trees, divisor)
            loss = packed_step()
            return loss if depth_first is None else loss + depth_first.to(loss)
        if not trees:
            return packed_step()
        loss = packed_step() if packed_step is not None else None
        model.train()
        with autocast():
            depth_first = self.backward(model, trees, num_items_in_batch)
        return depth_first if loss is None else loss + depth_first.to(loss)

    def evaluation_loss(self, model: torch.nn.Module, trees: Sequence[Tree]) -> torch.Tensor | None:
        """The summed weighted loss of ``trees`` (divisor 1; under ``torch.no_grad``, so no backward runs), or
        ``None`` when this rank has none. Under several processes every rank calls it (FSDP2's unshard is
        collective), as in training."""
        if not self.several_processes:
            return self.backward(model, trees, 1.0) if trees else None
        if not self._on_any_rank(trees):
            return None
        with self.local_model(model) as local:
            check_model_for_trees(local, self.self_check)  # every rank (see training_step)
            return self.backward(local, trees, 1.0) if trees else None

    def forwarded_tokens(self, trees: Sequence[Tree]) -> int:
        """Tokens the units of ``trees`` forward (each tree's once: units carry no padding), summed over the ranks
        under several processes (every rank calls it)."""
        tokens = sum(tree.num_tokens for tree in trees)
        if self.several_processes:
            tokens = int(self.accelerator.gather(torch.tensor(tokens, device=self.accelerator.device)).sum())
        return tokens

    def backward(
        self, model: torch.nn.Module, trees: Sequence[Tree], num_items_in_batch: torch.Tensor | float | None
    ) -> torch.Tensor:
        """``depth_first_backward`` of ``trees`` with this runner's options (``num_items_in_batch``: the divisor)."""
        return depth_first_backward(
            model,
            trees,
            self.config,
            self.normalization,
            num_items_in_batch=num_items_in_batch,
            token_loss=self.token_loss,
            self_check=self.self_check,
        )

    def _on_any_rank(self, trees: Sequence[Tree]) -> bool:
        """Whether some rank runs depth-first trees in this micro-batch. Under FSDP2 every rank must then enter
        ``local_model`` (a collective unshard): one all-reduce of a flag; under DDP a rank's own trees."""
        if not (self.accelerator.distributed_type == DistributedType.FSDP and self.accelerator.is_fsdp2):
            return bool(trees)
        flag = torch.tensor(float(bool(trees)), device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum") > 0)

    # ------------------------------------------------------------------------------------------ several processes
    @staticmethod
    @contextlib.contextmanager
    def local_model(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The module to run units on under several processes: forwards and backwards on it issue no collective, so
        each rank runs as many units as its own trees need; their gradients accumulate locally, unreduced.

        The caller then runs one synchronizing forward and backward on every rank (``training_step``: the packed
        rows, a placeholder row of zero loss when the micro-batch has none), which reduces the accumulated gradients
        with its own, as DDP's ``no_sync`` and FSDP2's ``set_requires_gradient_sync(False)`` accumulate micro-batches.

        - DDP: the wrapped module (``model.module``): no buffer broadcast, and the reducer ignores backwards of
          forwards it did not run.
        - FSDP2: collective on entry and exit. Every FSDP module is unsharded (all-gathered) on entry and resharded on
          exit; inside, resharding after forward and backward and gradient reduction are off, so FSDP's hooks find
          their parameters unsharded and neither all-gather nor reduce-scatter, however many forwards precede a
          backward. The unsharded gradients stay on the unsharded parameters until the next backward with gradient
          sync on reduce-scatters them. Root parameters (embeddings, a tied or separate head) are plain tensors
          inside, so the head may be read outside module forwards. Memory: the full parameters (and gradients) during
          the units.
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
