"""``benchmarks/gpu_check.py`` end to end without a GPU: its "no CUDA" mode lists every GPU row as skipped, with the
reason, and exits 0 (CI has no GPU); on a CUDA machine the same command runs the checks (not run here)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_benchmark


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
        "GRPO row",
    ):
        assert expected in names
    assert any(name.startswith("hybrid qwen3_5") for name in names)
