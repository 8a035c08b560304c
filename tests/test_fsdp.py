"""Each ``fsdp_configs/*.json`` under ``accelerate launch`` with 2 CPU processes (gloo), through ``TreeTrainer``.

The file is also the launched worker (``__main__``). The worker trains 2 SGD steps on tree rows with a
sequential sampler and a checkpoint every step, saves the final model (``save_model``), reports whether the
parameters were sharded (DTensor), then resumes a fresh model from ``checkpoint-1`` and trains step 2 again. For
``KILL_CONFIGS`` that checkpoint comes from an earlier launch whose processes were all SIGKILLed right after it was
written (a preempted job). Oracle: the same run in one process on the same global batch (2 processes x 2 trees =
1 process x 4 trees): same logged losses, same parameters, and the same saved files (tensor names and values).
Under a config with FSDP activation checkpointing the launch also trains, checkpoints, saves and resumes a LoRA run
(PEFT cannot find its adapter in the sharded checkpoint folder there: ``hf_tree.saving``), whose checkpoint, final
adapter and resumed parameters must equal the single-process ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # launched as a script: make `hf_tree` and `tests` importable from the checkout
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.helpers import finish_launched_worker, launch_command, max_relative_error  # noqa: E402

CONFIGS = sorted((REPO / "fsdp_configs").glob("*.json"))
KILL_CONFIGS = {"fsdp2_lora", "fsdp2_full"}  # resumed from a checkpoint of a killed launch
# Configs with FSDP activation checkpointing, which renames modules (PEFT's adapter selection trips over it): the launch
# also runs LoRA with checkpoints and a resume
ACTIVATION_CHECKPOINTING_CONFIGS = {"fsdp2_context_parallel"}
GLOBAL_BATCH = 4
# float32 on gloo: reductions run in a different order than in one process
TOLERANCE = 2e-5


def make_model(lora: bool) -> torch.nn.Module:
    """The tiny float32 model with tied embeddings (as SmolLM2), identical on every rank (seeded); LoRA adapters
    start non-zero so that both adapter matrices get gradients from step 1."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers import VOCAB, tiny_model

    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32, tie_word_embeddings=True)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def saved_weights(directory: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The tensors ``save_model`` wrote: the adapter file for LoRA, else the model file."""
    return load_file(directory / ("adapter_model.safetensors" if lora else "model.safetensors"))


def load_saved(directory: Path, lora: bool) -> torch.nn.Module:
    """What a user reloads: ``PeftModel.from_pretrained`` on the same base, or ``from_pretrained`` of the model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if lora:
        base = make_model(lora=False)
        return PeftModel.from_pretrained(base, directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


class KillAfterCheckpoint(TrainerCallback):
    """SIGKILL every rank once ``checkpoint-{step}`` is complete on all of them: a job preempted right after it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


def train_and_save(directory: str, lora: bool, per_device_batch: int, resume: str | None = None, callbacks=(), **args):
    """Train 2 steps (checkpoint every step unless ``args`` say otherwise) and ``save_model`` to
    ``directory/final``; returns the trainer, the final parameters (full tensors), their sharding and the losses."""
    from torch.distributed.tensor import DTensor

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args
    from tests.workloads import branch_groups, tree_dataset

    dataset = tree_dataset(branch_groups(seed=5, num_trees=2 * GLOBAL_BATCH))
    settings = dict(
        per_device_train_batch_size=per_device_batch,
        max_steps=2,
        learning_rate=0.2,
        seed=3,
        save_strategy="steps",
        save_steps=1,
        train_sampling_strategy="sequential",
        max_packed_tokens=64,
    )
    model = make_model(lora)
    trainer = TreeTrainer(
        model=model,
        args=TreeTrainingArguments(**exact_sgd_args(directory, **{**settings, **args})),
        train_dataset=dataset,
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(Path(directory) / "final"))
    named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in named}
    sharded = {n: isinstance(p, DTensor) for n, p in named}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, params, sharded, losses


def run(output_dir: str, lora: bool, per_device_batch: int, resume_dir: str | None = None, kill: bool = False):
    """Train and save to ``output_dir/final``, then resume from ``checkpoint-1`` (of ``resume_dir``, default
    ``output_dir``) and save to ``<resume_dir>/final``; returns losses, sharding and final parameters (full
    tensors). ``kill``: train only until ``checkpoint-1`` is written, then SIGKILL (never returns)."""
    if kill:
        train_and_save(output_dir, lora, per_device_batch, callbacks=[KillAfterCheckpoint(step=1)])
        raise AssertionError("KillAfterCheckpoint did not kill the run")
    trainer, params, sharded, losses = train_and_save(output_dir, lora, per_device_batch)
    resume_dir = resume_dir or output_dir
    resume = str(Path(resume_dir) / "checkpoint-1")
    _, resumed_params, _, resumed_losses = train_and_save(resume_dir, lora, per_device_batch, resume=resume)
    trainable = {n for n, p in make_model(lora).named_parameters() if p.requires_grad}
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "sharded": sharded,
        "trainable": sorted(trainable),
        "losses": losses,
        "resumed_losses": resumed_losses,
        "params": params,  # names as without FSDP activation checkpointing
        "resumed_params": resumed_params,
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_fsdp2_config_on_two_cpu_processes(tmp_path, config):
    lora = "lora" in config.stem
    also_lora = config.stem in ACTIVATION_CHECKPOINTING_CONFIGS
    killed = tmp_path / "killed" if config.stem in KILL_CONFIGS else None
    report = tmp_path / "report.pt"
    worker = [*launch_command(config), __file__, "--report", str(report), *(["--lora"] if lora else [])]
    worker += ["--also_lora"] if also_lora else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if killed is not None:
        result = subprocess.run(
            [*worker, "--output_dir", str(killed), "--kill"], capture_output=True, text=True, env=env, timeout=600
        )
        assert result.returncode != 0 and "SIGKILL" in result.stderr, result.stderr[-3000:]
        assert (killed / "checkpoint-1" / "trainer_state.json").exists() and not (killed / "checkpoint-2").exists()
    command = [*worker, "--output_dir", str(tmp_path / "run")]
    command += ["--resume_dir", str(killed)] if killed is not None else []
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

    # intermediate checkpoints stay sharded (torch.distributed.checkpoint folder), as the config asks
    assert (tmp_path / "run" / "checkpoint-1" / "pytorch_model_fsdp_0").is_dir()
    # the final saves hold what the single-process run wrote: same files, tensor names (no lm_head.weight beside
    # the tied embeddings) and values; they reload to the trained parameters
    single_final = tmp_path / "single" / "final"
    for final in [tmp_path / "run" / "final", (killed or tmp_path / "run") / "final"]:
        assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in single_final.iterdir())
        saved, expected = saved_weights(final, lora), saved_weights(single_final, lora)
        assert saved.keys() == expected.keys() and "lm_head.weight" not in saved
        assert max_relative_error(saved, expected) <= TOLERANCE
        reloaded = {n: p.detach() for n, p in load_saved(final, lora).named_parameters()}
        assert max_relative_error(reloaded, distributed["params"]) <= TOLERANCE
    if also_lora:  # LoRA under FSDP activation checkpointing: complete checkpoints, saves and resume
        lora_run, single_lora = tmp_path / "run" / "lora", tmp_path / "single_lora"
        _, single_params, _, single_losses = train_and_save(str(single_lora), True, per_device_batch=GLOBAL_BATCH)
        lora = distributed["lora"]
        assert lora["losses"] == pytest.approx(single_losses, rel=TOLERANCE)
        assert max_relative_error(lora["params"], single_params) <= TOLERANCE
        for written in ["checkpoint-1", "final"]:
            saved = saved_weights(lora_run / written, lora=True)
            expected = saved_weights(single_lora / written, lora=True)
            assert saved.keys() == expected.keys() and len(saved) > 0
            assert max_relative_error(saved, expected) <= TOLERANCE
        reloaded = {n: p.detach() for n, p in load_saved(lora_run / "final", True).named_parameters()}
        assert max_relative_error(reloaded, lora["params"]) <= TOLERANCE
        # resuming from checkpoint-1 loads its adapter: step 2 is repeated exactly (a restarted adapter is not)
        assert lora["resumed_losses"] == pytest.approx(lora["losses"], rel=TOLERANCE)
        assert max_relative_error(lora["resumed_params"], lora["params"]) <= TOLERANCE


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--resume_dir", default=None, help="resume from this run's checkpoint-1 (a killed launch)")
    parser.add_argument("--kill", action="store_true", help="SIGKILL every process right after checkpoint-1")
    parser.add_argument("--also_lora", action="store_true", help="also a LoRA run (and resume) in <output_dir>/lora")
    options = parser.parse_args()
    out = run(options.output_dir, options.lora, GLOBAL_BATCH // 2, resume_dir=options.resume_dir, kill=options.kill)
    if options.also_lora:
        out["lora"] = run(str(Path(options.output_dir) / "lora"), True, GLOBAL_BATCH // 2)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out, options.report)
    finish_launched_worker()
