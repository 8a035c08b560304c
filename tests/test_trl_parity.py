"""TRL's own example scripts, unmodified vs with the class swap (``benchmarks/trl_parity.py``): every option row
trains exactly like TRL's (same optimizer steps, same weight updates in float32) or is refused with a ``ValueError``
before training. One row per script runs in the fast tier, the whole table under ``slow``: the other rows repeat a
script with an option whose exactness a fast test covers without the script (e.g. GRPO's ``top_entropy_quantile`` and
``mask_truncated_completions`` in tests/test_grpo.py, MoE router losses in tests/test_moe_router_loss.py, messages
in tests/test_sft_messages.py).
"""

from __future__ import annotations

import pathlib

import pytest

from benchmarks.trl_parity import ROWS, SCRIPTS, run_row, setup_paths, swapped_source

# Rows that must be refused (the option cannot apply to trees); every other row must be exact.
REFUSED = {"sft --packing true", "sft --padding_free true --max_length None", "reward --neftune_noise_alpha 5"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return setup_paths(tmp_path_factory.mktemp("trl_parity"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


# script -> the TRL name of its trainer (without "Trainer")
TRAINERS = {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO", "rloo": "RLOO", "reward": "Reward", "kto": "KTO"}


def test_swap_changes_only_the_import_lines():
    for script, trainer in TRAINERS.items():
        source = (SCRIPTS / f"{script}.py").read_text()
        swapped = swapped_source(source)
        changed = [line for line in swapped.splitlines() if line not in source.splitlines()]
        assert changed and all(line.strip().startswith(("from trl import", "from hf_tree.")) for line in changed)
        assert f"Tree{trainer}Trainer as {trainer}Trainer" in swapped


def _check(row, paths) -> None:
    outcome = run_row(row, paths)
    if row.name in REFUSED:
        assert outcome.state == "refused", (outcome.state, outcome.detail)
    elif row.dropout:
        assert outcome.state == "warned", (outcome.state, outcome.error, outcome.detail)
    elif row.padding_noise:  # exact, or within twice TRL's own float32 noise (see benchmarks/trl_parity.py)
        assert outcome.state in ("exact", "float32 noise"), (outcome.state, outcome.error, outcome.detail)
    else:
        assert outcome.state == "exact", (outcome.state, outcome.steps, outcome.error, outcome.detail)


@pytest.mark.parametrize("row", [r for r in ROWS if r.fast], ids=lambda r: r.name)
def test_fast_rows(row, paths):
    _check(row, paths)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if not r.fast], ids=lambda r: r.name)
def test_every_row(row, paths):
    _check(row, paths)


def test_rows_cover_the_issue_table():
    names = {r.name for r in ROWS}
    for script in TRAINERS:
        assert any(n.startswith(script) and "--use_peft" in n for n in names)
    assert pathlib.Path(SCRIPTS / "grpo.py").is_file()
