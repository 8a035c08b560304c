"""``hf-tree stats`` reports what ``hf-tree sft`` does with its defaults: in-batch merging in TRL's micro-batches.

Rows sharing a system prompt (conversations as ``messages``, ``text`` and ``prompt``/``completion`` rows), written as
a folder of .jsonl rows (what ``--dataset_name`` takes) beside a tiny model folder holding its tokenizer.
``TreeSFTTrainer`` runs the epoch and logs ``dedup_ratio`` every step; ``hf-tree stats`` on the same folder, model
and batch flags must report those exact numbers (same floats: both divide the same integer token counts), per step
and over the epoch, in TRL's random order and in sequential order. The end-to-end check runs the real ``hf-tree sft``
command with TRL's defaults.
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
import transformers

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
    order the rows are batched in changes each step's dedup). Every third row has two assistant turns: one branch
    per conversation (TRL's rows, ``hf-tree sft``'s default) differs from one branch per turn."""
    rng = random.Random(seed)
    words = lambda low, high: " ".join(f"w{rng.randrange(13, 60)}" for _ in range(rng.randint(low, high)))  # noqa: E731
    rows = []
    for i in range(num):
        user = "w10 w11 w12" if i % 3 == 0 else words(1, 4)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        messages.append({"role": "assistant", "content": words(1, 5)})
        if i % 3 == 1:
            messages += [{"role": "user", "content": words(1, 3)}, {"role": "assistant", "content": words(1, 3)}]
        rows.append({"messages": messages})
    return rows


def _rows(data_format: str, num: int, seed: int = 0) -> list[dict]:
    """The conversations of ``_conversations`` in ``data_format``: ``messages``, ``text`` (the words of the whole
    conversation) or ``prompt/completion`` (the words before the last assistant message, and that message)."""
    conversations = _conversations(num, seed)
    if data_format == "messages":
        return conversations
    rows = []
    for row in conversations:
        prompt = " ".join(m["content"] for m in row["messages"][:-1])
        completion = row["messages"][-1]["content"]
        text_row = {"text": f"{prompt} {completion}"}
        rows.append(text_row if data_format == "text" else {"prompt": prompt, "completion": completion})
    return rows


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny model folder holding its word tokenizer (with a chat template)."""
    root = tmp_path_factory.mktemp("stats_matches_training")
    path = saved_tiny_model(root / "model", torch.float32)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _data_folder(root: Path, data_format: str, num: int, seed: int = 0) -> str:
    """A folder of .jsonl rows (what ``--dataset_name`` takes)."""
    root.mkdir()
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(data_format, num, seed)))
    return str(root)


@pytest.mark.parametrize(
    ("data_format", "strategy"),
    [
        ("messages", "random"),
        ("prompt/completion", "random"),
        pytest.param("messages", "sequential", marks=pytest.mark.slow),
        pytest.param("text", "random", marks=pytest.mark.slow),
    ],
)
def test_stats_reports_the_dedup_the_trainer_logs(model, data_format, strategy, tmp_path, capsys):
    """Each format at the trainer's defaults: the branches (one per conversation for messages rows), micro-batches
    and per-step dedup_ratio that `hf-tree stats` reports are the ones a real run logs."""
    data = _data_folder(tmp_path / "data", data_format, 11)
    batch = ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2"]
    batch += ["--train_sampling_strategy", strategy, "--max_packed_tokens", "30"]  # some merged batches over 30
    main(["stats", data, "--model_name_or_path", model, *batch, "--json"])
    report = json.loads(capsys.readouterr().out)
    steps = report["step_dedup_ratios"]
    assert len(steps) == 2 and report["num_batches"] == 4  # 11 rows, 6 per step
    assert report["training_dedup_ratio"] > 1.0  # rows share the system prompt: merging in batch is the saving
    assert report["num_branches"] == 11  # one per row: TRL's rows (messages rows: the conversation, not its turns)

    logged, tokens = _train(model, data, strategy, tmp_path)
    assert logged == steps  # exactly: the same trees and micro-batches, merged and packed the same way
    assert tokens[-1] == report["packing"]["num_branch_tokens"]  # every row of the epoch trained once


def _train(model: str, data: str, strategy: str, tmp_path: Path) -> tuple[list[float], list[float]]:
    """(each step's logged dedup_ratio, num_tokens) of a real epoch at the stats tests' batch flags."""
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
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return [log["dedup_ratio"] for log in logs], [log["num_tokens"] for log in logs]


@pytest.mark.slow  # the slots of rows that train nothing; the default dealing is the fast test above
def test_stats_deals_rows_that_train_nothing_into_their_slots(model, tmp_path, capsys):
    """Text rows "" are TRL's [EOS] alone: no trained token, a batch slot each (TreeSFTTrainer.tree_row_slots).
    Without the slots stats dealt 9 rows where the trainer deals 11: other micro-batches, other per-step dedup."""
    rows = _rows("text", 11)
    for empty in (1, 6):
        rows[empty] = {"text": ""}
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    batch = ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2"]
    main(["stats", str(data), "--model_name_or_path", model, *batch, "--max_packed_tokens", "30", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["num_batches"] == 4 and report["num_branches"] == 9  # TRL's 4 micro-batches of 11 rows
    logged, _ = _train(model, str(data), "random", tmp_path)
    assert logged == report["step_dedup_ratios"]


def test_stats_follows_the_training_flags(model, tmp_path, capsys):
    """A flag of `hf-tree sft` that changes the trees changes the report: per-turn branches of messages rows, and the
    FLOP estimate uses the named model's shape (its config), not SmolLM2-135M's."""
    data = _data_folder(tmp_path / "data", "messages", 6)
    main(["stats", data, "--model_name_or_path", model, "--json"])
    conversation = json.loads(capsys.readouterr().out)
    main(["stats", data, "--model_name_or_path", model, "--messages_branches", "per_turn", "--json"])
    per_turn = json.loads(capsys.readouterr().out)
    assert conversation["num_branches"] == 6 and per_turn["num_branches"] == 6 + 2  # rows 1 and 4 have two turns
    config = transformers.AutoConfig.from_pretrained(model)
    shape = conversation["model_shape"]
    assert (shape["num_layers"], shape["hidden_size"]) == (config.num_hidden_layers, config.hidden_size)
    assert conversation["model_shape_source"] == f"{model}'s config"


@pytest.mark.slow
def test_hf_tree_sft_saves_by_default(model, tmp_path):
    """A new user's first run: `hf-tree sft` with TRL's defaults (batch size 8, its logging, max_length, random
    order) and only what running offline on CPU needs logs dedup_ratio > 1 on conversations sharing a system prompt,
    and `hf-tree stats` on the same folder reports the same number."""
    data = _data_folder(tmp_path / "data", "messages", 16, seed=1)
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
