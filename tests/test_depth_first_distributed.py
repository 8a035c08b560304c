"""Depth-first execution (``tree_execution="auto"`` and ``"depth_first"``) under ``accelerate launch`` with 2 CPU
processes (gloo): FSDP2 (each ``fsdp_configs/*.json``: plain, FSDP activation checkpointing, LoRA with transformers'
gradient checkpointing) and plain DDP.

The file is also the launched worker (``__main__``). The worker trains 3 SGD steps of ``TreeTrainer`` with 2
accumulated micro-batches of 2 trees per rank, rows (and units) of 12 tokens and branches up to 21: "auto" runs the
trees over 12 tokens depth-first beside packed rows (some micro-batches hold only depth-first trees on one rank),
"depth_first" runs every tree depth-first (every micro-batch is the placeholder row plus units). Each rank runs as
many units as its own trees need. It evaluates, saves the final model (``save_model``) and reports parameters,
logged losses, the evaluation loss and the token count. Oracle: one process of packed ``TreeTrainer`` (rows of 64,
nothing split) on the same global batch (2 processes x 2 trees = 1 process x 4 trees): same parameters, losses,
evaluation loss and saved tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # launched as a script: make `hf_tree` and `tests` importable from the checkout
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers import (  # noqa: E402
    PROCESS_LAYOUTS,
    finish_launched_worker,
    free_port,
    launch_command,
    max_relative_error,
)

FSDP_CONFIGS = sorted((REPO / "fsdp_configs").glob("*.json"))
DDP_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MULTI_GPU",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 2,
    "machine_rank": 0,
    "main_training_function": "main",
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}
EXECUTIONS = ("auto", "depth_first")
GLOBAL_BATCH = 4
ACCUMULATION = 2
STEPS = 3
ROW_TOKENS = 12
# float32 on gloo: reductions and units add up in a different order than one packed process
TOLERANCE = 2e-5


def make_model(lora: bool) -> torch.nn.Module:
    """The tiny float32 Llama with tied embeddings (as test_fsdp.py), identical on every rank; LoRA adapters start
    non-zero so both adapter matrices get gradients from step 1."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers import VOCAB, tiny_model

    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32, tie_word_embeddings=True)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def datasets_():
    from tests.workloads import branch_groups, tree_dataset

    groups = branch_groups(seed=5, num_trees=GLOBAL_BATCH * ACCUMULATION * STEPS)
    # trees 19 and 22 (10 and 11 tokens) fit a row: rank 1's first micro-batch holds no depth-first tree under "auto"
    # (it must still join rank 0's unsharding, and its first-use self-check must run where rank 0's does)
    groups[2], groups[19], groups[3], groups[22] = groups[19], groups[2], groups[22], groups[3]
    train = tree_dataset(groups)
    evaluation = tree_dataset(branch_groups(seed=6, num_trees=GLOBAL_BATCH * 2))
    return train, evaluation


def train(directory: str, lora: bool, per_device_batch: int, **tree_args) -> dict:
    """Train, evaluate and ``save_model`` to ``directory/final``; parameters (full tensors), losses, evaluation loss
    and the number of input tokens seen."""
    from torch.distributed.tensor import DTensor

    from hf_tree.models.introspection import causal_lm_of
    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args

    train_set, eval_set = datasets_()
    model = make_model(lora)
    args = exact_sgd_args(
        directory,
        per_device_train_batch_size=per_device_batch,
        per_device_eval_batch_size=per_device_batch,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=0.2,
        seed=3,
        train_sampling_strategy="sequential",
        include_num_input_tokens_seen="all",
        **tree_args,
    )
    trainer = TreeTrainer(model=model, args=TreeTrainingArguments(**args), train_dataset=train_set)
    trainer.train()
    eval_loss = trainer.evaluate(eval_set)["eval_loss"]
    trainer.save_model(str(Path(directory) / "final"))
    named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "wrapper": type(trainer.model_wrapped).__name__,
        "gradient_checkpointing": causal_lm_of(model).is_activation_checkpointing,
        "sharded": all(isinstance(p, DTensor) for _, p in named),
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in named},
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": eval_loss,
        "tokens_seen": trainer.state.num_input_tokens_seen,
    }


def depth_first_run(directory: str, lora: bool, per_device_batch: int, execution: str) -> dict:
    # LoRA as docs/training.md recommends under FSDP2: transformers' gradient checkpointing (non-reentrant)
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    return train(
        directory,
        lora,
        per_device_batch,
        max_packed_tokens=ROW_TOKENS,
        max_branch_tokens=2 * ROW_TOKENS,
        tree_execution=execution,
        **(checkpointing if lora else {}),
    )


