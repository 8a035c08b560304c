"""The GRPO/DPO log-prob benchmark runs end to end at tiny sizes and prints its tables (speed is not asserted)."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_benchmark_quick_runs():
    result = run_benchmark("grpo_dpo.py", "--quick")
    for title in ("GRPO log-prob passes", "DPO log-prob passes"):
        assert title in result.stdout
    assert result.stdout.count("token dedup ratio") == 2
    assert result.stdout.count("step total") == 2
