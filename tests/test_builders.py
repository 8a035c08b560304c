"""Builders on the real SmolLM2 tokenizer and chat templates (its own ChatML one and TRL's Qwen3 one).

Oracle: ``tokenizer.apply_chat_template`` / ``tokenizer(text)`` called directly on each per-turn history or
prompt + completion; every branch of a built tree must be exactly that token sequence.
"""

from __future__ import annotations

import importlib.resources
import json

import datasets
import pytest

from hf_tree import Tree, split_tree
from hf_tree.builders import (
    GROUP_BY_PROMPT_TOKENS,
    build_tree_dataset,
    build_tree_dataset_with_stats,
    completions_to_branches,
    conversation_branch,
    conversation_branches,
    conversation_to_branches,
    tree_from_completions,
    tree_from_conversation,
)
from tests.helpers import rendered, smollm2_tokenizer_or_skip

QWEN3_TEMPLATE = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
# Renders the generation prompt with an opened think block that the assistant turn itself does not render.
PREFIX_BREAKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "4 * 3 = 12.", "reasoning_content": "Multiply the previous result."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the weather tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": json.dumps({"temperature_c": 18})},
    {"role": "assistant", "content": "It is 18 C in Paris.", "reasoning_content": "Report the tool result."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer_or_skip()


def trained_tokens(sequence, mask) -> list[int]:
    return [t for t, m in zip(sequence, mask) if m]


def assistant_indices(messages) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


# --------------------------------------------------------------------------- conversations
def test_conversation_branches_are_the_template_rendering_per_turn(tokenizer):
    sequences, masks = conversation_to_branches(CONVERSATION, tokenizer)
    turns = assistant_indices(CONVERSATION)
    assert len(sequences) == len(turns)
    for sequence, mask, i in zip(sequences, masks, turns):
        assert sequence == rendered(tokenizer, CONVERSATION[: i + 1])
        prompt = rendered(tokenizer, CONVERSATION[:i], add_generation_prompt=True)
        # exactly the assistant message's tokens are trained: everything after the generation prompt
        assert mask == [0] * len(prompt) + [1] * (len(sequence) - len(prompt))
        assert tokenizer.decode(trained_tokens(sequence, mask)) == CONVERSATION[i]["content"] + "<|im_end|>\n"
    tree = tree_from_conversation(CONVERSATION, tokenizer)
    assert tree.num_branches == len(turns)
    for b in range(tree.num_branches):
        assert tree.branch_tokens(b) == sequences[b]
        assert tree.branch_loss_mask(b) == masks[b]
    assert tree.dedup_ratio > 1.5  # every turn repeats the whole history
    assert tree.token_weights.max() == 1  # last_assistant: every assistant token is trained exactly once


def test_smollm2_template_ignores_reasoning(tokenizer):
    """SmolLM2's own template renders no reasoning: the builder reproduces that, it adds nothing."""
    sequences, _ = conversation_to_branches(CONVERSATION, tokenizer)
    assert all("Add two and two" not in tokenizer.decode(s) for s in sequences)


def test_reasoning_stripping_template_gives_history_reasoning_answer_tree(tokenizer):
    sequences, masks = conversation_to_branches(CONVERSATION, tokenizer, chat_template=QWEN3_TEMPLATE)
    turns = assistant_indices(CONVERSATION)
    for k, (sequence, mask, i) in enumerate(zip(sequences, masks, turns)):
        assert sequence == rendered(tokenizer, CONVERSATION[: i + 1], chat_template=QWEN3_TEMPLATE)
        text = tokenizer.decode(sequence)
        reasonings = [CONVERSATION[j]["reasoning_content"] for j in turns]
        assert reasonings[k] in text and not any(r in text for r in reasonings[:k])  # earlier reasoning stripped
        message = CONVERSATION[i]
        expected = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}<|im_end|>\n"
        assert tokenizer.decode(trained_tokens(sequence, mask)) == expected

    tree = tree_from_conversation(CONVERSATION, tokenizer, chat_template=QWEN3_TEMPLATE)
    assert tree.dedup_ratio > 1
    for k in range(len(turns) - 1):
        # turn k: shared history -> [reasoning -> answer] (a leaf, branch k) beside [answer -> next turns]
        leaf = tree.branch_end_nodes[k]
        fork = tree.node_parents[leaf]
        assert tokenizer.decode(tree.node_tokens[leaf]).startswith(
            "<think>\n" + CONVERSATION[turns[k]]["reasoning_content"]
        )
        assert fork in tree.branch_path(k + 1) and leaf not in tree.branch_path(k + 1)
        assert not any(tree.node_parents[n] == leaf for n in range(tree.num_nodes))


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_conversation_branch_is_trls_tokenization_of_a_messages_row(tokenizer, assistant_only_loss):
    """TRL's SFT tokenization (trl.data_utils._tokenize, as SFTTrainer calls it) with TRL's Qwen3 training template,
    tools included: the same tokens, and all of them or TRL's assistant mask trained."""
    from trl.data_utils import _tokenize

    training = (importlib.resources.files("trl") / "chat_templates" / "qwen3_training.jinja").read_text()
    kwargs = dict(chat_template=training, tools=[WEATHER_TOOL])
    expected = _tokenize(tokenizer, TOOL_CONVERSATION, return_assistant_tokens_mask=assistant_only_loss, **kwargs)
    tokens, mask = conversation_branch(TOOL_CONVERSATION, tokenizer, assistant_only_loss=assistant_only_loss, **kwargs)
    assert tokens == list(expected["input_ids"])
    assert mask == (list(expected["assistant_masks"]) if assistant_only_loss else [1] * len(tokens))
    assert 0 < sum(mask) <= len(tokens)