def sft_run(directory: str, per_device_batch: int, **tree_args) -> dict:
    """``TreeSFTTrainer`` (TRL) on 8 synthetic agent conversations (chat template, tools), 2 SGD steps of 2
    accumulated micro-batches; parameters (full tensors) and logged losses."""
    from torch.distributed.tensor import DTensor

    from hf_tree import Tree
    from hf_tree.assets import load_smollm2_tokenizer
    from hf_tree.data.synthetic_agent import synthetic_agent_dataset
    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.helpers import SMOLLM2_VOCAB, exact_sgd_args, tiny_model

    dataset = synthetic_agent_dataset(8, seed=4, max_user_turns=2, max_tool_steps=1)
    model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa", tie_word_embeddings=True)
    args = exact_sgd_args(
        directory,
        per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=2,
        learning_rate=0.2,
        seed=3,
        bf16=False,
        train_sampling_strategy="sequential",
        **tree_args,
    )
    trainer = TreeSFTTrainer(
        model=model, args=TreeSFTConfig(**args), train_dataset=dataset, processing_class=load_smollm2_tokenizer()
    )
    trainer.train()
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "params": {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in model.named_parameters()
        },
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "tree_tokens": [Tree.from_dict(row).num_tokens for row in trainer.train_dataset],
    }


SFT_DEPTH_FIRST = dict(tree_execution="auto", max_packed_tokens=96, max_length=None, max_branch_tokens=4096)


