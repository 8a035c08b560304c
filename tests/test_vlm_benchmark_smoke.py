"""The vision-language group benchmark runs end to end at tiny sizes and prints its table (speed is not asserted)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~35 s on a shared 2-core CPU (two methods, warm-up, timing and memory runs)
def test_benchmark_quick_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's hf_tree, whatever is installed
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vlm_group.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (
        "GRPO group" in result.stdout
        and "screenshot trajectory" in result.stdout
        and "step total: hf_tree" in result.stdout
    )
    assert "| per_branch |" in result.stdout and "| padded |" in result.stdout and "| hf_tree |" in result.stdout
