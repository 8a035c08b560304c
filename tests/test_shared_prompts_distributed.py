"""``tree_share_across_microbatches`` (default ``None``) under ``accelerate launch`` with 2 CPU processes (gloo): plain
DDP and FSDP2 (``fsdp_configs/fsdp2_full.json``), full and LoRA (``fsdp2_lora.json``, GRPO only), issue 35 item 3.

The file is also the launched worker (``__main__``). One launch trains, in turn, TRL's ``GRPOTrainer`` (fixed
completions through TRL's ``rollout_func``), ``TreeGRPOTrainer``, TRL's ``RLOOTrainer`` (sampled completions: same
seed and weights, the same ones) and ``TreeRLOOTrainer``: 2 SGD steps of 2 accumulated micro-batches of 2 rows per
rank in float64 (RMSNorm too), so each rank holds one group of 4 cut across its 2 micro-batches in each step.
Oracle: TRL's trainer in the same launch (the tree passes change how log-probs are computed, nothing else): the same
update, and the same parameters on both ranks. That sharing ran is asserted from each rank's
``shared_prompt_stats``: one prompt piece per optimizer step, holding the rank's prompt minus its last token.
TRL's default non-reentrant gradient checkpointing is on.
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

from tests.helpers import (  # noqa: E402
    PROCESS_LAYOUTS,
    TRL_TOLERANCE,
    finish_launched_worker,
    launch_command,
    max_relative_error,
)

STEPS = 2
KINDS = ("grpo", "rloo")
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


def train(kind: str, tree: bool, lora: bool, model_path: str, output_dir: str) -> dict:
    """``STEPS`` SGD steps of GRPO or RLOO (TRL's class or the tree one) on the saved tiny model, full or LoRA; every
    rank's trained parameters (full tensors), the logged losses and (tree) every rank's ``shared_prompt_stats``."""
    from dataclasses import asdict

    from datasets import Dataset
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from hf_tree.distributed import enable_fsdp2_on_cpu
    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
    from tests.helpers import (
        FIXED_COMPLETIONS,
        fixed_rollout,
        float64_norms,
        tiny_trl_config,
        varied_reward,
        word_tokenizer,
    )

    enable_fsdp2_on_cpu()  # the tree configs do it themselves; TRL's own runs get the same sharded path
    classes = {
        "grpo": ((GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig)),
        "rloo": ((RLOOTrainer, RLOOConfig), (TreeRLOOTrainer, TreeRLOOConfig)),
    }
    trainer_class, config_class = classes[kind][tree]
    settings = dict(
        max_steps=STEPS,
        learning_rate=0.5,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        beta=0.1,
        seed=3,
    )
    trainer = trainer_class(
        model_path,
        varied_reward,
        tiny_trl_config(config_class, output_dir, torch.float64, **settings),
        train_dataset=Dataset.from_dict({"prompt": list(FIXED_COMPLETIONS)}),
        processing_class=word_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        if lora
        else None,
        **({"rollout_func": fixed_rollout} if kind == "grpo" else {}),
    )

    def trainable() -> dict[str, torch.Tensor]:
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for n, p in named}

    initial = trainable()
    with float64_norms():  # HF's RMSNorm upcasts to float32 only
        trainer.train()
    params = trainable()
    stats = asdict(trainer.shared_prompt_stats) if tree else None
    per_rank = [None] * trainer.accelerator.num_processes
    torch.distributed.all_gather_object(per_rank, (params, stats))
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "sharded": all(isinstance(p, DTensor) for p in trainer.model.parameters() if p.requires_grad),
        "updates": {n: p - initial[n] for n, p in params.items()},
        "params": [p for p, _ in per_rank],
        "stats": [s for _, s in per_rank],
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


@pytest.mark.parametrize(("distributed_type", "fsdp2", "replicate", "refused"), PROCESS_LAYOUTS)
def test_shares_on_two_processes_where_it_can(
    tmp_path, monkeypatch, caplog, distributed_type, fsdp2, replicate, refused
):
    """``_check_shared_prompts`` on 2 processes of each kind (a stand-in accelerator; the launched test runs DDP and
    FSDP2): the default shares and defers the gradient reduction under DDP/FSDP2; elsewhere it is off with one log
    line naming why, and ``True`` is refused."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from datasets import Dataset

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from tests.helpers import saved_tiny_model, tiny_trl_config, word_tokenizer, zero_reward

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = saved_tiny_model(tmp_path / "model", torch.float32)
    args = tiny_trl_config(TreeGRPOConfig, path, torch.float32, num_generations=4, max_completion_length=4)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trainer = TreeGRPOTrainer(path, zero_reward, args, **setup)
    parallelism = SimpleNamespace(dp_replicate_size=replicate, tp_size=1)
    for name, value in (
        ("num_processes", 2),
        ("distributed_type", getattr(DistributedType, distributed_type)),
        ("is_fsdp2", fsdp2),
        ("parallelism_config", parallelism),
    ):
        monkeypatch.setattr(Accelerator, name, property(lambda self, value=value: value))
    with caplog.at_level("INFO", logger="hf_tree"):
        trainer._check_shared_prompts()
    lines = [r.getMessage() for r in caplog.records if "shared-prompt policy pass is off" in r.getMessage()]
    if refused is None:
        assert trainer._shares_prompts() and trainer._defers_gradient_sync and not lines
        return
    assert not trainer._shares_prompts() and not trainer._defers_gradient_sync
    assert len(lines) == 1 and refused in lines[0]
    trainer.args.tree_share_across_microbatches = True
    with pytest.raises(ValueError, match=f"tree_share_across_microbatches.*{refused}"):
        trainer._check_shared_prompts()


def launch_config(tmp_path: Path, engine: str) -> Path:
    if engine.startswith("ddp"):
        config = tmp_path / "ddp.json"
        config.write_text(json.dumps(DDP_CONFIG))
        return config
    return REPO / "fsdp_configs" / f"{engine.replace('-', '_')}.json"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "ddp-lora", "fsdp2-full", "fsdp2-lora"])
