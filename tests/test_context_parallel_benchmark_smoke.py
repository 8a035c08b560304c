"""benchmarks/context_parallel.py --quick runs end to end (2 gloo processes) and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_quick_benchmark_reports_balance_and_memory_per_rank():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "context_parallel.py"), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "work balance" in done.stdout and "memory per rank" in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r["row"] for r in summary["balance"]} == {"grpo", "agent", "deep"}
    for row in summary["balance"]:
        assert row["balanced_balance"] <= row["naive_balance"]
    (memory,) = summary["memory"]
    assert len(memory["cp"]["2"]["activations"]) == 2 and memory["cp"]["1"]["activations"][0] > 0
    assert 0 < memory["cp"]["2"]["activations_ratio"] < 1  # each rank holds less than the whole row
    # Part 3: a windowed model and a hybrid on one tree, step time and memory per rank at cp=1, 2 and 4.
    assert [m["model"] for m in summary["models"]] == ["mistral", "lfm2"]
    for row in summary["models"]:
        assert [len(row["cp"][c]["seconds"]) for c in ("1", "2", "4")] == [1, 2, 4] and row["cp"]["1"]["seconds"][0] > 0
        assert 0 < row["cp"]["4"]["activations_ratio"] < row["cp"]["2"]["activations_ratio"] < 1
