"""The tree trainers deal TRL's rows: every micro-batch holds exactly the rows TRL's sampler gives it, rows TRL drops
before batching are dropped the same way, and a run left with nothing to train is refused before its first step.

Oracle: TRL's own trainer on the same config, seed and data (float64, SGD, two or three optimizer steps of one
micro-batch each, so a row in another micro-batch moves the parameters differently; within one step the update is the
step's sum whatever its micro-batches hold). Every test here failed before issue 50: rows with the same prompt were
merged across the dataset into one tree (dealt to one micro-batch whole), and rows truncation leaves untrained were
dropped per micro-batch at collation instead of before batching.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset, concatenate_datasets
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from hf_tree import TreeTrainer, TreeTrainingArguments
from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.tree import Tree
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    FIXED_COMPLETIONS,
    SMOLLM2_VOCAB,
    TRL_STEP_TOLERANCE,
    exact_sgd_args,
    one_step,
    one_step_trainer,
    relative_error,
    saved_tiny_model,
    tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import prompt_completion_dataset

# Prompts repeat, never next to each other: grouping them across the dataset would put rows 0 and 2 in one batch.
REPEATED_PROMPTS = {
    "prompt": ["w10 w11 w12", "w20 w21", "w10 w11 w12", "w20 w21", "w30 w31 w32 w33", "w10 w11 w12"],
    "completion": [" w40 w41", " w42 w43 w44", " w45", " w46 w47", " w48 w49 w50", " w51 w52"],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("model") / "llama", torch.float64)


def sft_run(trainer_cls, config_cls, model_path: str, out: str, rows: dict[str, list[str]], **settings):
    """``(trainer, its updates)`` after ``max_steps`` SGD steps of one micro-batch of 2 rows each (float64)."""
    steps = dict(max_steps=3, learning_rate=1.0, per_device_train_batch_size=2, seed=3) | settings
    args = tiny_trl_config(config_cls, out, torch.float64, **steps)
    trainer = trainer_cls(
        model=model_path, args=args, train_dataset=Dataset.from_dict(rows), processing_class=word_tokenizer()
    )
    return trainer, train_and_measure_updates(trainer)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_same_steps_as_trl(trl, trl_updates, tree, tree_updates) -> None:
    """Every step's loss (logged in float32) and token count as TRL's, and the parameters moved as TRL moved them."""
    assert losses(tree) == pytest.approx(losses(trl), rel=1e-6)
    trl_tokens, tree_tokens = ([h["num_tokens"] for h in t.state.log_history if "loss" in h] for t in (trl, tree))
    assert tree_tokens == trl_tokens
    assert trl_updates.keys() == tree_updates.keys()
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name


@pytest.mark.parametrize(
    "sampling",
    [
        dict(train_sampling_strategy="sequential"),
        pytest.param(dict(), marks=pytest.mark.slow),  # the same dealing, another order (Trainer's RandomSampler)
        pytest.param(dict(train_sampling_strategy="sequential", shuffle_dataset=True), marks=pytest.mark.slow),
    ],
    ids=["sequential", "random", "shuffle_dataset"],
)
def test_rows_with_repeated_prompts_train_in_trls_batches(tmp_path, model_path, sampling):
    """By default (group_by=None) each row is its own tree, so the sampler deals TRL's rows; rows of one micro-batch
    sharing a prompt still merge there (merge_in_batch). Before issue 50 the default grouped rows by prompt tokens
    across the dataset: 1.0-13 relative update difference, other losses and token counts."""
    trl = sft_run(SFTTrainer, SFTConfig, model_path, str(tmp_path / "trl"), REPEATED_PROMPTS, **sampling)
    tree = sft_run(TreeSFTTrainer, TreeSFTConfig, model_path, str(tmp_path / "tree"), REPEATED_PROMPTS, **sampling)
    assert len(tree[0].train_dataset) == len(REPEATED_PROMPTS["prompt"])  # one tree per row
    assert_same_steps_as_trl(*trl, *tree)


@pytest.mark.slow  # the log line and the grouping; the default is the fast test above
def test_grouping_across_the_dataset_is_asked_for_and_said(tmp_path, model_path, caplog):
    """group_by='<prompt tokens>' still merges rows of one prompt into one tree, and says at start that batches then
    differ from TRL's (they do: the update is another)."""
    settings = dict(train_sampling_strategy="sequential")
    trl = sft_run(SFTTrainer, SFTConfig, model_path, str(tmp_path / "trl"), REPEATED_PROMPTS, **settings)
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        grouped = sft_run(
            TreeSFTTrainer,
            TreeSFTConfig,
            model_path,
            str(tmp_path / "grouped"),
            REPEATED_PROMPTS,
            group_by="<prompt tokens>",
            **settings,
        )
    assert len(grouped[0].train_dataset) == 3  # 3 distinct prompts
    assert "micro-batches then hold other rows than TRL's" in caplog.text
    assert losses(grouped[0]) != pytest.approx(losses(trl[0]), rel=1e-6)


