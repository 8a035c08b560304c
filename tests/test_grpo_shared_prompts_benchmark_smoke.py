"""The shared-prompt GRPO benchmark runs end to end at tiny sizes and prints its table (speed is not asserted)."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow  # a benchmark run in a subprocess
def test_benchmark_quick_runs():
    result = run_benchmark("grpo_shared_prompts.py", "--quick")
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"trl", "packed", "shared"} <= rows.keys()
    tokens = {name: float(rows[name].split("|")[2]) for name in ("trl", "packed", "shared")}
    assert tokens["shared"] < tokens["packed"] < tokens["trl"]