def test_shared_prompts_on_two_processes_match_trl(tmp_path, engine):
    from tests.helpers import FIXED_COMPLETIONS, free_port, saved_tiny_model

    model_path = saved_tiny_model(tmp_path / "model", torch.float64)
    report = tmp_path / "report.pt"
    lora = engine.endswith("lora")
    worker = [__file__, model_path, str(tmp_path), str(report), str(lora)]
    command = [*launch_command(launch_config(tmp_path, engine)), *worker]
    command[command.index("--main_process_port") + 1] = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1"}
    if engine.startswith("ddp"):  # torchrun-launched processes without an accelerator: DDP on gloo (MULTI_CPU)
        env["ACCELERATE_USE_CPU"] = "true"
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    runs = torch.load(report)

    piece_tokens = STEPS * sum(len(prompt.split()) - 1 for prompt in FIXED_COMPLETIONS)  # one prompt per rank
    for kind in ("grpo",) if lora else KINDS:
        trl, tree = runs[kind]["trl"], runs[kind]["tree"]
        for run in (trl, tree):
            assert run["num_processes"] == 2
            if engine.startswith("ddp"):
                assert run["distributed_type"] == "DistributedType.MULTI_CPU"
            else:
                assert run["distributed_type"] == "DistributedType.FSDP" and run["sharded"]
            # the gradients were reduced: both ranks hold the same parameters
            assert max_relative_error(run["params"][1], run["params"][0]) == 0.0, kind
        # sharing ran on each rank: one piece (its group's prompt) per optimizer step
        assert [s["pieces"] for s in tree["stats"]] == [STEPS, STEPS], tree["stats"]
        assert sum(s["piece_tokens"] for s in tree["stats"]) == piece_tokens
        assert all(u.norm() > 0 for u in trl["updates"].values())  # every parameter moved: not trivially equal
        error = max_relative_error(tree["updates"], trl["updates"])
        print(f"{engine} {kind}: update vs TRL on 2 processes: relative {error:.2e}")
        assert error <= TRL_TOLERANCE, kind
        assert tree["losses"] == pytest.approx(trl["losses"], rel=TRL_TOLERANCE)


if __name__ == "__main__":
    model_path, output_dir, report, lora = sys.argv[1:5]
    out = {
        kind: {
            name: train(kind, name == "tree", lora == "True", model_path, str(Path(output_dir) / kind / name))
            for name in ("trl", "tree")
        }
        for kind in (("grpo",) if lora == "True" else KINDS)
    }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out, report)
    finish_launched_worker()
