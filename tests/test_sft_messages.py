"""TreeSFTTrainer on ``messages`` rows against TRL's own SFTTrainer on the same rows (issue 26, item 3).

Oracle: TRL 1.16's ``SFTTrainer`` (float64, ``bf16=False``, same seed, one SGD step clipped at 1.0): the logged
loss and every parameter update must match (``assert_same_step_as_trl``). Two chat templates over the word tokenizer,
both with ``{% generation %}`` markers (TRL's ``assistant_only_loss`` needs them and uses them as they are):

- ``PLAIN`` renders every turn the same way in every later turn (no history rewriting);
- ``REWRITING`` drops the ``reasoning_content`` of every assistant turn but the last one rendered (as Qwen3 does
  with earlier turns), so a turn's context differs between its own per-turn sample and the whole conversation.

``messages_branches="conversation"`` (the default) is TRL's objective on both, with ``assistant_only_loss`` False
(every token) and True (the template's assistant tokens). ``"per_turn"`` is TRL's ``assistant_only_loss=True``
objective on ``PLAIN`` only: on ``REWRITING`` each turn is trained in the context rendered at its own turn.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from trl import SFTConfig, SFTTrainer

from hf_tree.builders import GROUP_BY_PROMPT_TOKENS, build_tree_dataset, conversation_branch
from hf_tree.tree import Tree
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    TRL_STEP_TOLERANCE,
    relative_error,
    saved_tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)

# Word-tokenizer templates (w5 = user/system start, w6 = assistant start, w7 = end of turn, w8/w9 = think tags).
_REASONING = "{{ 'w8 ' + m.reasoning_content + ' w9 ' }}"
_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ 'w6 ' }}{%- generation -%}"
    "{%- if m.reasoning_content CONDITION -%}" + _REASONING + "{%- endif -%}"
    "{{ m.content + ' w7 ' }}{%- endgeneration -%}"
    "{%- else -%}{{ 'w5 ' + m.content + ' w7 ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'w6 ' }}{%- endif -%}"
)
PLAIN = _TEMPLATE.replace(" CONDITION", "")
REWRITING = _TEMPLATE.replace(" CONDITION", " and loop.last")
TEMPLATES = {"plain": PLAIN, "rewriting": REWRITING}


def _assistant(content: str, reasoning: str | None = None) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def _user(content: str) -> dict:
    return {"role": "user", "content": content, "reasoning_content": None}


# Rows 0 and 1 share their first two turns (merged by group_by=GROUP_BY_PROMPT_TOKENS), row 2 has a system prompt.
ROWS = [
    [_user("w10 w11"), _assistant("w20 w21", "w30 w31"), _user("w12"), _assistant("w22 w23 w24", "w32")],
    [_user("w10 w11"), _assistant("w20 w21", "w30 w31"), _user("w13 w14"), _assistant("w25", "w33 w34")],
    [{"role": "system", "content": "w40", "reasoning_content": None}, _user("w15"), _assistant("w26 w27")],
    [_user("w16 w17 w18"), _assistant("w28", "w41"), _user("w19"), _assistant("w29 w35")]
    + [_user("w36"), _assistant("w37")],
]


def assert_same_step_as_trl(trl, trl_updates: dict, tree, tree_updates: dict) -> None:
    """``tests.helpers.assert_same_step_as_trl`` at float32 level for the loss too: TRL's SFT loss is transformers'
    ``ForCausalLMLoss``, which casts the logits to float32 even in a float64 model (seen: 1e-7 relative)."""
    trl_loss, tree_loss = trl.state.log_history[0]["loss"], tree.state.log_history[0]["loss"]
    assert tree_loss == pytest.approx(trl_loss, rel=TRL_STEP_TOLERANCE)
    assert trl_updates.keys() == tree_updates.keys()
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name
    assert any(u.norm() > 0 for u in trl_updates.values())


def _tokenizer(template: str):
    tokenizer = word_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def skip_where_assistant_masks_overrun(template: str) -> None:
    """Skip where transformers' ``return_assistant_tokens_mask`` runs past a ``{% generation %}`` span that ends on
    whitespace the pre-tokenizer strips (transformers#47325, fixed after 5.16.1: there the next user turn of these
    templates is marked as assistant tokens, so TRL's ``assistant_only_loss`` and hf_tree's 'conversation' branches,
    which read that mask, train it, and 'per_turn' differs from them)."""
    tokenizer = _tokenizer(template)
    encoded = tokenizer.apply_chat_template(ROWS[0], return_dict=True, return_assistant_tokens_mask=True)
    trained = tokenizer.decode([t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]).split()
    if "w12" in trained:  # the second user turn
        pytest.skip("transformers' assistant mask runs past a generation span ending on stripped whitespace (#47325)")


def _dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"messages": m} for m in ROWS])


def _run(cls, config_cls, path: str, template: str, **settings):
    """One SGD step on all four rows (batch of 4), float64."""
    defaults = dict(
        max_steps=1,
        learning_rate=1.0,
        max_length=None,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        seed=0,
    )
    args = tiny_trl_config(config_cls, path, torch.float64, **{**defaults, **settings})
    trainer = cls(model=path, args=args, train_dataset=_dataset(), processing_class=_tokenizer(template))
    return trainer, train_and_measure_updates(trainer)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return saved_tiny_model(tmp_path_factory.mktemp("sft_messages"), torch.float64)


@pytest.fixture(scope="module")
def trl_runs(path):
    """TRL's own step, per (template, assistant_only_loss), run once."""
    cache: dict = {}

    def get(template: str, assistant_only_loss: bool):
        key = (template, assistant_only_loss)
        if key not in cache:
            cache[key] = _run(SFTTrainer, SFTConfig, path, TEMPLATES[template], assistant_only_loss=assistant_only_loss)
        return cache[key]

    return get


