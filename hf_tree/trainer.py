"""``TreeTrainer``: a ``transformers.Trainer`` that trains on tree rows with the exact tree loss.

What changes against ``Trainer`` (and, through ``TreeTrainerMixin``, against ``trl.SFTTrainer``):

- batches come from ``TreeDataCollator`` (built from the tree fields of the arguments);
- the loss is ``tree_causal_lm_loss`` divided by the sum of ``num_loss_items`` over every micro-batch of the
  optimizer step on every data-parallel rank (one all-reduce per step), so N accumulated micro-batches on R
  ranks give the update of one batch of N * R micro-batches;
- evaluation uses the same loss, summed over the whole evaluation set before dividing;
- trees larger than a row run depth-first (``tree_execution``) beside the packed rows, by the trainer's
  ``hf_tree.depth_first_runner.DepthFirstRunner`` (``tree_depth_first``), with the same divisor;
- image batches (``hf_tree.vision.MediaTreeCollator``) reach the model with the inputs their module registers
  (``hf_tree.batch_inputs``): this module imports no vision code;
- an MoE model's router load-balancing loss (``output_router_logits`` with a non-zero ``router_aux_loss_coef``) is
  added per micro-batch as the model's own forward adds it, each packed token weighted by the branches that contain
  it (``hf_tree.models.router_loss``); evaluation reports the token loss only;
- ``label_smoothing_factor`` applies as Trainer's ``LabelSmoother`` does on the branches; ``TrainingArguments`` fields
  tree batches cannot honour are refused or warned about (``hf_tree.training_arguments``, docs/training.md);
- with ``parallelism_config.cp_size > 1`` each training batch is sharded over the CP group by
  ``hf_tree.parallel.TreeContextParallel`` (tree-exact for full-attention, windowed, softcapped and hybrid models;
  accelerate's own causal-only context parallel and its attention hooks are not used);
- training logs add trees and rows per step, dedup ratio, padding fraction and tree/branch tokens per second;
- under FSDP2, ``save_model`` writes the complete model or adapter with any ``fsdp_state_dict_type``
  (``hf_tree.saving.FSDPFullSaveMixin``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_utils import EvalLoopOutput

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.batch_inputs import batch_model_inputs
from hf_tree.collator import STATS_KEYS, pop_packing_stats
from hf_tree.config import TreeArguments
from hf_tree.dataset_drops import check_dataset_drops
from hf_tree.depth_first_runner import DepthFirstRunner
from hf_tree.distributed import enable_fsdp2_on_cpu
from hf_tree.loss import TreeLosses, tree_losses
from hf_tree.models.check import (
    refuse_not_tree_aware,
    self_check_setting,
)
from hf_tree.models.check_guard import keep_training_kernels
from hf_tree.models.introspection import causal_lm_of
from hf_tree.models.length_rope import check_dataset_rope_lengths, check_rope_lengths
from hf_tree.models.quantization import log_quantized_base
from hf_tree.models.router_loss import router_aux_loss_coef
from hf_tree.packing import DEPTH_FIRST_KEY, PackingStats
from hf_tree.parallel.integration import ContextParallelConfig, TreeContextParallel, skip_accelerate_attention_hooks
from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.sft_losses import sft_token_loss
from hf_tree.training_arguments import check_length_column, check_tree_trainer_arguments, refuse_metrics_callables

logger = logging.getLogger("hf_tree")

# Per-step sums taken from each batch, all-reduced together with the loss divisor (index 0).
STEP_SUM_KEYS = ("num_loss_items", "num_rows", *STATS_KEYS)
# Counts of branches packing changed or left out: reported as running totals, never silently lost.
LOSS_OF_DATA_KEYS = ("num_truncated_branches", "num_dropped_branches", "num_dropped_trees")


@dataclass
class TreeTrainingArguments(TreeArguments, TrainingArguments):
    """``TrainingArguments`` plus the tree fields of ``hf_tree.config.TreeArguments``."""


def use_tree_attention(model: torch.nn.Module, name: str = "model") -> None:
    """Switch a causal LM (or the base model of a PEFT model) to ``attn_implementation="tree_flash"``.

    Without ``kv_end`` the tree attention is exactly SDPA, so generation and plain batches are unchanged. A model on
    another implementation (``sdpa``, ``eager``, ...) is switched with one warning.

    Raises:
        ValueError: when ``model`` is not a transformers ``PreTrainedModel`` (optionally PEFT-wrapped), is of a
            family refused by name (``hf_tree.models.check.refuse_not_tree_aware``), or when transformers refuses the
            switch for this model class.
    """
    base = causal_lm_of(model)
    if not isinstance(base, PreTrainedModel):
        raise ValueError(
            f"{name} is a {type(base).__name__}; tree training needs a transformers PreTrainedModel (causal LM), "
            "optionally wrapped by PEFT."
        )
    current = base.config._attn_implementation
    if current == TREE_ATTENTION_NAME:
        return
    refuse_not_tree_aware(base)  # a family refused by name says why now, not "load it with tree_flash" at batch one
    try:
        base.set_attn_implementation(TREE_ATTENTION_NAME)
    except (ValueError, ImportError, NotImplementedError) as error:
        raise ValueError(
            f"{name} ({type(base).__name__}) uses attn_implementation={current!r} and cannot be switched to "
            f"{TREE_ATTENTION_NAME!r}: {error}. Tree training needs a model whose attention transformers can swap."
        ) from error
    if not base._supports_attention_backend:  # no attention through transformers' interface (Mamba, RWKV, Bloom):
        return  # a "switched attention" line would mislead; the model checks say what such a model can do
    logger.warning(
        "hf_tree: switched %s from attn_implementation=%r to %r (packed trees need it; without kv_end it is exactly "
        "SDPA).",
        name,
        current,
        TREE_ATTENTION_NAME,
    )


def tree_model_init_kwargs(model_init_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``model_init_kwargs`` for a model loaded by name, with ``attn_implementation="tree_flash"``.

    ``None`` or unset (TRL's scripts pass ``None`` unless ``--attn_implementation`` is given) becomes
    ``tree_flash`` silently; any other name is replaced with one warning, as ``use_tree_attention`` switches a model
    instance.
    """
    init_kwargs = dict(model_init_kwargs or {})
    requested = init_kwargs.get("attn_implementation")
    if requested not in (None, TREE_ATTENTION_NAME):
        logger.warning(
            "hf_tree: model_init_kwargs attn_implementation=%r replaced by %r (packed trees need it; without kv_end "
            "it is exactly SDPA).",
            requested,
            TREE_ATTENTION_NAME,
        )
    return {**init_kwargs, "attn_implementation": TREE_ATTENTION_NAME}


