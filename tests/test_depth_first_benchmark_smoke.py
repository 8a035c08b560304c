"""The depth-first benchmark runs end to end at tiny sizes and prints its table and verdicts (speed is not asserted).

It runs in a subprocess (its memory column profiles allocations), with this checkout's ``hf_tree`` first on the path.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from tests.helpers import run_benchmark

METHODS = ["per_branch", "split", "packed", "depth_first"]


@pytest.mark.slow  # a benchmark run in a subprocess
def test_depth_first_benchmark_quick_runs():
    result = run_benchmark("depth_first.py", "--quick")
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| workload | method |")
    rows = [line.split(" | ") for line in table[1:]]
    workloads = list(dict.fromkeys(cells[0][2:] for cells in rows))
    champ = ["CHAMP R~1.1", "CHAMP R~1.2", "CHAMP R~2.5"] if find_spec("champ_dataset") else []
    assert [w.split(" (")[0] for w in workloads] == ["GRPO 48+16x16", "agent", *champ, "BFCL"]
    for workload in workloads:  # every method ran, depth_first/4 where a quarter of the tree is below the row
        methods = [cells[1] for cells in rows if cells[0][2:] == workload]
        assert methods[:4] == METHODS and methods[4:] in ([], ["depth_first/4"])
    for cells in rows:  # time and peak columns parsed as positive numbers
        assert float(cells[4]) > 0 and float(cells[6]) > 0
    verdicts = [line for line in result.stdout.splitlines() if "target" in line]
    assert len(verdicts) == 3 * len(workloads) and all(line.endswith(("met)", "missed)")) for line in verdicts)


@pytest.mark.slow  # a benchmark run in a subprocess per method
def test_depth_first_memory_benchmark_quick_runs():
    """The memory-knob benchmark: every method's peak measured in its own process, then the speed table."""
    if find_spec("champ_dataset") is None:
        pytest.skip("its group is a CHAMP group (CI installs it: pip install --no-deps champ-dataset==1.0.0)")
    result = run_benchmark("depth_first_memory.py", "--quick", timeout=900)
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "method" not in line]
    assert [cells[0][2:] for cells in rows] == ["per_branch", "packed", "depth_first"]
    for cells in rows:  # peak MiB and step seconds parsed as non-negative / positive numbers
        assert float(cells[3]) >= 0 and float(cells[5]) > 0
    assert rows[0][4] == "1.00"
