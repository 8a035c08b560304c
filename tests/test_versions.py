"""The TRL-based modules refuse a TRL outside the tested range (they override private TRL methods)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trl

from hf_tree.versions import TESTED_TRL, is_tested, require_tested_trl

TRL_MODULES = (
    "hf_tree.trl.sft",
    "hf_tree.trl.grpo",
    "hf_tree.trl.rloo",
    "hf_tree.trl.dpo",
    "hf_tree.trl.kto",
    "hf_tree.trl.reward",
    "hf_tree.trl.logprobs",
    "hf_tree.trl.glue",
)


def test_the_installed_trl_is_in_the_tested_range():
    assert is_tested(trl.__version__, TESTED_TRL)
    require_tested_trl()


@pytest.mark.parametrize("version", ["1.0.0", "1.15.2", "1.17.0", "2.0.0"])
def test_a_trl_outside_the_tested_range_is_refused_with_the_fix(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(ImportError, match=rf"trl {version} is installed.*pip install 'trl>=1\.16\.0,<1\.17\.0'"):
        require_tested_trl()


@pytest.mark.slow  # a fresh interpreter importing every TRL stack (~5 s); the check itself is tested above
def test_every_trl_based_module_refuses_to_import_with_an_untested_trl():
    """In a fresh interpreter (the modules are already imported here) with TRL reporting a newer version."""
    script = (
        "import importlib, trl\n"
        "trl.__version__ = '1.17.0'\n"
        f"for name in {TRL_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print(name, 'imported')\n"
        "    except ImportError as error:\n"
        "        print(name, 'refused:', error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    for name in TRL_MODULES:
        assert f"{name} refused: hf_tree's TRL trainers" in out, out
