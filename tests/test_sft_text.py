"""``text`` rows (TRL's language-modeling format) in TreeSFTTrainer against TRL's own SFTTrainer on the same rows.

Oracle: TRL 1.16's ``SFTTrainer`` (float64, ``bf16=False``, one SGD step clipped at 1.0): the logged loss and every
parameter update. The rows share a prefix, which the micro-batch's trie computes once (dedup > 1 logged).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from trl import SFTConfig, SFTTrainer

from hf_tree.builders import build_tree_dataset
from hf_tree.builders.dataset import text_branch
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

# Rows sharing "w10 w11 w12"; TRL appends the EOS to a text that does not end with it (the last row already does).
TEXTS = ["w10 w11 w12 w20 w21 ", "w10 w11 w12 w22 ", "w10 w11 w13 w23 w24 w25 ", "w30 w31 [EOS]"]


def _run(cls, config_cls, path: str, texts=TEXTS, **settings):
    dataset = datasets.Dataset.from_dict({"text": texts})
    defaults = dict(max_steps=1, learning_rate=1.0, max_length=None, gradient_checkpointing=False, seed=0)
    args = tiny_trl_config(config_cls, path, torch.float64, **{**defaults, **settings})
    trainer = cls(model=path, args=args, train_dataset=dataset, processing_class=word_tokenizer())
    return trainer, train_and_measure_updates(trainer)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return saved_tiny_model(tmp_path_factory.mktemp("sft_text"), torch.float64)


def test_text_rows_are_tokenized_as_trl_does():
    tokenizer = word_tokenizer()
    eos = tokenizer.eos_token_id
    trees = build_tree_dataset(datasets.Dataset.from_dict({"text": TEXTS}), tokenizer)
    assert len(trees) == len(TEXTS)  # one tree per row; the micro-batch merges them
    branches = [Tree.from_dict(row).branch_tokens(0) for row in trees]
    assert branches[0] == [10, 11, 12, 20, 21, eos] and branches[3] == [30, 31, eos]  # EOS once
    assert branches == [text_branch(t, tokenizer) for t in TEXTS]
    assert all(Tree.from_dict(row).branch_loss_mask(0)[1:] == [1] * (len(b) - 1) for row, b in zip(trees, branches))


def test_text_rows_train_trls_step_and_merge_their_prefix(path):
    trl, trl_updates = _run(SFTTrainer, SFTConfig, path)
    tree, tree_updates = _run(TreeSFTTrainer, TreeSFTConfig, path)
    assert tree.state.log_history[0]["dedup_ratio"] > 1.2
    assert tree.state.log_history[0]["loss"] == pytest.approx(trl.state.log_history[0]["loss"], rel=TRL_STEP_TOLERANCE)
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name
    assert any(u.norm() > 0 for u in trl_updates.values())


def test_text_rows_refuse_assistant_only_loss_as_trl_does(path):
    with pytest.raises(ValueError, match="dataset is not conversational"):
        _run(TreeSFTTrainer, TreeSFTConfig, path, assistant_only_loss=True)
