"""In-batch merging (``merge_in_batch``, on by default): the trees of each micro-batch are merged into tries by their
tokens before packing, so rows that share only a system prompt compute it once, with TRL's batches and objective
(TreeSFTTrainer, with TRL's token metrics; TreeDPO/KTO/RewardTrainer merge every row of TRL's forward).

Oracles: each branch alone through the model's own attention (``tests.helpers.per_branch_loss``) for the collator,
TRL's own ``SFTTrainer`` (float64, one SGD step) for ``TreeSFTTrainer``, and the unmerged path
(``merge_in_batch=False``) where TRL has no such option ("sequence" normalization).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.collator import pop_packing_stats
from hf_tree.packing import PackingConfig, merge_trees
from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
from hf_tree.trl.reward import TreeRewardConfig, TreeRewardTrainer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    TRL_STEP_TOLERANCE,
    assert_same_step_as_trl,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    per_branch_loss,
    relative_error,
    saved_tiny_model,
    tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)

TOLERANCE = 1e-9
SYSTEM = [5, 40, 41, 42, 43, 44, 45, 7]  # a system turn of the word template below: "w5 w40 ... w45 w7"
# Three rows sharing only the system prompt (one also a first user word), one row without it.
GROUPS = [
    ([SYSTEM + [5, 10, 11, 7, 6, 20, 21, 7]], [[0] * 12 + [1] * 4]),
    ([SYSTEM + [5, 10, 12, 7, 6, 22, 7], SYSTEM + [5, 13, 7, 6, 23, 24, 7]], None),
    ([[5, 30, 31, 7, 6, 25, 7]], [[0, 0, 0, 0, 1, 1, 1]]),
]
TEMPLATE = (  # word-tokenizer chat template (w5 = user/system start, w6 = assistant start, w7 = end of turn)
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ 'w6 ' }}{%- generation -%}{{ m.content + ' w7 ' }}{%- endgeneration -%}"
    "{%- else -%}{{ 'w5 ' + m.content + ' w7 ' }}{%- endif -%}"
    "{%- endfor -%}"
)
SYSTEM_TEXT = "w40 w41 w42 w43 w44 w45"
CONVERSATIONS = [  # share only the system prompt
    [("user", "w10 w11"), ("assistant", "w20 w21"), ("user", "w12"), ("assistant", "w22 w23 w24")],
    [("user", "w13 w14"), ("assistant", "w25")],
    [("user", "w15"), ("assistant", "w26 w27"), ("user", "w16 w17"), ("assistant", "w28")],
    [("user", "w18"), ("assistant", "w29 w30 w31")],
]


def _trees() -> list[Tree]:
    return [
        Tree.from_sequences(sequences, masks, {"id": [f"{i}.{b}" for b in range(len(sequences))]})
        for i, (sequences, masks) in enumerate(GROUPS)
    ]


def test_merge_keeps_every_branch_with_its_mask_and_fields():
    trees = _trees()
    merged = merge_trees(trees)
    assert len(merged) == 1  # every branch starts with token 5: one trie
    (tree,) = merged
    branches = [
        (t.branch_tokens(b), t.branch_loss_mask(b), t.branch_fields["id"][b])
        for t in trees
        for b in range(t.num_branches)
    ]
    assert [
        (tree.branch_tokens(b), tree.branch_loss_mask(b), tree.branch_fields["id"][b]) for b in range(tree.num_branches)
    ] == branches
    assert tree.num_branch_tokens == sum(t.num_branch_tokens for t in trees)
    assert tree.num_tokens < sum(t.num_tokens for t in trees)  # the system prompt is stored once
    assert float(tree.token_weights.sum()) == sum(float(t.token_weights.sum()) for t in trees)
    assert float(tree.sequence_weights.sum()) == pytest.approx(sum(float(t.sequence_weights.sum()) for t in trees))


def test_merge_separates_first_tokens_and_field_names_and_keeps_lone_trees():
    lone = Tree.from_sequences([[9, 1, 2]])
    with_fields = Tree.from_sequences([[5, 1, 2]], branch_fields={"reward": [1.0]})
    plain = Tree.from_sequences([[5, 1, 3]])
    merged = merge_trees([lone, with_fields, plain])
    assert merged[0] is lone and merged[1] is with_fields and merged[2] is plain  # nothing to share
    both = merge_trees([Tree.from_sequences([[5, 1, 2]]), plain])
    assert len(both) == 1 and both[0].num_tokens == 4


def test_merge_leaves_out_a_trie_that_trains_nothing():
    # a branch that trains nothing, alone with its first token, adds nothing to the loss
    forest = Tree.from_sequences([[5, 1, 2], [9, 1, 2]], [[0, 1, 1], [0, 0, 0]])
    other = Tree.from_sequences([[5, 1, 4]])
    merged = merge_trees([forest, other])
    assert len(merged) == 1 and merged[0].num_branches == 2


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("max_packed_tokens", [64, 24], ids=["one_row", "split"])
def test_merged_batch_equals_per_branch_training(normalization, max_packed_tokens):
    """The merged batch's loss, divisor and gradients are the per-branch ones; merging only shares compute."""
    trees = _trees()
    results = {}
    with float64_norms():
        model = tiny_model("llama")
        for merge in (True, False):
            collator = TreeDataCollator(
                max_packed_tokens=max_packed_tokens, normalization=normalization, merge_in_batch=merge
            )
            batch = collator([t.to_dict() for t in trees])
            stats = pop_packing_stats(batch)
            model.zero_grad()
            loss = tree_causal_lm_loss(model, batch)
            loss.backward()
            results[merge] = (loss.detach(), float(batch["num_loss_items"]), grads_of(model), stats)
        model.zero_grad()
        total, divisor = 0.0, 0.0
        for sequences, masks in GROUPS:
            t, d = per_branch_loss(model, sequences, masks, normalization)
            total, divisor = total + t, divisor + d
        reference = total / divisor
        reference.backward()
        reference_grads = grads_of(model)
    for merge, (loss, items, grads, _) in results.items():
        assert relative_error(loss, reference) <= TOLERANCE, merge
        assert items == pytest.approx(float(divisor), rel=1e-12)
        assert max_grad_relative_error(grads, reference_grads) <= TOLERANCE, merge
    merged, unmerged = results[True][3], results[False][3]
    assert merged.num_branch_tokens == unmerged.num_branch_tokens
    assert merged.dedup_ratio > unmerged.dedup_ratio


