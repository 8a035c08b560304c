"""The tree trainers under TRL's DeepSpeed configs (``trl/accelerate_configs/zero{2,3}.yaml``) on 2 CPU processes.

The file is also the launched worker (``__main__``): one launch per ZeRO stage trains, each for 2 SGD steps (float32)
from the same saved tiny model, ``TreeTrainer`` and its oracle ``Trainer`` on the branches, ``TreeSFTTrainer`` and
TRL's ``SFTTrainer``, ``TreeGRPOTrainer`` and TRL's ``GRPOTrainer`` (fixed completions through ``rollout_func``), and
saves each final model with ``save_model``. Oracle: the twin's update under the same config. The saved files (ZeRO-3
gathers the partitioned parameters for them) must hold every tensor of the model, and the tree update must equal the
twin's within ``TOLERANCE``. Only ``--num_processes 2 --mixed_precision no`` change TRL's files (the offload test
also sets both offload devices to ``cpu``). Further launches: resume from a ZeRO checkpoint (oracle: the uninterrupted
run) per stage, and SFT under ZeRO-3 with CPU offload (oracle: TRL's ``SFTTrainer``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # launched as a script: make `hf_tree` and `tests` importable from the checkout
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers import finish_launched_worker, launch_command  # noqa: E402

# float32 on gloo, DeepSpeed's bucketed reductions and TRL's fused head kernel round differently (seen: ~3e-6)
TOLERANCE = 1e-4
# ZeRO-3 (parameters partitioned: the hard case) runs every trainer; ZeRO-2 the three that read the head themselves
PAIRS = {
    2: ("trainer", "sft", "grpo", "dpo-lora", "grpo-lora"),
    3: ("trainer", "sft", "sft-lora", "grpo", "rloo", "dpo", "kto", "reward", "dpo-lora", "grpo-lora"),
}
STAGES = tuple(PAIRS)
TWINS = ("trl", "tree")  # indexed by "is the tree trainer"
SFT_ROWS = {
    "prompt": ["w10 w11 w12 w13", "w10 w11 w12 w13", "w14 w15", "w16 w17 w18"],
    "completion": [" w20 w21", " w20 w22 w23", " w24", " w25 w26 w27"],
}


def trl_config_file(stage: int) -> Path:
    """TRL's own accelerate config for ZeRO ``stage``, read from the installed package."""
    return Path(importlib.util.find_spec("trl").origin).parent / "accelerate_configs" / f"zero{stage}.yaml"