def test_all_assistant_trains_every_turn_in_every_branch(tokenizer):
    sequences, masks = conversation_to_branches(CONVERSATION, tokenizer, train_on="all_assistant")
    last, _ = conversation_to_branches(CONVERSATION, tokenizer)
    assert sequences == last
    own_spans = [masks_k.index(1) for masks_k in conversation_to_branches(CONVERSATION, tokenizer)[1]]
    for k, (sequence, mask) in enumerate(zip(sequences, masks)):
        for j in range(k + 1):  # turn j's span in branch k is exactly branch j's own span
            span = slice(own_spans[j], len(sequences[j]))
            assert all(mask[span]) and sequence[span] == sequences[j][span]
        assert sum(mask) == sum(len(sequences[j]) - own_spans[j] for j in range(k + 1))
    tree = tree_from_conversation(CONVERSATION, tokenizer, train_on="all_assistant")
    assert tree.token_weights.max() == len(sequences)  # turn 0 is trained by every branch


def test_all_assistant_rejects_a_history_rewriting_template(tokenizer):
    with pytest.raises(ValueError, match=r"train_on='all_assistant'.*turn 0 renders differently"):
        conversation_to_branches(CONVERSATION, tokenizer, chat_template=QWEN3_TEMPLATE, train_on="all_assistant")