@pytest.mark.parametrize("template", ["plain", pytest.param("rewriting", marks=pytest.mark.slow)])
@pytest.mark.parametrize("assistant_only_loss", [False, True], ids=["all_tokens", "assistant_only"])
def test_default_messages_branches_train_trls_objective(path, trl_runs, template, assistant_only_loss):
    """The default (messages_branches="conversation") is TRL's objective; rows 0-1 merge into one tree."""
    trl, trl_updates = trl_runs(template, assistant_only_loss)
    tree, tree_updates = _run(
        TreeSFTTrainer,
        TreeSFTConfig,
        path,
        TEMPLATES[template],
        assistant_only_loss=assistant_only_loss,
        group_by=GROUP_BY_PROMPT_TOKENS,
    )
    assert len(tree.train_dataset) == 3 and tree.state.log_history[0]["dedup_ratio"] > 1.0
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


@pytest.mark.parametrize("template", ["plain", "rewriting"])
def test_per_turn_branches_equal_trl_only_without_history_rewriting(path, trl_runs, template):
    """'per_turn' trains each assistant turn once in the context of its own turn: TRL's assistant_only_loss=True
    objective when the template renders earlier turns unchanged, a different one when it rewrites them."""
    if template == "plain":
        skip_where_assistant_masks_overrun(PLAIN)
    trl, trl_updates = trl_runs(template, True)
    tree, tree_updates = _run(
        TreeSFTTrainer,
        TreeSFTConfig,
        path,
        TEMPLATES[template],
        assistant_only_loss=True,
        messages_branches="per_turn",
        batch_unit="trees",
    )
    if template == "plain":
        assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)
    else:
        trl_loss, tree_loss = trl.state.log_history[0]["loss"], tree.state.log_history[0]["loss"]
        assert abs(tree_loss - trl_loss) > 1e-3 * abs(trl_loss)
        assert max(relative_error(tree_updates[n], u) for n, u in trl_updates.items()) > 1e-3


