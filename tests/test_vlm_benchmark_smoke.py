"""The vision-language group benchmark runs end to end at tiny sizes and prints its table (speed is not asserted)."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow  # ~35 s on a shared 2-core CPU (two methods, warm-up, timing and memory runs)
def test_benchmark_quick_runs():
    result = run_benchmark("vlm_group.py", "--quick")
    assert (
        "GRPO group" in result.stdout
        and "screenshot trajectory" in result.stdout
        and "step total: hf_tree" in result.stdout
    )
    assert "| per_branch |" in result.stdout and "| padded |" in result.stdout and "| hf_tree |" in result.stdout