def pad_token_id_of(processing_class: Any) -> int | None:
    """The tokenizer's pad id (else its eos id), if there is a tokenizer."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return None


class TreeTrainerMixin(FSDPFullSaveMixin):
    """Tree loss, exact step divisor, tree eval loss, packing logs and complete FSDP2 saves, for ``Trainer``
    subclasses; depth-first trees are left to its ``DepthFirstRunner`` (``tree_depth_first``).

    Place it before the ``Trainer`` class in the bases. Its ``__init__`` (the same arguments as ``Trainer``'s, in
    the same order) is the one init path of the tree trainers: subclasses adapt it through
    ``_tree_training_arguments`` (the default and accepted ``args``) and ``_init_tree_training`` (set-up after the base
    ``__init__``).
    """

    # compute_loss divides by the whole optimizer step's divisor, so Trainer must not divide by the
    # number of accumulation steps again.
    loss_is_scaled_for_ga = True
    # Per-token loss replacing the weighted cross-entropy (``tree_causal_lm_loss``'s ``token_loss``); None: plain CE.
    tree_token_loss: Callable[..., torch.Tensor] | None = None

    def __init__(
        self,
        model: PreTrainedModel | torch.nn.Module | str | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        args = self._tree_training_arguments(model, args, data_collator, kwargs)
        # TrainingArguments fields tree batches cannot honour as Trainer does (hf_tree.training_arguments)
        check_tree_trainer_arguments(args)
        refuse_metrics_callables(kwargs.get("compute_metrics"), kwargs.get("preprocess_logits_for_metrics"))
        if isinstance(model, str):  # loaded by the base class (TRL) from model_init_kwargs
            args.model_init_kwargs = tree_model_init_kwargs(args.model_init_kwargs)
        elif model is not None:
            use_tree_attention(model)
        collator_is_ours = data_collator is None
        if collator_is_ours:
            data_collator = args.make_tree_collator(pad_token_id_of(processing_class))
        enable_fsdp2_on_cpu()  # before Trainer creates the Accelerator
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        pad_token_id = pad_token_id_of(self.processing_class)  # the base class may have loaded a tokenizer
        if collator_is_ours and pad_token_id is not None:
            self.data_collator.pad_token_id = pad_token_id  # cosmetic: padding is never attended to nor scored
        self._init_tree_training()
        check_length_column(self.args, self.train_dataset, self.eval_dataset)

    def _tree_training_arguments(
        self, model: Any, args: TrainingArguments | None, data_collator: Any, kwargs: dict[str, Any]
    ) -> TrainingArguments:
        """The arguments to train with: ``args``, or the subclass's default when ``None``.

        Raises:
            ValueError: for arguments (or other ``__init__`` keywords) the subclass cannot train with.
        """
        raise NotImplementedError(f"{type(self).__name__} must define _tree_training_arguments")

    def _init_tree_training(self) -> None:
        """Checks and state after the base ``__init__``; subclasses extend it (calling ``super()`` last)."""
        if self.args.n_gpu > 1:
            raise ValueError(
                f"{type(self).__name__} does not support nn.DataParallel (n_gpu={self.args.n_gpu}): it splits the "
                "flat loss_positions of a packed batch. Launch with `accelerate launch` or `torchrun`, or make one "
                "GPU visible with CUDA_VISIBLE_DEVICES."
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func is not used by tree trainers (the loss is hf_tree.tree_causal_lm_loss); "
                "remove it, or subclass and override compute_loss."
            )
        log_quantized_base(self.model)
        if not self.args.average_tokens_across_devices and self.loss_is_scaled_for_ga:
            logger.warning(
                "average_tokens_across_devices=False has no effect on tree trainers: the loss is always divided by "
                "the sum over all micro-batches and ranks of the optimizer step (exactly one large batch)."
            )
        keep_training_kernels(causal_lm_of(self.model))  # evaluation's no-grad passes must not repack 4-bit weights
        self._tree_log_sums = torch.zeros(len(STEP_SUM_KEYS), dtype=torch.float64)
        self._tree_total_sums = torch.zeros(len(STEP_SUM_KEYS), dtype=torch.float64)
        self._tree_log_steps = 0
        self._tree_log_start: float | None = None
        self._tree_eval_sums: torch.Tensor | None = None
        # None without context parallel (parallelism_config.cp_size 1 or no parallelism_config).
        pad_token_id = getattr(self.data_collator, "pad_token_id", None) or 0
        if isinstance(self.args, TreeArguments):
            context_parallel = self.args.context_parallel_config(pad_token_id)
        else:  # plain TrainingArguments with a TreeDataCollator: the default sharding
            context_parallel = ContextParallelConfig(pad_token_id=pad_token_id)
        self.tree_context_parallel = TreeContextParallel.from_accelerator(self.accelerator, context_parallel)
        if self.tree_context_parallel is not None:
            # Every batch of this trainer goes through hf_tree's tree CP (_prepare_context_parallel_inputs), never
            # torch's ring attention, so accelerate's mask-dropping attention hooks (and their refusal of windowed and
            # chunked models, right for the ring attention) must not be attached when Trainer prepares the model.
            skip_accelerate_attention_hooks(self.accelerator)
        coef = router_aux_loss_coef(causal_lm_of(self.model))
        if coef and self.tree_context_parallel is not None:
            raise ValueError(
                f"router_aux_loss_coef={coef} with context parallel: each rank holds a shard of the tree, and the MoE "
                "load-balancing loss is a mean over the whole batch. Set router_aux_loss_coef=0.0 (or "
                "config.output_router_logits=False), or train without context parallel."
            )
        # The whole training set, before the first step (the per-batch checks stay).
        check_dataset_drops(self.data_collator, self.train_dataset)
        check_dataset_rope_lengths(self.model.config, self.data_collator, self.train_dataset)
        self.tree_depth_first = self._plan_depth_first()

    def _plan_depth_first(self) -> DepthFirstRunner | None:
        """The depth-first runner of the collator's ``tree_execution`` (``None`` when trees run packed; see
        ``DepthFirstRunner.plan``, which refuses what cannot run and falls ``"auto"`` back to packed rows)."""
        return DepthFirstRunner.plan(
            self.data_collator,
            self.model,
            self.accelerator,
            self.args,
            context_parallel=self.tree_context_parallel is not None,
            self_check=self.tree_self_check,
            token_loss=self.tree_token_loss,
        )

    @property
    def tree_self_check(self) -> bool | None:
        """The ``self_check`` of the tree loss: ``tree_self_check`` of tree arguments; plain ``TrainingArguments``
        (with a ``TreeDataCollator``) have no such field and get the default (``HF_TREE_SELF_CHECK``)."""
        return self_check_setting(self.args.tree_self_check) if isinstance(self.args, TreeArguments) else None

    # ------------------------------------------------------------------ training
    def _pop_batch_sums(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[len(STEP_SUM_KEYS)]`` float64 sums of one batch; removes the stats keys so the model never sees them.
        Rows count only when they are forwarded (``DepthFirstRunner.rows_run``)."""
        stats = pop_packing_stats(batch)
        if not self._rows_run(batch):
            stats.num_rows = stats.num_padding_tokens = 0
        values = [batch["num_loss_items"], stats.num_rows, *(getattr(stats, name) for name in STATS_KEYS)]
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Fetch the optimizer step's micro-batches; the divisor is their ``num_loss_items`` summed over all ranks."""
        if self._tree_log_start is None:
            self._tree_log_start = time.perf_counter()
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        sums = torch.zeros(len(STEP_SUM_KEYS), dtype=torch.float64)
        for batch in batch_samples:
            # Before the step, on the whole batch (context parallel shards it later, and each rank's rope would see
            # only its shard's largest position).
            check_rope_lengths(self.model.config, batch["position_ids"])
            for tree in batch.get(DEPTH_FIRST_KEY) or ():
                check_rope_lengths(self.model.config, torch.from_numpy(tree.position_ids), "a depth-first tree")
            sums += self._pop_batch_sums(batch)
        sums = sums.to(device)
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
            # Every rank of a CP group holds the same batch: the sum counted it once per CP rank.
            if self.tree_context_parallel is not None:
                sums = sums / self.tree_context_parallel.size
        if self.args.include_num_input_tokens_seen == "non_padding":  # Trainer's count on the branches
            self.state.num_input_tokens_seen += int(sums[STEP_SUM_KEYS.index("num_branch_tokens")])
        self._tree_log_sums += sums.cpu()
        self._tree_total_sums += sums.cpu()
        self._tree_log_steps += 1
        return batch_samples, sums[0]

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count for ``include_num_input_tokens_seen="all"``: the tokens the model forwards, i.e. the packed
        rows (padding included) plus every token of the depth-first trees (each forwarded once, in units without
        padding; on one process an all-depth-first batch's placeholder row is not forwarded, so not counted; on several
        it is forwarded and counted). ``"non_padding"`` is
        counted in ``get_batch_samples`` as the branches' tokens (depth-first trees' included), since a tree batch has
        no attention_mask and its packed tokens hold each shared prefix once."""
        if self.args.include_num_input_tokens_seen in ("non_padding", "no"):
            return
        if self._rows_run(inputs):
            super()._track_num_input_tokens(inputs)  # gathers over ranks: every rank calls it
        if self.tree_depth_first is not None:  # every rank, trees or not (a gather under several processes)
            self.state.num_input_tokens_seen += self.tree_depth_first.forwarded_tokens(
                inputs.get(DEPTH_FIRST_KEY) or ()
            )

    def _prepare_context_parallel_inputs(self, model, inputs):
        """``(context factory, this rank's inputs)``: the tree CP shard of the batch under context parallel, else
        the batch unchanged. Replaces Trainer's torch CP (causal-only ring attention, SDPA only)."""
        if self.tree_context_parallel is None:
            return contextlib.nullcontext, inputs
        return self.tree_context_parallel.prepare(inputs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step on the packed rows and depth-first execution of the trees the collator left whole
        (``tree_execution``), which runs its own backward (``DepthFirstRunner.training_step``: the order of the two
        and the divisor under several processes); the returned loss (detached) is their sum."""
        if self.tree_depth_first is None:
            return super().training_step(model, inputs, num_items_in_batch)
        trees = inputs.get(DEPTH_FIRST_KEY) or []
        # a copy without them: Trainer's token count (_track_num_input_tokens) sees them
        rows = {key: value for key, value in inputs.items() if key != DEPTH_FIRST_KEY}
        packed_step = functools.partial(super().training_step, model, rows, num_items_in_batch)
        return self.tree_depth_first.training_step(
            model,
            trees,
            num_items_in_batch,
            packed_step if self._rows_run(inputs) else None,
            self.compute_loss_context_manager,
        )

    def _rows_run(self, batch: dict[str, Any]) -> bool:
        """Whether the packed rows of a training batch are forwarded (``DepthFirstRunner.rows_run``)."""
        return self.tree_depth_first is None or self.tree_depth_first.rows_run(batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``tree_causal_lm_loss``; with the step's global divisor, scaled by the number of processes because
        DDP/FSDP average gradients over ranks (under context parallel the CP ranks' shares add up the same way)."""
        pop_packing_stats(inputs)  # counted in get_batch_samples when training; only dropped here
        losses = tree_losses(
            model,
            inputs,
            num_items_in_batch=num_items_in_batch,
            token_loss=self.tree_token_loss,
            self_check=self.tree_self_check,
            model_inputs=batch_model_inputs(model, inputs, self.tree_context_parallel is not None),  # images
        )
        loss = self._tree_step_loss(losses, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def _tree_step_loss(self, losses: TreeLosses, num_items_in_batch: Any) -> torch.Tensor:
        """Trainer's: the model's own loss on the branches (token loss plus ``router_aux_loss_coef`` times an MoE
        model's load-balancing loss of the micro-batch), times the processes when divided by the global divisor."""
        loss = losses.model_loss()
        return loss * self.accelerator.num_processes if num_items_in_batch is not None else loss

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The tree loss of one batch (no logits: a tree batch has several children per position)."""
        inputs = self._prepare_inputs(inputs)
        pop_packing_stats(inputs)
        # without a runner a batch holding depth-first trees is refused by tree_losses (it would skip them)
        trees = inputs.pop(DEPTH_FIRST_KEY, None) if self.tree_depth_first is not None else None
        with torch.no_grad(), self.compute_loss_context_manager():
            total = tree_losses(  # the token loss: a router loss is a per-batch mean, not a sum over the set
                model,
                inputs,
                num_items_in_batch=1.0,
                token_loss=self.tree_token_loss,
                self_check=self.tree_self_check,
                model_inputs=batch_model_inputs(model, inputs),  # images (evaluation is never context-parallel)
            ).token
            if self.tree_depth_first is not None:  # every rank under several processes (FSDP2's unshard)
                depth_first = self.tree_depth_first.evaluation_loss(model, trees or [])
                if depth_first is not None:
                    total = total + depth_first.to(total)
        items = inputs["num_loss_items"].to(total.device, torch.float64)
        if self._tree_eval_sums is not None:
            self._tree_eval_sums += torch.stack([total.detach().to(torch.float64), items])
        return (total / items.clamp_min(1e-12)).detach().to(total.dtype), None, None

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ) -> EvalLoopOutput:
        """Trainer's loop; the reported loss is the weighted sum over the whole set divided by its divisor."""
        self._tree_eval_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            sums = self._tree_eval_sums
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
        finally:
            self._tree_eval_sums = None
        if sums[1] > 0:
            output.metrics[f"{metric_key_prefix}_loss"] = float(sums[0] / sums[1])
        return output

    # ------------------------------------------------------------------ logging
    def tree_metrics(self) -> dict[str, float]:
        """Packing figures since the last training log (sums over ranks) and running totals of lost branches."""
        now = time.perf_counter()
        elapsed = max(now - (self._tree_log_start or now), 1e-9)
        steps = max(self._tree_log_steps, 1)
        s = PackingStats(**dict(zip(STEP_SUM_KEYS[1:], self._tree_log_sums[1:].tolist())))  # counters as floats
        metrics = {
            "trees_per_step": s.num_trees / steps,
            "rows_per_step": s.num_rows / steps,
            "dedup_ratio": s.dedup_ratio,
            "padding_fraction": s.padding_fraction,
            "tree_tokens_per_second": s.num_tree_tokens / elapsed,
            "branch_tokens_per_second": s.num_branch_tokens / elapsed,
        }
        totals = dict(zip(STEP_SUM_KEYS, self._tree_total_sums.tolist()))
        metrics.update({name: totals[name] for name in LOSS_OF_DATA_KEYS if totals[name]})
        self._tree_log_sums.zero_()
        self._tree_log_steps = 0
        self._tree_log_start = now
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # a training log ("loss"; eval logs carry "eval_loss"), or the end of training ("train_loss"), which closes the
        # last interval: a run shorter than logging_steps reports its packing figures there
        if ("loss" in logs or "train_loss" in logs) and self._tree_log_steps:
            logs.update(self.tree_metrics())
        super().log(logs, start_time)


class TreeTrainer(TreeTrainerMixin, Trainer):
    """``transformers.Trainer`` on tree rows (``Tree.to_dict()`` rows, e.g. from ``hf_tree.builders``).

    Takes the same arguments as ``Trainer``; ``args`` must be ``TreeTrainingArguments`` unless a
    ``TreeDataCollator`` is passed as ``data_collator``. The model is switched to ``tree_flash`` attention.
    """

    def _tree_training_arguments(
        self, model: Any, args: TrainingArguments | None, data_collator: Any, kwargs: dict[str, Any]
    ) -> TrainingArguments:
        if args is None:
            return TreeTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, TreeArguments) and (data_collator is None or args.remove_unused_columns):
            raise ValueError(
                f"args is a {type(args).__name__}: use hf_tree.TreeTrainingArguments (tree fields, "
                "remove_unused_columns=False), or pass a TreeDataCollator and set remove_unused_columns=False."
            )
        return args

    def _init_tree_training(self) -> None:
        # Trainer's LabelSmoother on the branches, per token with the tree weights (TreeSFTTrainer does the same).
        self.tree_token_loss = sft_token_loss("nll", self.args.label_smoothing_factor)
        super()._init_tree_training()
