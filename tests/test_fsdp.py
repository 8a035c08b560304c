"""Each ``fsdp_configs/*.json`` under ``accelerate launch`` with 2 CPU processes (gloo), through ``TreeTrainer``.

The file is also the launched worker (``__main__``). The worker trains 2 SGD steps on tree rows with a
sequential sampler and a checkpoint every step, reports whether the parameters were sharded (DTensor),
then resumes a fresh model from ``checkpoint-1`` and trains step 2 again. Oracle: the same run in one process
on the same global batch (2 processes x 2 trees = 1 process x 4 trees): same logged losses, same parameters.
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

CONFIGS = sorted((REPO / "fsdp_configs").glob("*.json"))
GLOBAL_BATCH = 4
# float32 on gloo: reductions run in a different order than in one process
TOLERANCE = 2e-5


def make_model(lora: bool) -> torch.nn.Module:
    """The tiny float32 model, identical on every rank (seeded); LoRA adapters start non-zero so that both
    adapter matrices get gradients from step 1."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers import tiny_model
    from tests.test_trainer import VOCAB

    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def run(output_dir: str, lora: bool, per_device_batch: int) -> dict:
    """Train, then resume from checkpoint-1; returns losses, sharding and final parameters (full tensors)."""
    from torch.distributed.tensor import DTensor

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args
    from tests.test_trainer import branch_groups, tree_dataset

    dataset = tree_dataset(branch_groups(seed=5, num_trees=2 * GLOBAL_BATCH))
    args = exact_sgd_args(
        output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=2,
        learning_rate=0.2,
        seed=3,
        save_strategy="steps",
        save_steps=1,
        train_sampling_strategy="sequential",
        max_packed_tokens=64,
    )

    def train(resume: str | None):
        model = make_model(lora)
        trainer = TreeTrainer(model=model, args=TreeTrainingArguments(**args), train_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume)
        named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in named}
        sharded = {n: isinstance(p, DTensor) for n, p in named}
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer, params, sharded, losses

    trainer, params, sharded, losses = train(None)
    _, resumed_params, _, resumed_losses = train(str(Path(output_dir) / "checkpoint-1"))
    trainable = {n for n, p in make_model(lora).named_parameters() if p.requires_grad}
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "sharded": sharded,
        "trainable": sorted(trainable),
        "losses": losses,
        "resumed_losses": resumed_losses,
        "params": {n: p.cpu() for n, p in params.items()},  # names as without FSDP activation checkpointing
        "resumed_params": {n: p.cpu() for n, p in resumed_params.items()},
    }


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_fsdp2_config_on_two_cpu_processes(tmp_path, config):
    lora = "lora" in config.stem
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 1000),
    ]
    if "parallelism_config" in json.loads(config.read_text()):
        launch += ["--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "1"]
    report = tmp_path / "report.pt"
    command = [*launch, __file__, "--output_dir", str(tmp_path / "run"), "--report", str(report)]
    command += ["--lora"] if lora else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "FSDP2 is enabled on CPU" in result.stderr  # the adjustment ran, with its warning
    distributed = torch.load(report)
    assert distributed["distributed_type"] == "DistributedType.FSDP" and distributed["num_processes"] == 2
    assert all(distributed["sharded"].values()), "every parameter should be a DTensor under FSDP2"

    single = run(str(tmp_path / "single"), lora, per_device_batch=GLOBAL_BATCH)
    assert distributed["losses"] == pytest.approx(single["losses"], rel=TOLERANCE)
    assert max_relative_error(distributed["params"], single["params"]) <= TOLERANCE
    # resuming from checkpoint-1 repeats step 2 exactly (same data, same state; step 1's log comes from the checkpoint)
    assert distributed["resumed_losses"] == pytest.approx(distributed["losses"], rel=TOLERANCE)
    assert max_relative_error(distributed["resumed_params"], distributed["params"]) <= TOLERANCE
    initial = {n: p.detach() for n, p in make_model(lora).named_parameters()}
    moved = {n for n, p in distributed["params"].items() if not torch.equal(p, initial[n])}
    # training moved the trainable parameters, and only those (LoRA: the frozen base stays bit-identical)
    assert moved == set(distributed["trainable"])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--lora", action="store_true")
    options = parser.parse_args()
    out = run(options.output_dir, options.lora, per_device_batch=GLOBAL_BATCH // 2)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out, options.report)