@pytest.mark.parametrize("execution", [pytest.param("auto", marks=pytest.mark.slow), "depth_first"])
def test_branches_longer_than_a_row_train_depth_first_as_trl(path, trl_runs, execution):
    """With depth-first execution TRL's max_length is the branch limit as it is (not capped at the row): branches of
    up to 24 tokens in rows of 8 train depth-first (merged rows 0-1 included) and take TRL's step on the same rows."""
    trl, trl_updates = trl_runs("plain", False)  # max_length=None: no TRL row reaches 64 tokens either
    tree, tree_updates = _run(
        TreeSFTTrainer,
        TreeSFTConfig,
        path,
        PLAIN,
        group_by=GROUP_BY_PROMPT_TOKENS,
        max_length=64,
        max_packed_tokens=8,
        tree_execution=execution,
    )
    assert tree.args.max_branch_tokens == 64
    rows = tree.train_dataset.to_list()
    longest = max(int(Tree.from_dict(row).branch_lengths.max()) for row in rows)
    assert 8 < longest < 64
    # every tree is larger than a row; merged in the batch (they all start with "w5"), they run as one trie
    assert len(tree.data_collator(rows)["depth_first_trees"]) == 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_max_length_is_validated_as_the_depth_first_branch_limit():
    with pytest.raises(ValueError, match=r"max_length=1 .*tree_execution='auto'"):
        TreeSFTConfig(output_dir="unused", bf16=False, max_length=1, tree_execution="auto")
    # "auto" (the default) lets a branch exceed the row; with "packed" every branch must fit one
    TreeSFTConfig(output_dir="unused", bf16=False, max_length=64, max_packed_tokens=8, max_branch_tokens=64)
    with pytest.raises(ValueError, match=r"max_branch_tokens=64 must be an integer in \[2, max_packed_tokens=8\]"):
        TreeSFTConfig(
            output_dir="unused", bf16=False, max_packed_tokens=8, max_branch_tokens=64, tree_execution="packed"
        )


def test_conversation_branch_is_trls_tokenization():
    """One rendering: the template's tokens, all trained or only the {% generation %} tokens."""
    skip_where_assistant_masks_overrun(REWRITING)
    tokenizer = _tokenizer(REWRITING)
    messages = ROWS[0]
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tokens, mask = conversation_branch(messages, tokenizer)
    assert tokens == list(encoded["input_ids"]) and mask == [1] * len(tokens)
    tokens, mask = conversation_branch(messages, tokenizer, assistant_only_loss=True)
    assert mask == list(encoded["assistant_masks"])
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m]).split()
    assert trained == ["w20", "w21", "w7", "w8", "w32", "w9", "w22", "w23", "w24", "w7"]  # earlier reasoning dropped


def test_conversation_rows_merge_through_group_by():
    trees = build_tree_dataset(
        _dataset(), _tokenizer(PLAIN), messages_branches="conversation", group_by=GROUP_BY_PROMPT_TOKENS
    )
    shared = Tree.from_dict(trees[0])
    assert shared.num_branches == 2 and shared.num_tokens < shared.num_branch_tokens


def test_assistant_only_loss_without_generation_markers_is_refused(path):
    unmarked = "{% for m in messages %}{{ 'w5 ' + m.content + ' w7 ' }}{% endfor %}"
    with pytest.raises(ValueError, match=r"row 0: assistant_only_loss=True.*generation"):
        build_tree_dataset(_dataset(), _tokenizer(unmarked), messages_branches="conversation", assistant_only_loss=True)
    with pytest.raises(ValueError, match="generation"):  # TRL's own check, inherited (it has no training variant)
        _run(TreeSFTTrainer, TreeSFTConfig, path, unmarked, assistant_only_loss=True)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"train_on": "all_assistant"}, "train_on='all_assistant' applies to messages_branches='per_turn' only"),
        ({"messages_branches": "turns"}, "messages_branches='turns' must be one of"),
        ({"messages_branches": "per_turn", "train_on": "every"}, "train_on='every' must be one of"),
    ],
)
def test_messages_options_that_do_not_apply_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        TreeSFTConfig(output_dir="unused", bf16=False, **settings)
    assert TreeSFTConfig(output_dir="unused", bf16=False).messages_branches == "conversation"
