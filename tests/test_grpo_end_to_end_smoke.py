"""The end-to-end GRPO benchmark runs at tiny sizes (a random Llama with SmolLM2's tokenizer) and its figures hold:
TRL prefills every copy of the prompt, the tree trainer each prompt once (speed is not asserted)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow
def test_benchmark_quick_runs():
    from hf_tree.assets import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing: {error}")
    result = run_benchmark("grpo_end_to_end.py", "--quick", timeout=600)
    rows = {line.split("|")[1].strip(): line.split("|") for line in result.stdout.splitlines() if line.startswith("| ")}
    prefill = {method: int(rows[method][7]) for method in ("trl", "tree")}
    generations = 4  # --quick: G=4, one prompt per step
    # TRL forwards the G copies of the W-column prompt; the tree trainer W - 1 columns once (the last with the decode)
    assert prefill["trl"] == generations * (prefill["tree"] + 1)
    ratio = re.search(
        r"ratio TRL/tree \(cpu\): whole step ([\d.]+), generation ([\d.]+), training ([\d.]+)", result.stdout
    )
    assert ratio is not None and all(float(x) > 0 for x in ratio.groups())
    same = re.search(r"identical completions per step: ([\d. ]+)", result.stdout).group(1).split()
    assert float(same[0]) == 1.0  # first step: equal weights, same seed, same samples
    curves = [line for line in result.stdout.splitlines() if line.startswith("reward curve")]
    assert [len(line.split(":")[1].split()) for line in curves] == [2, 2]  # --quick: 2 steps
