"""The tree trainers under TRL's DeepSpeed configs (``trl/accelerate_configs/zero{2,3}.yaml``) on 2 CPU processes.

The file is also the launched worker (``__main__``): one launch per ZeRO stage trains, each for 2 SGD steps (float32)
from the same saved tiny model, ``TreeTrainer`` and its oracle ``Trainer`` on the branches, ``TreeSFTTrainer`` and
TRL's ``SFTTrainer``, ``TreeGRPOTrainer`` and TRL's ``GRPOTrainer`` (fixed completions through ``rollout_func``), and
saves each final model with ``save_model``. Oracle: the twin's update under the same config. The saved files (ZeRO-3
gathers the partitioned parameters for them) must hold every tensor of the model, and the tree update must equal the
twin's within ``TOLERANCE``. Only ``--num_processes 2 --mixed_precision no`` change TRL's files.
"""

from __future__ import annotations

import importlib.util
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

from tests.helpers import finish_launched_worker, launch_command  # noqa: E402

# float32 on gloo, DeepSpeed's bucketed reductions and TRL's fused head kernel round differently (seen: ~3e-6)
TOLERANCE = 1e-4
PAIRS = ("trainer", "sft", "grpo")
STAGES = (2, 3)
TWINS = ("trl", "tree")
SFT_ROWS = {
    "prompt": ["w10 w11 w12 w13", "w10 w11 w12 w13", "w14 w15", "w16 w17 w18"],
    "completion": [" w20 w21", " w20 w22 w23", " w24", " w25 w26 w27"],
}


def trl_config_file(stage: int) -> Path:
    """TRL's own accelerate config for ZeRO ``stage``, read from the installed package."""
    return Path(importlib.util.find_spec("trl").origin).parent / "accelerate_configs" / f"zero{stage}.yaml"


def build(pair: str, tree: bool, model_path: str, output_dir: str):
    """The trainer of ``pair`` (the tree one or its oracle) on the tiny model saved at ``model_path``: 2 SGD steps
    of 2 rows per process, sequential order, no clipping."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
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
    from tests.workloads import branch_dataset, branch_groups, tree_dataset

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
    args = exact_sgd_args(output_dir, **settings)
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
    if pair == "sft":
        config_class, trainer_class = (TreeSFTConfig, TreeSFTTrainer) if tree else (SFTConfig, SFTTrainer)
        return trainer_class(
            model_path,
            args=config_class(**trl_args),
            train_dataset=Dataset.from_dict(SFT_ROWS),
            processing_class=word_tokenizer(),
        )
    config_class, trainer_class = (TreeGRPOConfig, TreeGRPOTrainer) if tree else (GRPOConfig, GRPOTrainer)
    group = dict(num_generations=4, max_completion_length=8, beta=0.1, gradient_accumulation_steps=2)
    return trainer_class(
        model_path,
        varied_reward,
        config_class(**trl_args | group | {"max_steps": 1}),
        train_dataset=Dataset.from_dict({"prompt": list(FIXED_COMPLETIONS)}),
        processing_class=word_tokenizer(),
        rollout_func=fixed_rollout,
    )


def train_pairs(model_path: str, output_dir: str) -> dict:
    """Train and ``save_model`` every pair (oracle, then tree) to ``output_dir/<pair>-<trl|tree>``."""
    out = {}
    for pair in PAIRS:
        for tree in (False, True):
            name = f"{pair}-{'tree' if tree else 'trl'}"
            trainer = build(pair, tree, model_path, str(Path(output_dir) / name))
            trainer.train()
            trainer.save_model(str(Path(output_dir) / name / "final"))
            out[name] = {
                "distributed_type": str(trainer.accelerator.distributed_type),
                "num_processes": trainer.accelerator.num_processes,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            }
    return out


def relative_update_error(tree: dict, oracle: dict, initial: dict) -> float:
    """Largest relative difference between the two runs' updates of any tensor."""
    errors = []
    for name, start in initial.items():
        expected = oracle[name] - start
        errors.append(float((tree[name] - start - expected).norm() / expected.norm().clamp_min(1e-30)))
    return max(errors)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{s}" for s in STAGES])
def test_tree_trainers_under_trl_deepspeed_config_equal_trl(tmp_path, stage, deepspeed_extensions):
    from tests.helpers import saved_tiny_model

    model_path = saved_tiny_model(tmp_path / "model", torch.float32)
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "TORCH_EXTENSIONS_DIR": str(deepspeed_extensions),
    }
    command = [*launch_command(trl_config_file(stage)), __file__, model_path, str(tmp_path / "run"), str(report)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    runs = json.loads(report.read_text())
    initial = load_file(Path(model_path) / "model.safetensors")
    for pair in PAIRS:
        oracle, tree = runs[f"{pair}-trl"], runs[f"{pair}-tree"]
        assert tree["distributed_type"] == "DistributedType.DEEPSPEED" and tree["num_processes"] == 2
        assert tree["losses"] == pytest.approx(oracle["losses"], rel=TOLERANCE), pair
        saved = {t: load_file(tmp_path / "run" / f"{pair}-{t}" / "final" / "model.safetensors") for t in TWINS}
        # complete: every tensor of the model at its full shape (ZeRO-3 holds empty shards outside forward)
        for weights in saved.values():
            assert {n: t.shape for n, t in weights.items()} == {n: t.shape for n, t in initial.items()}, pair
        assert relative_update_error(saved["tree"], saved["trl"], initial) <= TOLERANCE, pair
        assert any(not torch.equal(saved["trl"][n], t) for n, t in initial.items()), pair  # the step moved weights


if __name__ == "__main__":
    model_path, output_dir, report = sys.argv[1:4]
    out = train_pairs(model_path, output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(report).write_text(json.dumps(out))
    finish_launched_worker()