def test_tool_calls_and_tool_messages(tokenizer):
    kwargs = dict(tools=[WEATHER_TOOL], chat_template=QWEN3_TEMPLATE)
    sequences, masks = conversation_to_branches(TOOL_CONVERSATION, tokenizer, **kwargs)
    for sequence, i in zip(sequences, assistant_indices(TOOL_CONVERSATION)):
        assert sequence == rendered(tokenizer, TOOL_CONVERSATION[: i + 1], **kwargs)
    call = tokenizer.decode(trained_tokens(sequences[0], masks[0]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in call
    assert "tool_response" not in tokenizer.decode(trained_tokens(sequences[1], masks[1]))  # tool output not trained
    # after the last user query Qwen3 keeps the tool-calling turn's reasoning, so turn 0 is a prefix of turn 1
    assert sequences[1][: len(sequences[0])] == sequences[0]
    tree = tree_from_conversation(TOOL_CONVERSATION, tokenizer, **kwargs)
    assert tree.num_nodes == 2 and tree.dedup_ratio > 1


def test_tokens_merging_across_the_generation_prompt_keep_the_full_tokenization(tokenizer):
    """SmolLM2 merges the generation prompt's "\\n" with an answer's leading "\\n": the text is still a prefix,
    so the branch is the template's tokenization and training starts at the merged token (counted)."""
    messages = [CONVERSATION[0], {"role": "assistant", "content": "\n\nFour."}, CONVERSATION[2], CONVERSATION[3]]
    prompt = rendered(tokenizer, messages[:1], add_generation_prompt=True)
    assert rendered(tokenizer, messages[:2])[: len(prompt)] != prompt  # the precondition: tokens do merge
    sequences, masks, merges = conversation_branches(messages, tokenizer)
    assert merges == 1
    for sequence, mask, i in zip(sequences, masks, assistant_indices(messages)):
        assert sequence == rendered(tokenizer, messages[: i + 1])
        trained = tokenizer.decode(trained_tokens(sequence, mask))
        assert trained.endswith(messages[i]["content"] + "<|im_end|>\n")
        assert tokenizer.decode(sequence).endswith(trained)


def test_template_breaking_the_prefix_property_raises_naming_the_turn(tokenizer):
    with pytest.raises(ValueError, match=r"assistant message 1 \(turn 0\).*is not a prefix"):
        conversation_to_branches(CONVERSATION, tokenizer, chat_template=PREFIX_BREAKING_TEMPLATE)


def test_conversation_without_assistant_and_bad_options(tokenizer):
    assert conversation_to_branches(CONVERSATION[:1], tokenizer) == ([], [])
    with pytest.raises(ValueError, match="no assistant message"):
        tree_from_conversation(CONVERSATION[:1], tokenizer)
    with pytest.raises(ValueError, match="train_on='everything'"):
        conversation_to_branches(CONVERSATION, tokenizer, train_on="everything")
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        conversation_to_branches([CONVERSATION[0], "hello"], tokenizer)
    with pytest.raises(ValueError, match=r"assistant message 1 \(turn 0\): the chat template failed to render"):
        conversation_to_branches([CONVERSATION[0], {"role": "assistant", "content": None}], tokenizer)


# --------------------------------------------------------------------------- completion groups
def test_completion_group_keeps_rewards_on_their_branch(tokenizer):
    prompt = [{"role": "user", "content": "Name a prime number."}]
    completions = ["2", "7", "Seven.", {"role": "assistant", "content": "11"}, "9"]
    rewards = [1.0, 1.0, 0.5, 1.0, 0.0]
    tree = tree_from_completions(prompt, completions, tokenizer, {"reward": rewards, "id": list("abcde")})
    prompt_ids = rendered(tokenizer, prompt, add_generation_prompt=True)
    expected = {}
    for c, completion in enumerate(completions):
        message = completion if isinstance(completion, dict) else {"role": "assistant", "content": completion}
        expected[tuple(rendered(tokenizer, prompt + [message]))] = (rewards[c], "abcde"[c])
    assert tree.num_branches == len(completions) and tree.dedup_ratio > 1
    for b in range(tree.num_branches):
        tokens = tree.branch_tokens(b)
        assert (tree.branch_fields["reward"][b], tree.branch_fields["id"][b]) == expected[tuple(tokens)]
        assert tree.branch_loss_mask(b) == [0] * len(prompt_ids) + [1] * (len(tokens) - len(prompt_ids))
    # splitting the group into parts keeps each field value on the branch it belongs to
    parts = split_tree(tree, max_tokens=tree.num_tokens - 1)
    assert len(parts) > 1
    for part in parts:
        for b in range(part.num_branches):
            fields = (part.branch_fields["reward"][b], part.branch_fields["id"][b])
            assert fields == expected[tuple(part.branch_tokens(b))]
    restored = Tree.from_dict(datasets.Dataset.from_list([tree.to_dict()])[0])
    assert restored.branch_fields == tree.branch_fields


def test_completion_errors(tokenizer):
    with pytest.raises(ValueError, match="completion 1 is empty"):
        tree_from_completions("Q:", [" a", ""], tokenizer)
    with pytest.raises(ValueError, match=r"branch_fields\['reward'\] has 1"):
        tree_from_completions("Q:", [" a", " b"], tokenizer, {"reward": [1.0]})
    with pytest.raises(ValueError, match="prompt is plain text"):
        tree_from_completions("Q:", [{"role": "assistant", "content": "a"}], tokenizer)
    with pytest.raises(ValueError, match="completion 0: the chat template's rendering .* is not a prefix"):
        tree_from_completions(CONVERSATION[:1], ["a"], tokenizer, chat_template=PREFIX_BREAKING_TEMPLATE)


def test_boundary_merging_tokenizer_cannot_corrupt_the_tree(tokenizer):
    """SmolLM2's BPE merges text across the prompt/completion boundary ("is" + "n't" -> "isn't"): branches
    must be the full tokenization, never prompt tokens glued to completion tokens."""
    prompt, completions = "The answer is", ["n't obvious", " 4", "n't 4"]
    glued = tokenizer(prompt)["input_ids"] + tokenizer(completions[0], add_special_tokens=False)["input_ids"]
    full = tokenizer(prompt + completions[0] + tokenizer.eos_token)["input_ids"]
    assert glued + [tokenizer.eos_token_id] != full  # the precondition that makes this test meaningful
    branches = completions_to_branches(prompt, completions, tokenizer)
    assert branches.num_boundary_merges == 2
    tree = tree_from_completions(prompt, completions, tokenizer)
    for b, completion in enumerate(completions):
        text = prompt + completion + tokenizer.eos_token
        assert tree.branch_tokens(b) == tokenizer(text)["input_ids"]
        # the trained span starts where the full tokenization leaves the prompt tokens, so it covers the
        # whole completion (and, when merged, the merged token that also holds the prompt's end)
        decoded = tokenizer.decode(trained_tokens(tree.branch_tokens(b), tree.branch_loss_mask(b)))
        assert decoded.endswith(completion + tokenizer.eos_token) and text.endswith(decoded)
    # "isn't" branches fork before " is": they share "The answer", then split by their real tokens
    assert tree.node_parents.count(-1) == 1 and tree.dedup_ratio > 1
    # the same holds for a chat template: the generation prompt's "\n" merges with a leading "\n"
    prompt, completions = CONVERSATION[:1], ["\n\nFour.", "Four."]
    branches = completions_to_branches(prompt, completions, tokenizer)
    assert branches.num_boundary_merges == 1
    for sequence, completion in zip(branches.sequences, completions):
        assert sequence == rendered(tokenizer, prompt + [{"role": "assistant", "content": completion}])


# --------------------------------------------------------------------------- datasets
def test_build_tree_dataset_prompt_completion_rows_num_proc_and_drops(tokenizer):
    rows = [
        ("Q: 1+1?", " 2", 1.0),
        ("Q: 2+2?", " 4", 1.0),
        ("Q: 1+1?", " 3", 0.0),
        ("Q: 3+3?", "", 0.0),  # empty completion: dropped
        (None, " x", 0.0),  # missing prompt: dropped
        ("Q: 2+2?", " 5", 0.0),
        ("Q: 1+1?", " two", 0.5),
    ]
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [r[0] for r in rows],
            "completion": [r[1] for r in rows],
            "reward": [r[2] for r in rows],
            "source": ["x"] * len(rows),
        }
    )
    trees, stats = build_tree_dataset_with_stats(dataset, tokenizer, num_proc=2, branch_fields=["reward"])
    assert stats.num_rows == len(rows)
    assert stats.num_dropped_rows == {"empty completion": 1, "missing prompt": 1}
    assert stats.num_trees == len(trees) == 2  # grouped by identical prompt tokens
    assert stats.num_branches == 5 and stats.num_branch_tokens > stats.num_tree_tokens
    assert set(trees.column_names) == {*Tree.from_sequences([[1, 2]]).to_dict(), "branch_fields"}
    expected = {
        tuple(tokenizer(p + c + tokenizer.eos_token)["input_ids"]): (p, r) for p, c, r in rows if p is not None and c
    }
    seen = []
    for i, row in enumerate(trees):
        tree = Tree.from_dict(row, row=i)
        branches = [expected[tuple(tree.branch_tokens(b))] for b in range(tree.num_branches)]
        assert len({prompt for prompt, _ in branches}) == 1  # one prompt per tree
        assert [reward for _, reward in branches] == tree.branch_fields["reward"]
        seen.extend(tuple(tree.branch_tokens(b)) for b in range(tree.num_branches))
    assert sorted(seen) == sorted(expected)  # every kept row is in exactly one tree