# Rows 1 and 3 have prompts of 6 tokens: with max_length=5 they keep no completion token. TRL drops them from its
# dataset before batching; the other rows keep a trained token, some lose their end.
TRUNCATED = {
    "prompt": ["w10 w11", "w20 w21 w22 w23 w24 w25", "w30", "w40 w41 w42 w43 w44 w45", "w50 w51", "w60", "w70 w71"],
    "completion": [" w12 w13 w14 w15", " w26", " w31 w32", " w46 w47", " w52", " w61 w62 w63 w64 w65", " w72"],
}


@pytest.mark.parametrize("sampling", ["sequential", pytest.param("random", marks=pytest.mark.slow)])
def test_rows_truncation_leaves_untrained_are_dropped_before_batching(tmp_path, model_path, sampling, caplog):
    """Before issue 50 the tree trainer kept them and dropped them per micro-batch at collation: other batches (1.47
    relative update difference)."""
    settings = dict(train_sampling_strategy=sampling, max_length=5)
    trl = sft_run(SFTTrainer, SFTConfig, model_path, str(tmp_path / "trl"), TRUNCATED, **settings)
    assert len(trl[0].train_dataset) == 5
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        tree = sft_run(TreeSFTTrainer, TreeSFTConfig, model_path, str(tmp_path / "tree"), TRUNCATED, **settings)
    assert "2 of 7 rows of the train dataset dropped before batching" in caplog.text
    assert len(tree[0].train_dataset) == 5
    assert_same_steps_as_trl(*trl, *tree)


def test_a_run_left_with_nothing_to_train_is_refused(tmp_path, model_path):
    """Every prompt fills max_length: TRL fails (num_samples=0); the tree trainer refused before its first step
    with the cause and the fix, where it used to train on nothing (loss 0, grad_norm 0) and report success."""
    rows = Dataset.from_dict(TRUNCATED).filter(lambda row: len(row["prompt"].split()) >= 2)
    settings = dict(max_length=2, max_steps=1, per_device_train_batch_size=2)
    args = tiny_trl_config(TreeSFTConfig, str(tmp_path), torch.float64, **settings)
    with pytest.raises(ValueError, match=r"no row left to train.*5 keep no trained token.*max_length=2.*Raise"):
        TreeSFTTrainer(model=model_path, args=args, train_dataset=rows, processing_class=word_tokenizer())


# Rows 1 and 4 are TRL's [EOS] alone (text "" plus its EOS): one token, nothing trained, a batch slot each.
TEXT_WITH_EMPTY_ROWS = {"text": ["w10 w11 w12", "", "w20 w21", "w30 w31 w32 w33", "", "w40 w41 w42"]}


@pytest.mark.parametrize(
    "sampling",
    [
        dict(train_sampling_strategy="sequential"),
        pytest.param(dict(train_sampling_strategy="sequential", shuffle_dataset=True), marks=pytest.mark.slow),
    ],
    ids=["sequential", "shuffle_dataset"],
)
def test_text_rows_of_one_token_keep_their_batch_slot(tmp_path, model_path, sampling, caplog):
    """TRL keeps a row that trains nothing (it takes a slot in its batch); before issue 50 the builder dropped it,
    shifting every later batch (1.20 relative update difference). Token counts differ by those rows' tokens (the
    tree trainer counts trees' tokens), losses and updates do not."""
    trl = sft_run(SFTTrainer, SFTConfig, model_path, str(tmp_path / "trl"), TEXT_WITH_EMPTY_ROWS, **sampling)
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        tree = sft_run(
            TreeSFTTrainer, TreeSFTConfig, model_path, str(tmp_path / "tree"), TEXT_WITH_EMPTY_ROWS, **sampling
        )
    assert "2 rows of the train dataset train no token" in caplog.text
    assert tree[0].tree_row_slots.count(-1) == 2 and len(tree[0].train_dataset) == 4
    assert losses(tree[0]) == pytest.approx(losses(trl[0]), rel=1e-6)
    for name, update in trl[1].items():
        assert relative_error(tree[1][name], update) <= TRL_STEP_TOLERANCE, name


def test_an_empty_completion_trains_trls_eos(tmp_path, model_path):
    """TRL appends its EOS to a plain-text completion "" and trains it; before issue 50 the row was dropped as an
    empty completion (another row in each later batch)."""
    rows = {"prompt": ["w10 w11", "w20 w21 w22", "w30", "w40 w41"], "completion": [" w12", "", " w31 w32", " w42"]}
    trl = sft_run(SFTTrainer, SFTConfig, model_path, str(tmp_path / "trl"), rows, max_steps=2)
    tree = sft_run(TreeSFTTrainer, TreeSFTConfig, model_path, str(tmp_path / "tree"), rows, max_steps=2)
    assert len(tree[0].train_dataset) == 4
    assert_same_steps_as_trl(*trl, *tree)