def test_merge_in_batch_is_validated():
    with pytest.raises(ValueError, match="merge_in_batch='yes' must be True or False"):
        PackingConfig(merge_in_batch="yes")
    assert PackingConfig(merge_in_batch=0).merge_in_batch is False  # the CLI's int flag


# ------------------------------------------------------------------------------------------------ TreeSFTTrainer
def _messages(turns):
    return [{"role": "system", "content": SYSTEM_TEXT}] + [{"role": r, "content": c} for r, c in turns]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return saved_tiny_model(tmp_path_factory.mktemp("in_batch_merging"), torch.float64)


def _sft_run(cls, config_cls, path: str, **settings):
    """One SGD step over the four conversations (one batch of 4, TRL's default random sampling), float64."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    dataset = datasets.Dataset.from_list([{"messages": _messages(turns)} for turns in CONVERSATIONS])
    defaults = dict(max_steps=1, learning_rate=1.0, max_length=None, gradient_checkpointing=False, seed=0)
    args = tiny_trl_config(config_cls, path, torch.float64, **{**defaults, **settings})
    trainer = cls(model=path, args=args, train_dataset=dataset, processing_class=tokenizer)
    return trainer, train_and_measure_updates(trainer)


@pytest.mark.parametrize("assistant_only_loss", [False, True], ids=["all_tokens", "assistant_only"])
def test_sft_merges_conversations_sharing_a_system_prompt_and_takes_trls_step(path, assistant_only_loss):
    """TRL's default batching (one batch of the four rows): the rows share only their system prompt, which the tree
    computes once (dedup > 1 logged), and the step is TRL's."""
    trl, trl_updates = _sft_run(SFTTrainer, SFTConfig, path, assistant_only_loss=assistant_only_loss)
    tree, tree_updates = _sft_run(TreeSFTTrainer, TreeSFTConfig, path, assistant_only_loss=assistant_only_loss)
    assert len(tree.train_dataset) == 4  # one tree per row, merged per micro-batch
    assert tree.state.log_history[0]["dedup_ratio"] > 1.3
    assert tree.state.log_history[0]["loss"] == pytest.approx(trl.state.log_history[0]["loss"], rel=TRL_STEP_TOLERANCE)
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name


@pytest.mark.parametrize(
    "settings",
    [
        dict(normalization="sequence", per_device_train_batch_size=2, gradient_accumulation_steps=2),
        dict(max_packed_tokens=16, max_length=64),  # "auto": the merged tree is larger than a row, runs depth-first
        dict(max_packed_tokens=32, tree_execution="packed"),  # ... or is split by its branches
    ],
    ids=["sequence_accumulated", "depth_first", "split"],
)
def test_sft_merged_step_equals_the_unmerged_step(path, settings):
    merged, merged_updates = _sft_run(TreeSFTTrainer, TreeSFTConfig, path, **settings)
    unmerged, unmerged_updates = _sft_run(TreeSFTTrainer, TreeSFTConfig, path, merge_in_batch=False, **settings)
    assert merged.state.log_history[0]["dedup_ratio"] > unmerged.state.log_history[0]["dedup_ratio"]
    assert merged.state.log_history[0]["loss"] == pytest.approx(unmerged.state.log_history[0]["loss"], rel=TOLERANCE)
    for name, update in unmerged_updates.items():
        assert relative_error(merged_updates[name], update) <= TOLERANCE, name
    assert any(u.norm() > 0 for u in unmerged_updates.values())


