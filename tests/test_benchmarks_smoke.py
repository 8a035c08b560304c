"""The attention benchmark runs end to end at tiny sizes and prints its table (speed is not asserted).

It runs in a subprocess: for its memory column it pins glibc's mmap threshold, which would change the
allocator of the test process.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

BENCHMARK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"


def test_attention_benchmark_quick_runs():
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| row | N |")
    names = [line.split(" | ")[0] for line in table[1:]]
    assert names == ["| GRPO 128+4x64", "| agent 3 turns", "| random deep tree"]
    for line in table[1:]:  # every time column parsed as a positive number
        times = [float(cell) for cell in line.split(" | ")[3:7]]
        assert all(t > 0 for t in times)
