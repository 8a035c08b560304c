"""The vision-language group benchmark runs end to end at tiny sizes and prints its table (speed is not asserted, but
the printed figures are: every method trains the same loss, the dedup ratio exceeds 1, times are positive)."""

from __future__ import annotations

import math
import re

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
    spreads = re.findall(r"largest relative difference between methods ([\d.e+-]+)", result.stdout)
    assert len(spreads) == 2 and all(float(s) <= 1e-4 for s in spreads)  # one per workload, float32
    dedups = re.findall(r"\(text tokens \+ image patches\): ([\d.]+)", result.stdout)
    assert len(dedups) == 2 and all(1 < float(d) < 100 for d in dedups)
    times = [float(t) for t in re.findall(r"^\| \w+ \| ([\d.]+) \|", result.stdout, flags=re.MULTILINE)]
    assert len(times) >= 3 and all(math.isfinite(t) and t > 0 for t in times)