def build(pair: str, tree: bool, model_path: str, output_dir: str, **overrides):
    """The trainer of ``pair`` (the tree one or its oracle; ``-lora``: a LoRA adapter) on the tiny model saved at
    ``model_path``: 2 SGD steps of 2 rows per process (GRPO/RLOO: one step of 2 micro-batches), sequential order, no
    clipping; ``overrides`` change these training arguments."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from trl import (
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        KTOConfig,
        KTOTrainer,
        RewardConfig,
        RewardTrainer,
        RLOOConfig,
        RLOOTrainer,
        SFTConfig,
        SFTTrainer,
    )

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
    from hf_tree.trl.reward import TreeRewardConfig, TreeRewardTrainer
    from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.helpers import (
        FIXED_COMPLETIONS,
        branch_loss_func,
        collate_branches,
        exact_sgd_args,
        fixed_rollout,
        varied_reward,
        word_tokenizer,
    )
    from tests.workloads import KTO_ROWS, PREFERENCE_PAIRS, REWARD_PAIRS, branch_dataset, branch_groups, tree_dataset

    # ddp_backend: accelerate finds no backend on a machine without a GPU and would run each process alone (the
    # DeepSpeed engine then refuses the batch size); on GPUs it picks nccl itself
    settings = dict(
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=0.5,
        seed=3,
        train_sampling_strategy="sequential",
        ddp_backend="gloo",
    )
    args = exact_sgd_args(output_dir, **settings | overrides)
    if pair == "trainer":
        groups = branch_groups(seed=5, num_trees=8)
        if tree:
            args = TreeTrainingArguments(**args, max_packed_tokens=64)
        else:
            args = TrainingArguments(**args, remove_unused_columns=False)
        # after the arguments: under ZeRO-3 from_pretrained then partitions the weights as it loads (zero.Init)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if tree:
            return TreeTrainer(model=model, args=args, train_dataset=tree_dataset(groups))
        return Trainer(
            model=model,
            args=args,
            train_dataset=branch_dataset(groups),
            data_collator=collate_branches,
            compute_loss_func=branch_loss_func("token", 0),
        )
    trl_args = dict(bf16=False, model_init_kwargs={"dtype": torch.float32}, **args)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    common = dict(processing_class=word_tokenizer(), peft_config=lora if pair.endswith("lora") else None)
    twins = {
        "sft": (SFTConfig, SFTTrainer, TreeSFTConfig, TreeSFTTrainer, SFT_ROWS),
        "dpo": (DPOConfig, DPOTrainer, TreeDPOConfig, TreeDPOTrainer, PREFERENCE_PAIRS),
        "kto": (KTOConfig, KTOTrainer, TreeKTOConfig, TreeKTOTrainer, KTO_ROWS),
        "reward": (RewardConfig, RewardTrainer, TreeRewardConfig, TreeRewardTrainer, REWARD_PAIRS),
        "grpo": (GRPOConfig, GRPOTrainer, TreeGRPOConfig, TreeGRPOTrainer, {"prompt": list(FIXED_COMPLETIONS)}),
        "rloo": (RLOOConfig, RLOOTrainer, TreeRLOOConfig, TreeRLOOTrainer, {"prompt": list(FIXED_COMPLETIONS)}),
    }
    kind = pair.removesuffix("-lora")
    config_class, trainer_class = twins[kind][2:4] if tree else twins[kind][:2]
    dataset = Dataset.from_dict({k: v for k, v in twins[kind][4].items() if k != "margin"})
    if kind in ("grpo", "rloo"):  # RLOO has no rollout_func: it samples (same seed and weights for both)
        group = dict(num_generations=4, max_completion_length=8, beta=0.1, gradient_accumulation_steps=2, max_steps=1)
        rollout = {"rollout_func": fixed_rollout} if kind == "grpo" else {}
        config = config_class(**trl_args | group)
        return trainer_class(model_path, varied_reward, config, train_dataset=dataset, **common, **rollout)
    return trainer_class(model_path, args=config_class(**trl_args), train_dataset=dataset, **common)


def train_and_save(trainer, final: Path, resume_from_checkpoint: str | None = None) -> dict:
    """``train`` (from ``resume_from_checkpoint`` if given), ``save_model`` to ``final``; what the test checks."""
    from transformers import TrainerCallback

    steps_run = []

    class CountSteps(TrainerCallback):  # a resumed run must run only the steps after its checkpoint
        def on_step_end(self, args, state, control, **kwargs):
            steps_run.append(state.global_step)

    trainer.add_callback(CountSteps)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(str(final))
    return {
        "steps_run": steps_run,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "global_step": trainer.state.global_step,
    }


def train_pairs(pairs: Sequence[str], model_path: str, output_dir: str, **overrides) -> dict:
    """Train and ``save_model`` every pair (oracle, then tree) to ``output_dir/<pair>-<trl|tree>``, each trainer
    built after the same seed (LoRA adapters and the reward head start equal); ``overrides`` as in ``build``."""
    from transformers import set_seed

    out = {}
    for pair in pairs:
        for tree in (False, True):
            name = f"{pair}-{TWINS[tree]}"
            set_seed(3)
            trainer = build(pair, tree, model_path, str(Path(output_dir) / name), **overrides)
            out[name] = train_and_save(trainer, Path(output_dir) / name / "final")
    return out


# AdamW (its moments live in the ZeRO checkpoint: a resume that lost them would step differently), a checkpoint every
# step, one row per process: 2 steps per epoch, so the resume from checkpoint-1 starts mid-epoch (skips a batch)
RESUME_SETTINGS = dict(
    optim="adamw_torch",
    learning_rate=1e-2,
    per_device_train_batch_size=1,
    max_steps=3,
    save_strategy="steps",
    save_steps=1,
)
RESUME_FROM = 1
# Offload sums the reduced gradients in another order; at lr 0.5 the first step moves the tiny model's weights ~30x
# their size and the second step amplifies that rounding to ~1e-4: a smaller step keeps the comparison at float32 level.
# Clipping off: with clipping at 1.0 the gap measured 1.2e-4 (4.1e-5 without; 7.4e-6 without offload), cause not found
# (docs/training.md, DeepSpeed).
OFFLOAD_SETTINGS = dict(learning_rate=0.05, max_grad_norm=0.0)


def train_resumed(model_path: str, output_dir: str) -> dict:
    """``TreeSFTTrainer`` uninterrupted (``output_dir/whole``, saving ZeRO checkpoints) and resumed from its
    ``checkpoint-RESUME_FROM`` by a fresh trainer (``output_dir/resumed``); each saves its final model."""
    from transformers import set_seed

    out = {}
    for name in ("whole", "resumed"):
        set_seed(3)
        trainer = build("sft", True, model_path, str(Path(output_dir) / name), **RESUME_SETTINGS)
        checkpoint = str(Path(output_dir) / "whole" / f"checkpoint-{RESUME_FROM}") if name == "resumed" else None
        out[name] = train_and_save(trainer, Path(output_dir) / name / "final", checkpoint)
    return out


def saved_weights(final: Path) -> dict[str, torch.Tensor]:
    """What ``save_model`` wrote: the adapter of a LoRA run, else the model."""
    adapter = final / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else final / "model.safetensors")


def relative_update_error(tree: dict, oracle: dict, initial: dict) -> float:
    """Largest relative difference between the two runs' updates of any tensor (from ``initial``, or from zero for
    tensors the initial model lacks: adapters, a reward head), less the tensor's own storage rounding.

    Both runs store float32 parameters: two updates that differ only below the stored values' resolution round to
    values one ulp apart (a norm weight of ~1 updated by ~1e-5 per entry: one ulp is 6e-8, a relative "error" of
    ~1e-4 on a machine without AVX-512, where the kernels' roundings differ). A difference within ``eps * |value|``
    is that rounding, not a gradient difference; anything above it is measured against the update."""
    errors = []
    for name, value in oracle.items():
        expected = value - initial.get(name, torch.zeros_like(value))
        storage_rounding = torch.finfo(value.dtype).eps * value.norm()
        beyond_rounding = ((tree[name] - value).norm() - storage_rounding).clamp_min(0)
        errors.append(float(beyond_rounding / expected.norm().clamp_min(1e-30)))
    return max(errors)


def launch(config: Path, what: str, tmp_path: Path, extensions: Path) -> tuple[subprocess.CompletedProcess, dict, str]:
    """``accelerate launch`` of this file's worker (``what``: see ``__main__``) under ``config`` on 2 processes from a
    fresh tiny model; returns the finished launch, rank 0's report and the model's path."""
    from tests.helpers import saved_tiny_model

    model_path = saved_tiny_model(tmp_path / "model", torch.float32)
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(extensions)}
    command = [*launch_command(config), __file__, what, model_path, str(tmp_path / "run"), str(report)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result, json.loads(report.read_text()), model_path


def assert_pairs_equal(runs: dict, pairs: Sequence[str], run_dir: Path, model_path: str) -> None:
    """Each pair's tree run equals its oracle's under DeepSpeed on 2 processes: losses, and complete saved weights
    whose update (from the initial model) matches within ``TOLERANCE``."""
    initial = load_file(Path(model_path) / "model.safetensors")
    for pair in pairs:
        oracle, tree = runs[f"{pair}-trl"], runs[f"{pair}-tree"]
        assert tree["distributed_type"] == "DistributedType.DEEPSPEED" and tree["num_processes"] == 2
        assert tree["losses"] == pytest.approx(oracle["losses"], rel=TOLERANCE), pair
        saved = {t: saved_weights(run_dir / f"{pair}-{t}" / "final") for t in TWINS}
        # complete: the oracle's tensors at their full shapes (ZeRO-3 holds empty shards outside forward)
        shapes = {n: t.shape for n, t in saved["trl"].items()}
        assert {n: t.shape for n, t in saved["tree"].items()} == shapes, pair
        assert all(shapes[n] == t.shape for n, t in initial.items() if n in shapes), pair
        assert relative_update_error(saved["tree"], saved["trl"], initial) <= TOLERANCE, pair
        moved = [not torch.equal(t, initial.get(n, torch.zeros_like(t))) for n, t in saved["trl"].items()]
        assert any(moved), pair  # the step moved weights (equal zero updates would pass trivially)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{s}" for s in STAGES])
def test_tree_trainers_under_trl_deepspeed_config_equal_trl(tmp_path, stage, deepspeed_extensions):
    result, runs, model_path = launch(trl_config_file(stage), ",".join(PAIRS[stage]), tmp_path, deepspeed_extensions)
    # TreeTrainer/TreeSFTTrainer default to tree_execution="auto": packed under DeepSpeed, said once per trainer
    fallback = "tree_execution='auto' runs as 'packed' here (DeepSpeed"
    assert result.stderr.count(fallback) == 2 * len({"trainer", "sft", "sft-lora"} & set(PAIRS[stage])), fallback
    assert_pairs_equal(runs, PAIRS[stage], tmp_path / "run", model_path)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{s}" for s in STAGES])
def test_resume_from_zero_checkpoint_equals_uninterrupted_run(tmp_path, stage, deepspeed_extensions):
    """Oracle: the same ``TreeSFTTrainer`` run without interruption; the resumed run restores weights, AdamW moments,
    scheduler and data position from the ZeRO checkpoint and must end at the same weights (float32 level)."""
    _, runs, model_path = launch(trl_config_file(stage), "resume", tmp_path, deepspeed_extensions)
    steps = RESUME_SETTINGS["max_steps"]
    assert runs["whole"]["steps_run"] == list(range(1, steps + 1))
    assert runs["resumed"]["steps_run"] == list(range(RESUME_FROM + 1, steps + 1))  # only the rest: it resumed
    assert runs["resumed"]["losses"] == pytest.approx(runs["whole"]["losses"], rel=TOLERANCE)
    initial = load_file(Path(model_path) / "model.safetensors")
    whole, resumed = (saved_weights(tmp_path / "run" / name / "final") for name in ("whole", "resumed"))
    assert {n: t.shape for n, t in resumed.items()} == {n: t.shape for n, t in initial.items()}
    assert relative_update_error(resumed, whole, initial) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
def test_sft_under_zero3_cpu_offload_equals_trl(tmp_path, deepspeed_extensions):
    """TRL's zero3.yaml with ``offload_optimizer_device`` and ``offload_param_device`` set to ``cpu``: parameters and
    optimizer state live in host memory between uses (the first launch JIT-compiles DeepSpeed's ``cpu_adam`` op,
    ~7 min on a loaded 2-core machine, cached in ``deepspeed_extensions``)."""
    config = trl_config_file(3).read_text()
    for field in ("offload_optimizer_device", "offload_param_device"):
        assert f"{field}: none" in config, field
        config = config.replace(f"{field}: none", f"{field}: cpu")
    (tmp_path / "zero3_offload.yaml").write_text(config)
    _, runs, model_path = launch(tmp_path / "zero3_offload.yaml", "offload", tmp_path, deepspeed_extensions)
    assert_pairs_equal(runs, ("sft",), tmp_path / "run", model_path)


if __name__ == "__main__":  # what: "resume", "offload" or the comma-separated pairs to train
    what, model_path, output_dir, report = sys.argv[1:5]
    if what == "resume":
        out = train_resumed(model_path, output_dir)
    elif what == "offload":
        out = train_pairs(("sft",), model_path, output_dir, **OFFLOAD_SETTINGS)
    else:
        out = train_pairs(what.split(","), model_path, output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(report).write_text(json.dumps(out))
    finish_launched_worker()
