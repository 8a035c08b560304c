"""docs/training.md states every default hf_tree adds to a config, and every setting of the launcher's default job,
as the code has them: the tables are parsed and compared with the dataclass fields (``TreeArguments``, the fields each
``Tree*Config`` adds to its TRL config, the launcher's ``DataArguments``/``LoraLayerArguments``) and with
``DEFAULT_RUN``/``DEFAULT_MODEL_RUN``/``DEFAULT_DATA_RUN``."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import trl

from hf_tree import launcher
from hf_tree.config import TreeArguments
from hf_tree.trl.arguments import DEPRECATED_SWITCH_NAMES
from hf_tree.trl.dpo import TreeDPOConfig
from hf_tree.trl.grpo import TreeGRPOConfig
from hf_tree.trl.kto import TreeKTOConfig
from hf_tree.trl.reward import TreeRewardConfig
from hf_tree.trl.rloo import TreeRLOOConfig
from hf_tree.trl.sft import TreeSFTConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"

# each config class with the classes whose fields it inherits (its own tree fields are the rest)
CONFIGS: dict[type, tuple[type, ...]] = {
    TreeArguments: (),
    TreeSFTConfig: (trl.SFTConfig, TreeArguments),
    TreeGRPOConfig: (trl.GRPOConfig,),
    TreeRLOOConfig: (trl.RLOOConfig,),
    TreeDPOConfig: (trl.DPOConfig,),
    TreeKTOConfig: (trl.KTOConfig,),
    TreeRewardConfig: (trl.RewardConfig,),
    launcher.DataArguments: (),
    launcher.LoraLayerArguments: (),
}


def table(heading: str) -> list[list[str]]:
    """The cells of the first table under ``### heading`` in docs/training.md (header and rule left out)."""
    text = DOC.read_text(encoding="utf-8").split(f"### {heading}\n", 1)[1]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    start = text.splitlines().index(lines[0])
    rows = []
    for line in text.splitlines()[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows[2:]


def first_literal(cell: str) -> Any:
    """The Python value of the first `...` span of a cell."""
    return ast.literal_eval(re.search(r"`([^`]+)`", cell).group(1))


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def own_defaults(cls: type, bases: tuple[type, ...]) -> dict[str, Any]:
    """The fields ``cls`` adds over ``bases``, and those whose default it changes (TreeSFTConfig's overlong); not the
    deprecated names of ``tree_forward`` (the table shows the one name, a line under it the old ones)."""
    inherited = {f.name: default_of(f) for base in bases for f in dataclasses.fields(base)}
    return {
        f.name: default_of(f)
        for f in dataclasses.fields(cls)
        if (f.name not in inherited or default_of(f) != inherited[f.name]) and f.name not in DEPRECATED_SWITCH_NAMES
    }


def test_tree_field_defaults_table_matches_the_dataclasses():
    documented: dict[tuple[str, str], Any] = {}
    for classes, field, default in table("Defaults of the tree fields"):
        name = field.strip("`")
        for cls in re.findall(r"`(\w+)`", classes.split(" (")[0]):  # "(TreeTrainingArguments, ...)": users of it
            assert (cls, name) not in documented, f"{cls}.{name} is listed twice"
            documented[(cls, name)] = first_literal(default)
    actual = {}
    for cls, bases in CONFIGS.items():
        actual.update({(cls.__name__, name): value for name, value in own_defaults(cls, bases).items()})
    missing = sorted(set(actual) - set(documented))
    assert not missing, f"add rows for {missing} to docs/training.md, 'Defaults of the tree fields'"
    assert sorted(set(documented) - set(actual)) == [], "docs/training.md lists fields the configs do not have"
    wrong = {key: (documented[key], value) for key, value in actual.items() if documented[key] != value}
    assert not wrong, f"docs/training.md (documented, code): {wrong}"


def test_default_job_table_matches_the_launcher():
    runs = {"DEFAULT_RUN": launcher.DEFAULT_RUN, "DEFAULT_MODEL_RUN": launcher.DEFAULT_MODEL_RUN}
    runs["DEFAULT_DATA_RUN"] = launcher.DEFAULT_DATA_RUN
    documented = {}
    for field, value, source in table("The default job's settings"):
        documented[(re.search(r"`(\w+)`", source).group(1), field.strip("`"))] = first_literal(value)
    actual = {(run, key): value for run, values in runs.items() for key, value in values.items()}
    assert documented == actual


def test_launcher_defaults_raise_no_notice_about_themselves():
    """The default job's parsed config: LoRA dropout 0 (no dropout warning), one tree per step (no batch_unit
    notice), the new activation_checkpointing name (no deprecation warning)."""
    model, _, _, config = launcher.parse_arguments([])
    assert model.lora_dropout == 0 and config.batch_unit == "trees"
    assert config.activation_checkpointing is False
    _, _, _, config = launcher.parse_arguments(["--gradient_checkpointing", "True"])
    assert config.activation_checkpointing is True  # the deprecated spelling still counts
