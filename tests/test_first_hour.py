"""A new user's first hour (issue 50): the faults found on a fresh clone, each checked where it happened.

- a script saved in the folder above a clone imports the installed package, not the clone's folder;
- a missing local dataset path is said at once (no hub retries), by ``hf-tree stats``, ``hf-tree sft`` and the
  launcher's resolver;
- on a CPU, TRL's default ``bf16=True`` ends with the flag that fixes it (``--bf16 False``);
- an empty assistant message is trained as TRL trains it, with a warning naming its row;
- the main job's first evaluation shows progress (several batches).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys

import datasets
import pytest
import torch

from hf_tree.builders import build_tree_dataset
from hf_tree.cli import main
from hf_tree.cli_messages import one_line
from hf_tree.data.sources import looks_like_local_path, read_rows
from tests.helpers import word_tokenizer

TEMPLATE = (  # word-tokenizer chat template (w5 = user/system start, w6 = assistant start, w7 = end of turn)
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ 'w6 ' + (m.content or '') + ' w7 ' }}"
    "{%- else -%}{{ 'w5 ' + m.content + ' w7 ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'w6 ' }}{%- endif -%}"
)


def test_a_script_beside_a_clone_imports_the_installed_package(tmp_path):
    """The folder above a clone holds the clone, a folder named hf_tree without ``__init__.py``: Python imports it as
    a namespace package ahead of setuptools' editable finder, so the editable install must put the clone's root on
    sys.path instead (pyproject.toml: package-dir; an install made before that change needs `pip install -e .`)."""
    try:
        importlib.metadata.distribution("hf_tree")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("hf_tree is not installed (pip install -e .)")
    (tmp_path / "hf_tree").mkdir()  # the clone, as the folder above it sees it
    (tmp_path / "script.py").write_text("import hf_tree\nprint(hf_tree.__file__)\nfrom hf_tree import Tree\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith(os.path.join("hf_tree", "__init__.py")), result.stdout


def test_a_missing_local_dataset_is_said_at_once(tmp_path, monkeypatch):
    """`data/does_not_exist` beside a `data` folder (and ./x, /x, a/b/c, x.jsonl) can only be a local path: the
    resolver refuses it without asking the Hub (which retries for a minute offline); an owner/name id stays a hub
    id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("data/does_not_exist", "./nope", str(tmp_path / "nope"), "a/b/c", "nope.jsonl"):
        assert looks_like_local_path(name), name
        with pytest.raises(ValueError, match=r"does not exist \(no such file or folder: "):
            read_rows(name, allow_hub=True)
    assert not looks_like_local_path("owner/name")
    with pytest.raises(SystemExit, match=r"^hf-tree stats: data 'data/does_not_exist' does not exist \(no such file"):
        main(["stats", "data/does_not_exist"])


def test_a_hub_id_the_hub_does_not_give_names_the_local_path_too(tmp_path):
    """`owner/name` with no such local folder goes to the Hub (offline here: datasets' real error, at once): the
    launcher's resolver and the CLI's one line both say it is no local file or folder either."""
    code = (
        "import datasets\n"
        "from hf_tree.cli_messages import one_line\n"
        "from hf_tree.data.sources import read_rows\n"
        "for load in (lambda: read_rows('someone/missing-data', allow_hub=True),"
        " lambda: datasets.load_dataset('someone/missing-data')):\n"
        "    try:\n        load()\n    except Exception as error:\n        print(one_line(error))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    resolver, script = result.stdout.strip().splitlines()[-2:]
    assert resolver.startswith("data 'someone/missing-data' is no local file or folder"), resolver
    assert "on the Hub" in script and "It is no local file or folder either; a local path written as ./PATH" in script


def test_hf_tree_sft_refuses_a_missing_local_dataset_before_launching(tmp_path, monkeypatch):
    import trl

    for kind in ("Config", "Trainer"):  # the command swaps the tree classes into trl: monkeypatch restores TRL's
        monkeypatch.setattr(trl, "SFT" + kind, getattr(trl, "SFT" + kind))
    monkeypatch.chdir(tmp_path)
    argv = ["sft", "--model_name_or_path", "unused", "--dataset_name", "./missing", "--bf16", "False"]
    with pytest.raises(SystemExit, match=r"^hf-tree sft: data './missing' does not exist \(no such file or folder"):
        main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16=True is accepted where a GPU is")
def test_bf16_on_a_cpu_names_the_flag_that_fixes_it(tmp_path):
    """transformers' error names use_cpu; the one line of the hf-tree CLI adds TRL's default and `--bf16 False`."""
    from hf_tree.trl.sft import TreeSFTConfig

    with pytest.raises(ValueError, match="bf16") as error:
        TreeSFTConfig(output_dir=str(tmp_path))  # TRL's default bf16=True
    assert "pass --bf16 False" in one_line(error.value)


@pytest.mark.parametrize("messages_branches", ["conversation", "per_turn"])
def test_an_empty_assistant_message_is_trained_and_warned_about(messages_branches, caplog):
    """TRL trains an empty assistant message (the template's tokens around nothing): the trees keep it, and the
    builder says which row holds it."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    user = {"role": "user", "content": "w10 w11"}
    rows = [
        {"messages": [user, {"role": "assistant", "content": "w12"}]},
        {"messages": [user, {"role": "assistant", "content": "w13"}, user, {"role": "assistant", "content": " "}]},
    ]
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        trees = build_tree_dataset(datasets.Dataset.from_list(rows), tokenizer, messages_branches=messages_branches)
    warnings = [r.getMessage() for r in caplog.records if "empty content" in r.getMessage()]
    assert warnings and all(w.startswith("row 1: assistant message 3 has empty content") for w in warnings), warnings
    assert sum(len(t) for t in trees["branch_end_nodes"]) == (2 if messages_branches == "conversation" else 3)


def test_the_main_jobs_first_evaluation_moves_its_bar():
    """The main job evaluates its held-out trees before training (eval_on_start: the loss before); in one batch of 8
    its progress bar sat on 0/1 for ~2 minutes under load, so it runs several batches."""
    from hf_tree.launcher import parse_arguments

    _, data_args, _, config = parse_arguments([])
    assert data_args.max_eval_samples // config.per_device_eval_batch_size >= 4