def test_build_tree_dataset_completion_lists_and_key_grouping(tokenizer):
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Pick a {thing}."}] for thing in ("colour", "fruit", "colour")],
            "completions": [["Red.", "", "Blue."], ["Apple.", "Pear."], ["Green."]],
            "advantage": [[0.5, 0.0, -0.5], [1.0, -1.0], [0.0]],
            "task": ["t1", "t1", "t2"],
        }
    )
    trees, stats = build_tree_dataset_with_stats(
        dataset, tokenizer, group_by="task", branch_fields=["advantage", "task"]
    )
    # the key merges two different prompts into one tree and keeps an identical prompt with another key apart
    assert len(trees) == 2 and stats.num_branches == 5
    assert Tree.from_dict(trees[1]).branch_fields == {"advantage": [0.0], "task": ["t2"]}
    assert stats.num_dropped_completions == {"empty completion": 1} and not stats.num_dropped_rows
    tree = Tree.from_dict(trees[0])
    assert tree.branch_fields == {"advantage": [0.5, -0.5, 1.0, -1.0], "task": ["t1"] * 4}
    for b, (row, completion) in enumerate([(0, "Red."), (0, "Blue."), (1, "Apple."), (1, "Pear.")]):
        message = {"role": "assistant", "content": completion}
        assert tree.branch_tokens(b) == rendered(tokenizer, dataset[row]["prompt"] + [message])
    bad = dataset.map(lambda r: {"advantage": r["advantage"][:1]})
    with pytest.raises(ValueError, match=r"row 0: branch field 'advantage'.*one value per completion"):
        build_tree_dataset(bad, tokenizer, branch_fields=["advantage"])


