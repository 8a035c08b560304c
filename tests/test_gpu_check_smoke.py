"""``benchmarks/gpu_check.py`` end to end without a GPU: its "no CUDA" mode lists every GPU row as skipped, with the
reason, and exits 0 (CI has no GPU); its ``--device cpu`` mode measures the attention rows on the CPU engines (the
figures are parsed and bounded). On a CUDA machine the script runs the GPU checks (not run here)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.helpers import run_benchmark


@pytest.mark.slow  # a benchmark script in a subprocess (~5 s), as the other benchmark smoke tests
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device runs the real check, not its no-CUDA mode")
def test_no_cuda_mode_skips_every_row_with_its_reason_and_exits_0():
    result = run_benchmark("gpu_check.py", timeout=120)  # fails unless the exit status is 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gpu_check: no CUDA device")
    rows = [line.split(" | ") for line in lines if line.startswith("| exact") or line.startswith("| speed")]
    names = [row[1] for row in rows]
    assert all(row[2] == "skipped" and "no CUDA device" in row[3] for row in rows)
    for expected in (
        "attention flash_attn bfloat16 window",
        "attention flex float32 sinks",
        "model gemma2 (softcap, window) flash_attn bfloat16",
        "depth-first llama bfloat16 (units of 16 tokens)",
        "trl GRPO step float32 (swap vs TRL)",
        "trl SFT step float32 (swap vs TRL)",
        "GRPO group",
        "no sharing",
    ):
        assert expected in names
    assert any(name.startswith("hybrid qwen3_5") for name in names)


@pytest.mark.slow  # 16 checks in a subprocess
def test_cpu_mode_measures_every_attention_row_against_the_float64_reference():
    """``--device cpu`` runs the script's own checks on the CPU engines: every attention row is measured (a finite
    error against the float64 reference, within twice the eager reference's same-dtype error) and passes."""
    result = run_benchmark("gpu_check.py", "--device", "cpu", "--sections", "attention", timeout=600)
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| exact")]
    assert len(rows) == 16  # 2 CPU engines x 2 dtypes x 4 cases
    for row in rows:
        assert row[2] == "ok", row
        error, eager = (float(x) for x in re.match(r"error (\S+) vs eager (\S+)", row[3]).groups())
        assert math.isfinite(error) and math.isfinite(eager) and 0 <= error <= max(2 * eager, 1e-6), row
        assert eager < 1e-2, row  # bfloat16's own rounding: the reference itself is sane


@pytest.mark.slow  # the speed section in its own process: 4 workloads x 3 methods on a tiny model (~1-2 min)
def test_cpu_mode_speed_rows_measure_every_method_and_print_the_targets(tmp_path):
    """``--device cpu --quick --sections speed``: a row per workload of ``benchmarks/gpu_speed.py`` with the padded,
    padding-free and tree figures (two tree engines forced by name) and each target beside them, also in ``--json``."""
    out = tmp_path / "rows.json"
    args = ("--device", "cpu", "--quick", "--sections", "speed", "--tree-engine", "cpu,blocked", "--json", str(out))
    result = run_benchmark("gpu_check.py", *args, timeout=600)
    rows = json.loads(out.read_text())
    assert [row["name"] for row in rows] == ["GRPO group", "shared system prompt", "little sharing", "no sharing"]
    for row in rows:
        assert row["status"] in ("ok", "below target"), row
        for method in ("padded", "padding_free", "tree[cpu]", "tree[blocked]"):
            assert re.search(rf"{re.escape(method)} \d+\.\d ms", row["detail"]), row
        assert "vs padding-free >= 0.95 R" in row["detail"] and ("met" in row["detail"] or "MISSED" in row["detail"])
    assert "below a speed target" in result.stdout


@pytest.mark.gpu
def test_relative_error_measures_a_gpu_result_against_a_cpu_oracle():
    """gpu_check's TRL rows compare a CUDA update with TRL's float64 CPU update (failed with a device mismatch)."""
    from hf_tree.testing import relative_error

    expected = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert relative_error(expected.float().cuda() * 1.5, expected) == pytest.approx(0.5)
