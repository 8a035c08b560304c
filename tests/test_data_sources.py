"""hf_tree.data.sources, the one data resolver: tree-row detection, built-in names and their alias, chat-template
lookup, and reading saved datasets. (That the launcher and ``hf-tree stats`` build the same trees from one file is
in tests/test_launch.py, where the launcher module is loaded.)"""

from __future__ import annotations

import datasets
import pytest

from hf_tree import Tree
from hf_tree.builders.dataset import detect_format
from hf_tree.data.formats import detect_user_format
from hf_tree.data.sources import (
    BUILTIN_ALIASES,
    BUILTIN_DATASETS,
    builtin_name,
    chat_template_file,
    chat_template_text,
    default_chat_template,
    is_tree_dataset,
    read_rows,
)
from hf_tree.tree import TREE_KEYS


def test_tree_rows_are_recognised_by_every_to_dict_key():
    rows = datasets.Dataset.from_list([Tree.from_sequences([[1, 2, 3], [1, 2, 4]]).to_dict()])
    assert set(rows.column_names) >= set(TREE_KEYS) and is_tree_dataset(rows)
    # rows missing any key Tree.from_dict needs are not tree rows (an earlier copy looked at three columns only)
    for key in TREE_KEYS:
        assert not is_tree_dataset(rows.remove_columns(key)), key


def test_builtin_names_and_the_old_launcher_spelling():
    assert [builtin_name(name) for name in BUILTIN_DATASETS] == ["champ", "bfcl", "synthetic-agent", "shapes"]
    assert builtin_name("synthetic:agent") == "synthetic-agent" and BUILTIN_ALIASES
    assert builtin_name("data.jsonl") is None
    with pytest.raises(ValueError, match=r"unknown built-in dataset 'builtin:synthetic'.*builtin:synthetic-agent"):
        builtin_name("builtin:synthetic")
    small = dict(max_user_turns=1, max_tool_steps=1)
    old, _ = read_rows("synthetic:agent", limit=2, synthetic_options=small)
    new, stats = read_rows("builtin:synthetic-agent", limit=2, synthetic_options=small)
    assert old.to_list() == new.to_list() and stats.num_rows == 2
    assert read_rows("builtin:synthetic-agent", limit=2, seed=1, synthetic_options=small)[0].to_list() != new.to_list()
    with pytest.raises(ValueError, match="builtin:synthetic-agent only"):
        read_rows("builtin:champ", synthetic_options=dict(max_user_turns=1))


def test_chat_template_lookup():
    assert [default_chat_template(name) for name in BUILTIN_DATASETS] == [None, "qwen3", "qwen3", None]
    assert default_chat_template("synthetic:agent") == "qwen3" and default_chat_template("data.jsonl") is None
    path = chat_template_file("qwen3")
    assert path.endswith("qwen3.jinja") and chat_template_file(path) == path
    assert chat_template_text("qwen3") == open(path, encoding="utf-8").read() and chat_template_text(None) is None
    with pytest.raises(ValueError, match=r"'no-such-template' is neither a file nor one of TRL's templates: \[.*qwen3"):
        chat_template_file("no-such-template")


def test_one_format_detector():
    """The file reader's detector is the builders' one plus the preference format."""
    for keys in (["messages", "tools"], ["prompt", "completion"], ["prompt", "completions", "rewards"], ["text"]):
        assert detect_user_format(dict.fromkeys(keys)) == detect_format(keys)
    assert detect_user_format(dict.fromkeys(["prompt", "chosen", "rejected"])) == "preference"
    with pytest.raises(ValueError, match="'chosen' and 'rejected'"):
        detect_user_format({"body": "a"})


def test_saved_dataset_dict_needs_a_split(tmp_path):
    rows = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}])
    datasets.DatasetDict(train=rows, test=rows).save_to_disk(str(tmp_path / "dd"))
    assert read_rows(str(tmp_path / "dd"), split="train")[0].to_list() == rows.to_list()
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]; split=None"):
        read_rows(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"does not exist.*builtin:synthetic-agent"):
        read_rows(str(tmp_path / "missing.jsonl"))
