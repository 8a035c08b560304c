"""The TRL-based modules refuse a TRL outside the range they were tested with (they override private TRL methods),
naming the trainer, the installed version and the fix; the range is the ``trl`` extra of pyproject.toml (issue 51:
TRL 1.9, Axolotl's pin, to 1.16)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import trl
from packaging.requirements import Requirement
from packaging.version import Version

from hf_tree.versions import TESTED_TRL, TRAINER_TRL, is_tested, require_tested_trl

TRL_MODULES = (
    "hf_tree.trl.sft",
    "hf_tree.trl.grpo",
    "hf_tree.trl.rloo",
    "hf_tree.trl.dpo",
    "hf_tree.trl.kto",
    "hf_tree.trl.reward",
    "hf_tree.trl.logprobs",
    "hf_tree.trl.glue",
    "hf_tree.trl.cli",
)
TRAINERS = (
    "TreeSFTTrainer",
    "TreeRewardTrainer",
    "TreeGRPOTrainer",
    "TreeRLOOTrainer",
    "TreeDPOTrainer",
    "TreeKTOTrainer",
)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_installed_trl_is_in_the_tested_range():
    assert is_tested(trl.__version__, TESTED_TRL)
    require_tested_trl()
    for trainer, tested in TRAINER_TRL.items():
        if is_tested(trl.__version__, tested):
            require_tested_trl(trainer)


def test_the_trl_extra_is_the_tested_range():
    text = PYPROJECT.read_text()
    requirement = Requirement(re.search(r'^trl = \["([^"]+)"\]$', text, re.MULTILINE).group(1))
    assert requirement.name == "trl"
    assert {s.operator: Version(s.version) for s in requirement.specifier} == {">=": TESTED_TRL[0], "<": TESTED_TRL[1]}
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert '"trl' not in dependencies, "TRL is the trl extra: the core installs beside a framework's TRL"


@pytest.mark.parametrize("version", ["1.0.0", "1.8.2", "1.17.0", "2.0.0"])
def test_a_trl_outside_the_tested_range_is_refused_with_the_fix(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(ImportError, match=rf"trl {version} is installed.*pip install 'trl>=1\.9\.0,<1\.17\.0'"):
        require_tested_trl()
    refused = rf"^TreeSFTTrainer overrides private TRL methods.*trl {version} is installed"
    with pytest.raises(ImportError, match=refused):
        require_tested_trl("TreeSFTTrainer")


@pytest.mark.parametrize("version", ["1.9.0", "1.9.1", "1.12.0", "1.16.2"])
def test_every_trainer_accepts_the_whole_range(monkeypatch, version):
    """Including GRPO, RLOO, DPO and KTO, which replace TRL's fused LM head: on TRL 1.9, which has none, they compute
    the same values without it (hf_tree.trl.compat)."""
    monkeypatch.setattr(trl, "__version__", version)
    require_tested_trl()
    assert set(TRAINER_TRL) == set(TRAINERS)
    for trainer in TRAINER_TRL:
        assert TRAINER_TRL[trainer] == TESTED_TRL
        require_tested_trl(trainer)


def test_without_trl_the_trainers_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError, as without TRL installed
    with pytest.raises(ImportError, match=r"TreeDPOTrainer cannot run without TRL.*pip install 'hf_tree\[trl\]'"):
        require_tested_trl("TreeDPOTrainer")


def import_each(version: str) -> str:
    """What a fresh interpreter (these modules are already imported here) prints importing each TRL module with TRL
    reporting ``version``."""
    script = (
        "import importlib, trl\n"
        f"trl.__version__ = {version!r}\n"
        f"for name in {TRL_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print(name, 'imported')\n"
        "    except ImportError as error:\n"
        "        print(name, 'refused:', error)\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow  # a fresh interpreter importing every TRL stack (~5 s); the check itself is tested above
def test_every_trl_based_module_refuses_to_import_with_an_untested_trl():
    out = import_each("1.17.0")
    for name in TRL_MODULES:
        assert f"{name} refused: hf_tree's TRL trainers override private TRL methods" in out, out


@pytest.mark.slow  # a fresh interpreter importing every TRL stack (~5 s)
def test_with_trl_1_9_every_trl_based_module_imports():
    """TRL 1.9's reporting (on whatever TRL is installed): every trainer, the CLI and the shared modules import."""
    out = import_each("1.9.0")
    for name in TRL_MODULES:
        assert f"{name} imported" in out, out


def test_sft_loss_type_adapts_trl_1_9s_default_and_refuses_untested_losses(monkeypatch):
    from hf_tree.trl.compat import sft_loss_type

    monkeypatch.setattr(trl, "__version__", "1.9.0")
    assert sft_loss_type("chunked_nll", 0.0) == "nll"  # TRL 1.9's default: nll on the trained tokens, in chunks
    with pytest.raises(ValueError, match=r"loss_type='dft' with trl 1\.9\.0.*Set loss_type='nll'"):
        sft_loss_type("dft", 0.0)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0\.1 with trl 1\.9\.0.*label_smoothing_factor=0\.0"):
        sft_loss_type("nll", 0.1)
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    assert sft_loss_type("nll", 0.1) == "nll" and sft_loss_type("dft", 0.0) == "dft"
