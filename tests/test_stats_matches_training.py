"""``hf-tree stats`` reports what ``hf-tree sft`` does with its defaults: in-batch merging in TRL's micro-batches.

Conversations sharing a system prompt, written as a folder of .jsonl rows (what ``--dataset_name`` takes) beside a
tiny model folder holding its tokenizer. ``TreeSFTTrainer`` runs the epoch and logs ``dedup_ratio`` every step;
``hf-tree stats`` on the same folder, tokenizer and batch flags must report those exact numbers (same floats: both
divide the same integer token counts), per step and over the epoch, in TRL's random order and in sequential order.
The end-to-end check runs the real ``hf-tree sft`` command with TRL's defaults.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from hf_tree.cli import main
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import saved_tiny_model, word_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (  # word-tokenizer chat template (w5 = user/system start, w6 = assistant start, w7 = end of turn)
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ 'w6 ' }}{%- generation -%}{{ m.content + ' w7 ' }}{%- endgeneration -%}"
    "{%- else -%}{{ 'w5 ' + m.content + ' w7 ' }}{%- endif -%}"
    "{%- endfor -%}"
)
SYSTEM = "w40 w41 w42 w43 w44 w45 w46 w47"


def _conversations(num: int, seed: int = 0) -> list[dict]:
    """``num`` rows sharing only the system prompt; a few also share the first user turn (varied lengths, so the
    order the rows are batched in changes each step's dedup)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        user = "w10 w11 w12" if i % 3 == 0 else " ".join(f"w{rng.randrange(13, 60)}" for _ in range(rng.randint(1, 4)))
        answer = " ".join(f"w{rng.randrange(13, 60)}" for _ in range(rng.randint(1, 5)))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, str]:
    """(model folder with its tokenizer, data folder of .jsonl rows)."""
    root = tmp_path_factory.mktemp("stats_matches_training")
    model = saved_tiny_model(root / "model", torch.float32)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _conversations(11)))
    return model, str(data)


@pytest.mark.parametrize("strategy", ["random", "sequential"])
def test_stats_reports_the_dedup_the_trainer_logs(setup, strategy, tmp_path, capsys):
    model, data = setup
    batch = ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2"]
    batch += ["--train_sampling_strategy", strategy, "--max_packed_tokens", "30"]  # some merged batches over 30
    main(["stats", data, "--model_name_or_path", model, *batch, "--json"])
    report = json.loads(capsys.readouterr().out)
    steps = report["step_dedup_ratios"]
    assert len(steps) == 2  # 11 rows, 6 per step
    assert report["training_dedup_ratio"] > report["dedup_ratio"] == 1.0  # one tree per row: merging is the saving
    assert report["packing"]["num_split_trees"] == 0 and report["num_depth_first_trees"] > 0  # auto, as the trainer

    args = TreeSFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        train_sampling_strategy=strategy,
        max_packed_tokens=30,
        logging_steps=1,
        num_train_epochs=1,
        save_strategy="no",
    )
    dataset = datasets.load_dataset("json", data_files=str(Path(data) / "train.jsonl"), split="train")
    trainer = TreeSFTTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    logged = [log["dedup_ratio"] for log in trainer.state.log_history if "loss" in log]
    assert logged == steps  # exactly: the same micro-batches, merged and packed the same way
    tokens = [log["num_tokens"] for log in trainer.state.log_history if "loss" in log]
    assert tokens[-1] == report["packing"]["num_branch_tokens"]  # every row of the epoch trained once


@pytest.mark.slow
def test_hf_tree_sft_saves_by_default(setup, tmp_path):
    """A new user's first run: `hf-tree sft` with TRL's defaults (batch size 8, its logging, max_length, random
    order) and only what running offline on CPU needs logs dedup_ratio > 1 on conversations sharing a system prompt,
    and `hf-tree stats` on the same folder reports the same number."""
    model, _ = setup
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _conversations(16, seed=1)))
    command = [sys.executable, "-m", "hf_tree.cli", "sft", "--model_name_or_path", model, "--dataset_name", str(data)]
    command += ["--max_steps", "2", "--report_to", "none", "--bf16", "False"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = re.findall(r"'dedup_ratio': '?([0-9.]+)", result.stdout + result.stderr)
    assert logged and all(float(ratio) > 1.2 for ratio in logged), logged
    stats = subprocess.run(
        [sys.executable, "-m", "hf_tree.cli", "stats", str(data), "--model_name_or_path", model, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stats.returncode == 0, stats.stderr[-3000:]
    # 16 rows at TRL's batch size 8: 2 steps, logged together at the end (logging_steps=10)
    assert float(logged[-1]) == pytest.approx(json.loads(stats.stdout)["training_dedup_ratio"], rel=1e-4)
