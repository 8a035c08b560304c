"""``hf-tree sft|dpo|...``: TRL's CLI (its installed scripts, its flags, accelerate's flags) with the tree classes."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.trl.cli import TREE_COMMANDS, swap_tree_classes
from tests.helpers import SMOLLM2_VOCAB, tiny_model
from tests.workloads import prompt_completion_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", sorted(TREE_COMMANDS))
def test_trl_script_parser_gets_the_tree_config(command, monkeypatch, tmp_path):
    stem, module_name = TREE_COMMANDS[command]
    for kind in ("Config", "Trainer"):  # monkeypatch restores TRL's classes after the test
        monkeypatch.setattr(trl, stem + kind, getattr(trl, stem + kind))
    swap_tree_classes(command)
    tree_module = importlib.import_module(module_name)
    assert getattr(trl, f"{stem}Trainer") is getattr(tree_module, f"Tree{stem}Trainer")
    parser = importlib.import_module(f"trl.scripts.{command}").make_parser(prog=f"hf-tree {command}")
    argv = ["--output_dir", str(tmp_path), "--max_packed_tokens", "64", "--bf16", "False", "--num_processes", "2"]
    *parsed, _, remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    config = parsed[1]
    assert type(config) is getattr(tree_module, f"Tree{stem}Config") and config.max_packed_tokens == 64
    assert remaining == ["--num_processes", "2"]  # left to accelerate launch, as `trl` does


def test_trl_command_leaves_other_trl_names_alone(monkeypatch):
    monkeypatch.setattr(trl, "SFTConfig", trl.SFTConfig)
    monkeypatch.setattr(trl, "SFTTrainer", trl.SFTTrainer)
    dpo = trl.DPOTrainer
    swap_tree_classes("sft")
    assert trl.DPOTrainer is dpo and trl.SFTTrainer.__name__ == "TreeSFTTrainer"


@pytest.mark.slow
def test_hf_tree_sft_trains_with_the_tree_trainer(tmp_path):
    """`hf-tree sft` = `trl sft` with TreeSFTTrainer: TRL flags (--use_peft --lora_r), accelerate's
    (--num_processes) and tree flags (--max_packed_tokens) all reach the run, which logs tree metrics."""
    model_dir, data_dir, out = tmp_path / "model", tmp_path / "data", tmp_path / "out"
    tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa", tie_word_embeddings=True).save_pretrained(
        model_dir
    )
    load_smollm2_tokenizer().save_pretrained(model_dir)
    data_dir.mkdir()
    prompt_completion_dataset().to_json(data_dir / "train.jsonl")
    command = [sys.executable, "-m", "hf_tree.cli", "sft", "--num_processes", "1"]
    command += ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out)]
    command += ["--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--bf16", "False"]
    command += ["--report_to", "none", "--use_peft", "--lora_r", "4", "--max_packed_tokens", "512"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = result.stdout + result.stderr
    # the 4 rows share 2 prompts: the tree trainer merges them (TRL's SFTTrainer logs no dedup ratio)
    dedups = [float(value) for value in re.findall(r"'dedup_ratio': '([\d.]+)'", logs)]
    assert dedups and min(dedups) > 1.1 and "tree_tokens_per_second" in logs
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