def prompt_heavy_trees(num_trees: int, prompt_length: int) -> Dataset:
    """Tree rows of one branch each: ``prompt_length`` untrained tokens, then 3 trained ones."""
    rows = []
    for t in range(num_trees):
        tokens = [3 + (t + k) % 90 for k in range(prompt_length + 3)]
        rows.append(Tree.from_sequences([tokens], [[0] * prompt_length + [1] * 3]).to_dict())
    return Dataset.from_list(rows)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_tree_trainer_refuses_a_dataset_its_branch_limit_empties(tmp_path, overlong):
    """Every branch keeps its trained tokens beyond max_branch_tokens: each micro-batch would be dropped at
    collation and the run would end "completed" on nothing (loss 0, grad norm 0), as it did before issue 50."""
    args = TreeTrainingArguments(
        **exact_sgd_args(str(tmp_path), use_cpu=True, max_steps=2),
        max_packed_tokens=16,
        max_branch_tokens=6,
        overlong=overlong,
    )
    with pytest.raises(ValueError, match=r"every tree of the training dataset would be dropped.*4 of its 4 rows"):
        TreeTrainer(model=tiny_model(), args=args, train_dataset=prompt_heavy_trees(4, prompt_length=6))
    empty = prompt_heavy_trees(1, 6).select([])
    with pytest.raises(ValueError, match="the training dataset has no tree rows"):
        TreeTrainer(model=tiny_model(), args=args, train_dataset=empty)


def test_tree_trainer_warns_once_when_the_branch_limit_drops_a_share_of_the_rows(tmp_path, caplog):
    """1 of 4 trees keeps no trained token within max_branch_tokens: one warning at start with the tally."""
    trees = concatenate_datasets([prompt_heavy_trees(3, prompt_length=2), prompt_heavy_trees(1, prompt_length=6)])
    args = TreeTrainingArguments(
        **exact_sgd_args(str(tmp_path), use_cpu=True, max_steps=1),
        max_packed_tokens=16,
        max_branch_tokens=6,
        overlong="truncate",
    )
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        TreeTrainer(model=tiny_model(), args=args, train_dataset=trees)
    assert "1 of its 4 rows (branches) train no token and 1 of its 4 trees are dropped whole" in caplog.text


GPT2_WITHOUT_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("model") / "gpt2", torch.float64, "gpt2", **GPT2_WITHOUT_DROPOUT)


def test_grpo_on_padding_numbered_absolute_positions_says_how_it_differs(tmp_path, gpt2_path, caplog):
    """GPT-2's absolute positions: TRL's training forward numbers a left-padded prompt from its padding, the tree
    forward from its first token. Said once at start, with the measured size (test below); silent before issue 50."""
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        one_step_trainer(TreeGRPOTrainer, TreeGRPOConfig, gpt2_path, peft=False)
    assert caplog.text.count("adds absolute position embeddings") == 1
    assert "TRL's GRPOTrainer training forward numbers a left-padded prompt from its padding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        one_step_trainer(TreeGRPOTrainer, TreeGRPOConfig, gpt2_path, peft=False, tree_forward=False)
    assert "absolute position embeddings" not in caplog.text


@pytest.mark.slow  # the figure the warning quotes (one GRPO step of each trainer per case)
@pytest.mark.parametrize("prompts", ["unequal", "equal"])
def test_grpo_on_gpt2_differs_from_trl_as_the_warning_says(tmp_path, gpt2_path, monkeypatch, prompts):
    """Prompts of 5 and 3 tokens (left-padded by TRL): 0.51 relative update difference over all parameters, 0.86 on
    the position embeddings; prompts of equal length: TRL's update."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    chosen = {"unequal": list(FIXED_COMPLETIONS), "equal": [next(iter(FIXED_COMPLETIONS))] * 2}[prompts]
    _, trl = one_step(GRPOTrainer, GRPOConfig, gpt2_path, peft=False, prompts=chosen)
    _, tree = one_step(TreeGRPOTrainer, TreeGRPOConfig, gpt2_path, peft=False, prompts=chosen)
    if prompts == "equal":
        assert max(relative_error(tree[name], update) for name, update in trl.items()) <= TRL_STEP_TOLERANCE
        return
    overall = relative_error(torch.cat([tree[n].flatten() for n in trl]), torch.cat([trl[n].flatten() for n in trl]))
    assert overall == pytest.approx(0.51, abs=0.01)
    positions = "transformer.wpe.weight"
    assert relative_error(tree[positions], trl[positions]) == pytest.approx(0.86, abs=0.01)


@pytest.mark.slow  # a subprocess through TRL's script; the trainer's refusal is the fast test above
def test_hf_tree_sft_refuses_a_run_on_nothing(tmp_path):
    """`hf-tree sft ... --max_length 8` on prompt/completion rows whose prompts fill 8 tokens: it used to log loss 0
    and grad_norm 0 at every step and end "Training completed" with exit 0; it fails before the first step."""
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa").save_pretrained(model_dir)
    load_smollm2_tokenizer().save_pretrained(model_dir)
    data_dir.mkdir()
    prompt_completion_dataset().to_json(data_dir / "train.jsonl")
    command = [sys.executable, "-m", "hf_tree.cli", "sft", "--num_processes", "1", "--max_length", "8"]
    command += ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir)]
    command += ["--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--bf16", "False", "--report_to", "none"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "no row left to train" in result.stderr and "Training completed" not in result.stdout + result.stderr
