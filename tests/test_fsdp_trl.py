"""The TRL tree trainers under ``accelerate launch`` with an FSDP2 config on 2 CPU processes (gloo), issue 26 item 5.

The file is also the launched worker (``__main__``): it trains one optimizer step of ``TreeGRPOTrainer`` (fixed
completions through TRL's ``rollout_func``), ``TreeRLOOTrainer`` (sampled completions) or ``TreeDPOTrainer``, full
(``fsdp2_full.json``) or LoRA (``fsdp2_lora.json``), saves the final model with ``save_model``, and reports the
trained parameters (full tensors) and whether they were sharded. Oracle: TRL's own trainer in the same launch with
only the class swapped (the tree passes change how log-probs are computed, nothing else), and the saved files: they
hold, and reload to, exactly the parameters that were trained.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # launched as a script: make `hf_tree` and `tests` importable from the checkout
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers import finish_launched_worker, launch_command, max_relative_error  # noqa: E402

# float32 on gloo; TRL's fused kernel rounds differently for the padded batch and the packed tree (seen: 2e-6). Before
# the head was read after the backbone (hf_tree.trl.logprobs), the tree's lm_head update under FSDP2 was off by 0.85.
TOLERANCE = 1e-4


def train_and_save(kind: str, tree: bool, lora: bool, model_path: str, output_dir: str) -> dict:
    """One SGD step of GRPO or DPO (TRL's class or the tree one) on the saved tiny model, then ``save_model``."""
    from datasets import Dataset
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from hf_tree.distributed import enable_fsdp2_on_cpu
    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
    from tests.helpers import FIXED_COMPLETIONS, fixed_rollout, tiny_trl_config, varied_reward, word_tokenizer
    from tests.workloads import PREFERENCE_PAIRS

    enable_fsdp2_on_cpu()  # the tree configs do it themselves; TRL's own runs get the same sharded path
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False) if lora else None
    settings = dict(max_steps=1, learning_rate=0.5, per_device_train_batch_size=2, seed=3)
    if kind in ("grpo", "rloo"):  # RLOO has no rollout_func: it samples (same seed and weights in both launches)
        classes = {
            "grpo": ((GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig)),
            "rloo": ((RLOOTrainer, RLOOConfig), (TreeRLOOTrainer, TreeRLOOConfig)),
        }
        trainer_class, config_class = classes[kind][tree]
        group = dict(num_generations=4, max_completion_length=8, beta=0.1, gradient_accumulation_steps=2)
        trainer = trainer_class(
            model_path,
            varied_reward,
            tiny_trl_config(config_class, output_dir, torch.float32, **settings, **group),
            train_dataset=Dataset.from_dict({"prompt": list(FIXED_COMPLETIONS)}),
            processing_class=word_tokenizer(),
            peft_config=peft,
            **({"rollout_func": fixed_rollout} if kind == "grpo" else {}),
        )
    else:
        trainer_class, config_class = (TreeDPOTrainer, TreeDPOConfig) if tree else (DPOTrainer, DPOConfig)
        args = tiny_trl_config(config_class, output_dir, torch.float32, **settings)
        trainer = trainer_class(
            model_path,
            args=args,
            train_dataset=Dataset.from_dict(PREFERENCE_PAIRS),
            processing_class=word_tokenizer(),
            peft_config=peft,
        )
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": all(isinstance(p, DTensor) for _, p in named),
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in named},
    }


def saved_trainable(final: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The saved tensors of the trained parameters, under the trainer's parameter names."""
    if lora:  # PEFT saves "<module>.lora_A.weight" for the parameter "<module>.lora_A.default.weight"
        saved = load_file(final / "adapter_model.safetensors")
        return {re.sub(r"\.(lora_[AB])\.weight$", r".\1.default.weight", n): t for n, t in saved.items()}
    return load_file(final / "model.safetensors")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, lora",
    [("grpo", False), ("grpo", True), ("rloo", False), ("dpo", False)],
    ids=["grpo", "grpo-lora", "rloo", "dpo"],
)
def test_trl_tree_trainer_under_fsdp2_trains_and_saves_as_trl(tmp_path, kind, lora):
    from tests.helpers import saved_tiny_model

    model_path = saved_tiny_model(tmp_path / "model", torch.float32)
    config = REPO / "fsdp_configs" / ("fsdp2_lora.json" if lora else "fsdp2_full.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1"}
    reports = {}
    for tree in (False, True):
        name = "tree" if tree else "trl"
        report = tmp_path / f"{name}.pt"
        worker = [*launch_command(config), __file__, kind, name, str(lora), model_path, str(tmp_path / name)]
        result = subprocess.run([*worker, str(report)], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        reports[name] = torch.load(report)
    for report in reports.values():
        assert report["distributed_type"] == "DistributedType.FSDP" and report["sharded"]
    trl, tree = reports["trl"]["params"], reports["tree"]["params"]
    assert trl.keys() == tree.keys()
    assert max_relative_error(tree, trl) <= TOLERANCE
    # the final save holds the trained parameters (FSDP2 sharded state dicts are gathered by FSDPFullSaveMixin)
    saved = saved_trainable(tmp_path / "tree" / "final", lora)
    trained = {n.removeprefix("base_model.model.") if not lora else n: t for n, t in tree.items()}
    assert trained.keys() <= saved.keys(), sorted(trained.keys() - saved.keys())[:5]
    assert max_relative_error({n: saved[n] for n in trained}, trained) == 0.0
    if not lora:  # the step moved the weights (an update of zero would match TRL trivially)
        initial = load_file(Path(model_path) / "model.safetensors")
        assert all(not torch.equal(trained[n], initial[n]) for n in initial if "layers.0." in n)


if __name__ == "__main__":
    kind, name, lora, model_path, output_dir, report = sys.argv[1:7]
    out = train_and_save(kind, name == "tree", lora == "True", model_path, output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out, report)
    finish_launched_worker()
