"""Shared pieces of the tree context parallel launches (tests/test_context_parallel_distributed.py,
tests/test_context_parallel_models.py): accelerate's FSDP2 + CP config, the cp=1 oracle of a batch and the
``TreeTrainer`` run both compare with one process."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import VOCAB

REPO = Path(__file__).resolve().parents[1]
FLOAT64_TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 1e-5
# Accelerate's FSDP2 + context-parallel config, as a user writes it (CPU: ACCELERATE_USE_CPU=true).
ACCELERATE_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "num_machines": 1,
    "num_processes": 2,
    "machine_rank": 0,
    "mixed_precision": "no",
    "use_cpu": True,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_reshard_after_forward": True,
        "fsdp_cpu_ram_efficient_loading": False,
        # As in fsdp_configs/fsdp2_context_parallel.json: layers are recomputed in backward, CP all-gathers included.
        "fsdp_activation_checkpointing": True,
    },
    "parallelism_config": {"parallelism_config_cp_size": 2, "parallelism_config_dp_shard_size": 1},
}


# name: (rows, family, dtype, strategy, max_packed_tokens, query_block_size)
def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name (FSDP2 shards gathered, activation-checkpoint wrappers unnamed)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor

    return {
        n.replace(_CHECKPOINT_PREFIX, ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        .detach()
        .clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def single_process(model, batch):
    """cp=1 oracle: logits of every position, the loss and the gradients."""
    from hf_tree import tree_causal_lm_loss

    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"], use_cache=False
        ).logits
    loss = tree_causal_lm_loss(model, batch)
    loss.backward()
    grads = full_grads(model)
    model.zero_grad(set_to_none=True)
    return logits, loss.detach(), grads


def logits_error(model, local, plan, rank, reference_logits) -> float:
    """Relative error of this rank's logits (real positions only) against the cp=1 logits."""
    from tests.helpers import relative_error

    with torch.no_grad():
        logits = model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], kv_end=local["kv_end"], use_cache=False
        ).logits
    ids = plan.indices[rank]
    real = ids < plan.num_tokens
    if not bool(real.any()):
        return 0.0
    return relative_error(logits[:, real], reference_logits[:, ids[real]])


def sharded_step(
    model, batch, plan, cp, block: int, reference_logits: torch.Tensor
) -> tuple[dict, float, torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's shard of ``batch`` (``plan``) through the tree context parallel forward and backward: its local
    batch, its logits' error against the cp=1 ``reference_logits``, and the loss and gradients summed over the CP
    ranks."""
    import torch.distributed as dist

    from hf_tree import tree_causal_lm_loss
    from hf_tree.parallel import shard_batch_for_context_parallel, tree_context_parallel

    local = shard_batch_for_context_parallel(batch, plan, cp.rank)
    with tree_context_parallel(batch, plan, cp.rank, cp.group, query_block_size=block):
        logits_err = logits_error(model, local, plan, cp.rank, reference_logits)
        loss = tree_causal_lm_loss(model, local)
        loss.backward()
    grads = full_grads(model)
    for g in grads.values():
        dist.all_reduce(g, group=cp.group)  # the CP ranks' gradient contributions add up
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp.group)
    return local, logits_err, total, grads


# Non-default sharding options of the trainer run, set through TreeTrainingArguments' context_parallel_* fields.
TRAINER_CONTEXT_PARALLEL = {"context_parallel_strategy": "zigzag", "context_parallel_query_block_size": 5}


def train_tree_trainer(
    output_dir: str,
    family: str = "llama",
    overrides: dict | None = None,
    options: dict | None = None,
    lora: bool = False,
) -> dict:
    """2 SGD steps of ``TreeTrainer`` (float64 tiny ``family`` model with config ``overrides``, its norms in float64,
    with ``lora`` rank-4 LoRA adapters on every linear layer, 2 trees per step, gradient accumulation 2): logged
    losses, the step divisors and the final full parameters.
    Under the CP launch both ranks hold the same batch and ``TreeTrainer`` shards it over the CP group with the
    ``options`` (``context_parallel_*`` arguments; default ``TRAINER_CONTEXT_PARALLEL``; without CP they are
    unused)."""
    from torch.distributed.tensor import DTensor

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args, float64_norms, tiny_model
    from tests.workloads import branch_groups, tree_dataset

    args = TreeTrainingArguments(
        **exact_sgd_args(
            output_dir,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=0.5,
            seed=3,
            train_sampling_strategy="sequential",
            max_packed_tokens=48,
            **(TRAINER_CONTEXT_PARALLEL if options is None else options),
        )
    )
    model = tiny_model(family, dtype=torch.float64, vocab_size=VOCAB, **(overrides or {}))
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # the adapters' initialisation, the same in every process
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    trainer = TreeTrainer(model=model, args=args, train_dataset=tree_dataset(branch_groups(seed=5, num_trees=8)))
    with float64_norms():
        trainer.train()
    named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    cp = trainer.tree_context_parallel
    return {
        "cp_size": 1 if cp is None else cp.size,
        "cp_options": None if cp is None else (cp.config.strategy, cp.config.query_block_size),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "trees_per_step": [h["trees_per_step"] for h in trainer.state.log_history if "trees_per_step" in h],
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in named},
    }