def test_build_tree_dataset_messages_rows(tokenizer):
    other = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Four."}]
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION, CONVERSATION[:1], other]})
    trees, stats = build_tree_dataset_with_stats(dataset, tokenizer, chat_template=QWEN3_TEMPLATE)
    assert stats.num_dropped_rows == {"no assistant message": 1}
    assert len(trees) == 2 and stats.num_branches == 4  # one tree per conversation by default
    # Arrow gives every message every key (missing ones as None); rendering must not change
    expected = conversation_to_branches(CONVERSATION, tokenizer, chat_template=QWEN3_TEMPLATE)[0]
    tree = Tree.from_dict(trees[0])
    assert [tree.branch_tokens(b) for b in range(tree.num_branches)] == expected
    # identical leading tokens (same first prompt) merge the two conversations into one tree
    merged = build_tree_dataset(dataset, tokenizer, chat_template=QWEN3_TEMPLATE, group_by=GROUP_BY_PROMPT_TOKENS)
    assert len(merged) == 1
    tree = Tree.from_dict(merged[0])
    assert tree.num_branches == 4 and tree.node_parents.count(-1) == 1


def test_build_tree_dataset_input_errors(tokenizer):
    with pytest.raises(ValueError, match="match no supported format"):
        build_tree_dataset(datasets.Dataset.from_dict({"body": ["a"]}), tokenizer)
    dataset = datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    with pytest.raises(ValueError, match="group_by='prompt_id' is not a column"):
        build_tree_dataset(dataset, tokenizer, group_by="prompt_id")
    with pytest.raises(ValueError, match="branch_fields names 'reward'"):
        build_tree_dataset(dataset, tokenizer, branch_fields=["reward"])
    conversations = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    with pytest.raises(ValueError, match=r"row 0: assistant message 1"):
        build_tree_dataset(conversations, tokenizer, chat_template=PREFIX_BREAKING_TEMPLATE)