@pytest.mark.parametrize("settings", [{}, dict(max_packed_tokens=16, max_length=64)], ids=["packed", "depth_first"])
def test_sft_logs_trls_token_metrics(path, settings):
    """TRL's ``entropy``, ``mean_token_accuracy`` (per micro-batch, averaged over the two accumulated ones) and
    ``num_tokens`` (tokens of the rows trained so far), computed on the merged trees' branches, at every step of
    three (the model learns some tokens after the first: the accuracy is not 0 throughout)."""
    common = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        train_sampling_strategy="sequential",
        max_steps=3,
        learning_rate=3.0,
    )
    trl, _ = _sft_run(SFTTrainer, SFTConfig, path, **common)
    tree, _ = _sft_run(TreeSFTTrainer, TreeSFTConfig, path, **common, **settings)
    trl_logs, tree_logs = trl.state.log_history[:3], tree.state.log_history[:3]
    assert all(log["dedup_ratio"] > 1.0 for log in tree_logs)
    assert max(log["mean_token_accuracy"] for log in trl_logs) > 0.1
    for trl_log, tree_log in zip(trl_logs, tree_logs, strict=True):
        assert tree_log["num_tokens"] == trl_log["num_tokens"] > 0
        # TRL's statistics are float32, and its updates float32-rounded (TRL_STEP_TOLERANCE)
        assert tree_log["entropy"] == pytest.approx(trl_log["entropy"], rel=1e-5)
        assert tree_log["mean_token_accuracy"] == pytest.approx(
            trl_log["mean_token_accuracy"], rel=1e-7
        )  # TRL: float32


# --------------------------------------------------------------------------- DPO, KTO, reward: TRL's batches merged
SYSTEM_WORDS = "w40 w41 w42 w43 w44 w45 "  # every prompt starts with it; nothing else is shared across pairs
PREFERENCE = {
    "prompt": [SYSTEM_WORDS + p for p in ("w10 w11", "w12", "w13 w14 w15", "w16")],
    "chosen": [" w20 w21", " w22", " w23 w24", " w25"],
    "rejected": [" w26", " w27 w28", " w29", " w30 w31"],
}
KTO = {
    "prompt": PREFERENCE["prompt"] + PREFERENCE["prompt"][:2],
    "completion": PREFERENCE["chosen"] + PREFERENCE["rejected"][:2],
    "label": [True, False, True, False, True, False],
}


def _preference_step(kind: str, tree: bool, path: str, **settings):
    """One SGD step of TRL's trainer (``tree=False``) or its tree twin on rows sharing only a system prompt."""
    classes = {
        "dpo": ((DPOTrainer, DPOConfig), (TreeDPOTrainer, TreeDPOConfig), PREFERENCE, {}),
        "kto": ((KTOTrainer, KTOConfig), (TreeKTOTrainer, TreeKTOConfig), KTO, dict(per_device_train_batch_size=3)),
        "reward": ((RewardTrainer, RewardConfig), (TreeRewardTrainer, TreeRewardConfig), PREFERENCE, {}),
    }
    trl_classes, tree_classes, rows, defaults = classes[kind]
    cls, config_cls = tree_classes if tree else trl_classes
    args = tiny_trl_config(config_cls, path, torch.float64, max_steps=1, learning_rate=1.0, **defaults, **settings)
    trainer = cls(path, args=args, train_dataset=datasets.Dataset.from_dict(rows), processing_class=word_tokenizer())
    return trainer, train_and_measure_updates(trainer)


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_preference_trainers_merge_every_row_of_trls_batch(path, kind):
    """TRL's batch (all rows of the micro-batch) merges into one trie by tokens: rows of different pairs share the
    system prompt (dedup above the unmerged path's 1.0), and the step is TRL's and the unmerged one's."""
    trl, trl_updates = _preference_step(kind, False, path)
    merged, merged_updates = _preference_step(kind, True, path)
    unmerged, unmerged_updates = _preference_step(kind, True, path, merge_in_batch=False)
    logged = [run.state.log_history[0]["tree/dedup_ratio"] for run in (merged, unmerged)]
    assert logged[0] > 1.3 and logged[1] == 1.0, logged
    assert_same_step_as_trl(trl, trl_updates, merged, merged_updates)
    for name, update in unmerged_updates.items():
        assert relative_error(merged_updates[name], update) <= TRL_STEP_TOLERANCE, name
