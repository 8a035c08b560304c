"""The GRPO/DPO log-prob benchmark runs end to end at tiny sizes and prints its tables (speed is not asserted)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

BENCHMARK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_dpo.py"


def test_benchmark_quick_runs():
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for title in ("GRPO log-prob passes", "DPO log-prob passes"):
        assert title in result.stdout
    assert result.stdout.count("token dedup ratio") == 2
    assert result.stdout.count("step total") == 2
