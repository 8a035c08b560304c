"""The shared-prompt GRPO benchmark runs end to end at tiny sizes and prints its table (speed is not asserted)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_benchmark_quick_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grpo_shared_prompts.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"trl", "packed", "shared"} <= rows.keys()
    tokens = {name: float(rows[name].split("|")[2]) for name in ("trl", "packed", "shared")}
    assert tokens["shared"] < tokens["packed"] < tokens["trl"]