@pytest.mark.distributed
@pytest.mark.slow
def test_tree_sft_trainer_depth_first_under_fsdp2(tmp_path):
    """TRL's path (``TreeSFTTrainer``): agent trajectories longer than rows of 96 tokens run depth-first under
    FSDP2 on 2 processes; the parameters equal one packed process on the same global batch."""
    report = tmp_path / "report.pt"
    command = [*launch_command(REPO / "fsdp_configs" / "fsdp2_full.json"), __file__, "--report", str(report)]
    command[command.index("--main_process_port") + 1] = str(free_port())
    command += ["--output_dir", str(tmp_path / "run"), "--sft"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    run = torch.load(report)
    single = sft_run(str(tmp_path / "single"), 2, max_packed_tokens=4096, max_length=None)
    assert run["distributed_type"] == "DistributedType.FSDP" and len(run["tree_tokens"]) == 8
    assert min(run["tree_tokens"]) > SFT_DEPTH_FIRST["max_packed_tokens"]  # every tree runs depth-first, in units
    relative = max_relative_error(run["params"], single["params"])
    print(f"TreeSFTTrainer FSDP2 auto: parameters vs one packed process: relative {relative:.2e}")
    assert relative <= TOLERANCE
    assert run["losses"] == pytest.approx(single["losses"], rel=TOLERANCE)


def saved_weights(directory: Path, lora: bool) -> dict[str, torch.Tensor]:
    return load_file(directory / ("adapter_model.safetensors" if lora else "model.safetensors"))


def test_the_workload_has_trees_on_both_sides_of_a_row():
    """ "auto" packs some trees and runs others depth-first; some trees have several units."""
    from hf_tree import Tree

    train_set, _ = datasets_()
    sizes = [Tree.from_dict(row).num_tokens for row in train_set]
    assert min(sizes) <= ROW_TOKENS < 2 * ROW_TOKENS < max(sizes)
    assert max(sizes[2:4]) <= ROW_TOKENS < min(sizes[:2])  # rank 1 packs its first micro-batch, rank 0 does not


@pytest.mark.parametrize(("distributed_type", "fsdp2", "replicate", "refused"), PROCESS_LAYOUTS)
def test_depth_first_refuses_only_what_it_cannot_run_on_several_processes(
    tmp_path, caplog, distributed_type, fsdp2, replicate, refused
):
    """``_plan_depth_first`` on 2 processes of each kind (a stand-in accelerator; the launched tests run them):
    ``"depth_first"`` is refused where it cannot run, ``"auto"`` (the default) runs packed there with one log line."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args

    train_set, _ = datasets_()
    for execution in ("depth_first", "auto"):
        args = exact_sgd_args(str(tmp_path), max_packed_tokens=ROW_TOKENS, max_branch_tokens=24)
        args = TreeTrainingArguments(**args, **({"tree_execution": execution} if execution != "auto" else {}))
        trainer = TreeTrainer(model=make_model(False), args=args, train_dataset=train_set)
        trainer.accelerator = SimpleNamespace(
            num_processes=2,
            distributed_type=getattr(DistributedType, distributed_type),
            is_fsdp2=fsdp2,
            parallelism_config=SimpleNamespace(dp_replicate_size=replicate, tp_size=1),
        )
        if refused is None:
            assert trainer._plan_depth_first().config.max_unit_tokens == ROW_TOKENS
        elif execution == "depth_first":
            with pytest.raises(ValueError, match=rf"tree_execution='depth_first'.*{refused}.*tree_execution='packed'"):
                trainer._plan_depth_first()
        else:
            caplog.clear()
            with caplog.at_level("WARNING", logger="hf_tree"):
                assert trainer._plan_depth_first() is None
            assert trainer.data_collator.packing.tree_execution == "packed"
            assert trainer.data_collator.packing.max_branch_tokens == ROW_TOKENS  # a packed row holds whole branches
            (line,) = [r.getMessage() for r in caplog.records if "runs as 'packed'" in r.getMessage()]
            assert refused in line and "overlong='error'" in line


def launch_config(tmp_path: Path, name: str) -> Path:
    if name == "ddp":
        config = tmp_path / "ddp.json"
        config.write_text(json.dumps(DDP_CONFIG))
        return config
    return REPO / "fsdp_configs" / f"{name}.json"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", *(c.stem for c in FSDP_CONFIGS)])
def test_depth_first_on_two_cpu_processes_matches_one_packed_process(tmp_path, name):
    lora = "lora" in name
    report = tmp_path / "report.pt"
    command = [*launch_command(launch_config(tmp_path, name)), __file__, "--report", str(report)]
    command[command.index("--main_process_port") + 1] = str(free_port())  # launches in a row never share one
    command += ["--output_dir", str(tmp_path / "run"), *(["--lora"] if lora else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if name == "ddp":  # torchrun-launched processes without an accelerator: DDP on gloo (MULTI_CPU)
        env["ACCELERATE_USE_CPU"] = "true"
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    runs = torch.load(report)

    single = train(str(tmp_path / "single"), lora, GLOBAL_BATCH, max_packed_tokens=64)
    initial = {n: p.detach() for n, p in make_model(lora).named_parameters()}
    trainable = {n for n, p in make_model(lora).named_parameters() if p.requires_grad}
    for execution in EXECUTIONS:
        run = runs[execution]
        assert run["num_processes"] == 2 and run["gradient_checkpointing"] == lora
        if name == "ddp":
            assert (
                run["distributed_type"] == "DistributedType.MULTI_CPU" and run["wrapper"] == "DistributedDataParallel"
            )
        else:
            assert run["distributed_type"] == "DistributedType.FSDP" and run["sharded"]
        # training moved the trainable parameters well beyond the tolerance, and only those
        assert max_relative_error({n: run["params"][n] for n in trainable}, {n: initial[n] for n in trainable}) > 1e-3
        assert {n for n, p in run["params"].items() if not torch.equal(p, initial[n])} == trainable
        relative = max_relative_error(run["params"], single["params"])
        absolute = max(float((run["params"][n] - single["params"][n]).abs().max()) for n in run["params"])
        print(f"{name} {execution}: parameters vs one packed process: relative {relative:.2e}, absolute {absolute:.2e}")
        assert relative <= TOLERANCE and absolute <= 1e-5, execution
        assert run["losses"] == pytest.approx(single["losses"], rel=TOLERANCE)
        assert run["eval_loss"] == pytest.approx(single["eval_loss"], rel=TOLERANCE)
        # the final save holds the trained parameters, as one process writes them
        saved = saved_weights(tmp_path / "run" / execution / "final", lora)
        expected = saved_weights(tmp_path / "single" / "final", lora)
        assert saved.keys() == expected.keys() and "lm_head.weight" not in saved
        assert max_relative_error(saved, expected) <= TOLERANCE
        if not lora:
            assert max_relative_error(saved, {n: run["params"][n] for n in saved}) == 0.0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--sft", action="store_true", help="TreeSFTTrainer, 'auto'")
    options = parser.parse_args()
    if options.sft:
        out = sft_run(options.output_dir, 1, **SFT_DEPTH_FIRST)
    else:
        out = {
            execution: depth_first_run(str(Path(options.output_dir) / execution), options.lora, 2, execution)
            for execution in EXECUTIONS
        }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out, options.report)
    finish_launched_worker()
