"""A failed ``hf-tree`` command ends with one line naming the cause and the fix (``hf_tree.cli_messages``), run as a
user runs it (a subprocess), also from a folder holding a folder named ``hf_tree``; ``HF_TREE_DEBUG=1`` shows the
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.cli import main
from hf_tree.cli_messages import closest, plain
from tests.helpers import SMOLLM2_VOCAB, tiny_model
from tests.workloads import prompt_completion_dataset

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 6  # the one line plus a few import-time notices of other libraries (bitsandbytes, deepspeed)


def run_cli(args: list[str], cwd: Path, debug: bool = False) -> subprocess.CompletedProcess:
    """``hf-tree ARGS`` as the console script runs it: the working directory is not on the import path (``-P``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("HF_TREE_DEBUG", None)
    if debug:
        env["HF_TREE_DEBUG"] = "1"
    command = [sys.executable, "-P", "-m", "hf_tree.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def last_line(result: subprocess.CompletedProcess, short: bool = True) -> str:
    """The last line of a failed command's stderr; no traceback before it, and (``short``: failures found before
    anything runs) hardly anything else."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr, result.stderr[-5000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert not short or len(lines) <= MAX_LINES, result.stderr[-3000:]
    return lines[-1]


@pytest.mark.slow  # a CLI subprocess (~8 s); the fast tier keeps the in-process test_closest_flag_and_plain_help
def test_trl_command_flag_typo_names_the_closest_flag(tmp_path):
    """A typo of a tree flag would reach accelerate launch, which prints its 110-line usage blaming itself."""
    result = run_cli(["sft", "--output_dir", str(tmp_path), "--bf16", "False", "--max_packd_tokens", "64"], tmp_path)
    assert last_line(result) == "hf-tree sft: unknown flag --max_packd_tokens: did you mean --max_packed_tokens?"


@pytest.mark.slow  # a CLI subprocess (~10 s); the fast tier keeps the in-process test_closest_flag_and_plain_help
def test_trl_command_unknown_config_key_names_file_and_key(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path}\nbf16: false\nnum_processes: 1\nlearning_rat: 0.001\n")
    result = run_cli(["dpo", "--config", str(config)], tmp_path)
    assert last_line(result) == (
        f"hf-tree dpo: --config {config}: key 'learning_rat' is not a field of hf-tree dpo: did you mean "
        "'learning_rate'?"
    )


@pytest.mark.slow  # a CLI subprocess (~10 s); the fast tier keeps the in-process test_closest_flag_and_plain_help
def test_hf_tree_train_flag_typo_and_config_key(tmp_path):
    result = run_cli(["train", "--lora_rr", "8"], tmp_path)
    assert last_line(result) == "hf-tree train: unknown flag --lora_rr: did you mean --lora_r?"
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 2\nmax_packed_token: 64\n")
    with pytest.raises(SystemExit, match=rf"^hf-tree train: --config {config}: key 'max_packed_token' .* mean "):
        main(["train", "--config", str(config)])
    with pytest.raises(SystemExit, match=r"^hf-tree train: argument --tree_execution.*: invalid choice: 'packd'"):
        main(["train", "--tree_execution", "packd"])


def test_stats_takes_the_trainers_spellings_and_names_typos(tmp_path):
    result = run_cli(["stats", "builtin:synthetic-agent", "--max-packd-tokens", "64"], tmp_path)
    assert last_line(result) == "hf-tree stats: unknown flag --max-packd-tokens: did you mean --max-packed-tokens?"
    result = run_cli(["stats", "builtin:synthetic-agent", "--max_packd_tokens", "64"], tmp_path)
    assert last_line(result) == "hf-tree stats: unknown flag --max_packd_tokens: did you mean --max_packed_tokens?"


@pytest.mark.slow
def test_error_inside_training_is_one_line_from_a_folder_holding_hf_tree(tmp_path):
    """A ValueError raised in the launched training process (a branch longer than --max_packed_tokens) ends the
    command with that process's one line, not its traceback and the launcher's CalledProcessError. The working
    directory holds a package named hf_tree (as the folder above a clone does): the launched process must import
    the real one (`python -m` puts the working directory first unless PYTHONSAFEPATH is set)."""
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa", tie_word_embeddings=True).save_pretrained(
        model_dir
    )
    load_smollm2_tokenizer().save_pretrained(model_dir)
    data_dir.mkdir()
    prompt_completion_dataset().to_json(data_dir / "train.jsonl")
    (tmp_path / "hf_tree").mkdir()
    (tmp_path / "hf_tree" / "__init__.py").write_text("")  # a shadow: `import hf_tree.trl` fails if it is imported
    args = ["sft", "--num_processes", "1", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir)]
    args += ["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--bf16", "False", "--report_to", "none"]
    args += [
        "--max_packed_tokens",
        "8",
        "--tree_execution",
        "packed",
        "--overlong",
        "error",
        "--tree_self_check",
        "False",
    ]
    line = last_line(run_cli(args, tmp_path), short=False)  # after the run's own progress output
    assert line.startswith("hf-tree sft: batch row 0: branch 0 has ") and "more than max_branch_tokens=8" in line
    assert "set overlong='truncate' or 'drop'" in line  # the fix
    debug = run_cli(["--debug", *args], tmp_path)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_closest_flag_and_plain_help():
    assert closest("--max-packd-tokens", ["--max_packed_tokens", "--max-packed-tokens", "--pad"]) == (
        "--max-packed-tokens"
    )
    assert closest("--zzz", ["--max_packed_tokens"]) is None
    assert plain("``hf-tree sft`` is ``trl sft``") == "hf-tree sft is trl sft"


def test_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
    for command in ("stats", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "``" not in capsys.readouterr().out
