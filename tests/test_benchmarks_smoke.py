"""The attention benchmark runs end to end at tiny sizes and prints its table (speed is not asserted).

It runs in a subprocess: for its memory column it pins glibc's mmap threshold, which would change the
allocator of the test process.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow  # a benchmark run in a subprocess
def test_attention_benchmark_quick_runs():
    result = run_benchmark("attention.py", "--quick")
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| row | N |")
    names = [line.split(" | ")[0] for line in table[1:]]
    assert names == ["| GRPO 128+4x64", "| agent 3 turns", "| random deep tree"]
    for line in table[1:]:  # every time column parsed as a positive number
        times = [float(cell) for cell in line.split(" | ")[3:7]]
        assert all(t > 0 for t in times)
