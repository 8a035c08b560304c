"""The GRPO/DPO log-prob benchmark runs end to end at tiny sizes and prints its tables (speed is not asserted, but
the printed figures are: the dedup ratios exceed 1, every time and speedup is a finite positive number)."""

from __future__ import annotations

import math
import re

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow  # a benchmark run in a subprocess
def test_benchmark_quick_runs():
    result = run_benchmark("grpo_dpo.py", "--quick")
    for title in ("GRPO log-prob passes", "DPO log-prob passes"):
        assert title in result.stdout
    dedups = [float(x) for x in re.findall(r"token dedup ratio ([\d.]+)x", result.stdout)]
    assert len(dedups) == 2 and all(1 < d < 100 for d in dedups)  # groups and pairs share their prompts
    passes = re.findall(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", result.stdout, flags=re.MULTILINE)
    names = [name for name, *_ in passes]
    assert names.count("step total (old+ref+policy)") == names.count("step total (ref+policy)") == 1
    for name, *figures in passes:  # TRL s, tree s, speedup
        assert all(math.isfinite(float(f)) and float(f) > 0 for f in figures), name
