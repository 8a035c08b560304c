"""TreeSFTTrainer: an existing TRL SFT script switches by class names only.

Oracle for the swap: the same script with TRL's own ``SFTConfig``/``SFTTrainer`` on a prompt/completion dataset,
one tree per row, same sequential order and batch: the first step's loss must be the same objective (float32).
"""

from __future__ import annotations

import copy
import importlib.resources
import json

import datasets
import pytest
import torch
from trl import SFTConfig, SFTTrainer

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.builders import GROUP_BY_ROW
from hf_tree.data.synthetic_agent import synthetic_agent_dataset
from hf_tree.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import tiny_model

QWEN3_TEMPLATE = str(importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja")
VOCAB = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2_tokenizer()


def prompt_completion_dataset() -> datasets.Dataset:
    """Conversational prompt/completion rows; rows 0-1 and 2-3 share a prompt (a GRPO-like group)."""
    rows = []
    for question, answers in [
        ("What is the capital of France?", ["Paris.", "It is Paris, on the Seine."]),
        ("Name a prime number above 10.", ["11 is prime.", "13."]),
    ]:
        for answer in answers:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [{"role": "assistant", "content": answer}],
                }
            )
    return datasets.Dataset.from_list(rows)


def trl_script(config_cls, trainer_cls, tokenizer, dataset, output_dir, **extra):
    """What a user's TRL SFT script does; only the two classes change between runs."""
    args = config_cls(
        output_dir=output_dir,
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        seed=0,
        **extra,
    )
    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32, attn="sdpa")
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=copy.deepcopy(tokenizer))
    trainer.train()
    return trainer


def first_loss(trainer) -> float:
    return next(h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_class_name_swap_trains_the_same_objective(tmp_path, tokenizer):
    dataset = prompt_completion_dataset()
    trl = trl_script(SFTConfig, SFTTrainer, tokenizer, dataset, str(tmp_path / "trl"))
    tree = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, dataset, str(tmp_path / "tree"), group_by=GROUP_BY_ROW)
    assert first_loss(tree) == pytest.approx(first_loss(trl), rel=1e-5)


def test_default_grouping_merges_completions_of_one_prompt(tmp_path, tokenizer):
    trainer = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, prompt_completion_dataset(), str(tmp_path))
    assert len(trainer.train_dataset) == 2  # 4 rows, 2 prompts
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["dedup_ratio"] > 1.0 and log["trees_per_step"] == 2


def test_agent_conversations_with_reasoning_and_tools_train(tmp_path, tokenizer):
    dataset = synthetic_agent_dataset(3, seed=4, max_user_turns=2, max_tool_steps=1)
    assert {"reasoning_content", "tool_calls"} <= set(dataset[0]["messages"][2])
    trainer = trl_script(
        TreeSFTConfig,
        TreeSFTTrainer,
        tokenizer,
        dataset,
        str(tmp_path),
        max_length=None,
        chat_template_path=QWEN3_TEMPLATE,
        per_device_eval_batch_size=3,
    )
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert torch.isfinite(torch.tensor(log["loss"])) and log["dedup_ratio"] > 1.0
    assert json.loads(dataset[0]["tools"])  # TRL stores tools as JSON text; the builders read it
    assert "eval_loss" in trainer.evaluate(dataset)  # raw TRL rows passed to evaluate are built into trees too


@pytest.mark.parametrize(
    "field, value",
    [
        ("packing", True),
        ("padding_free", True),
        ("eval_packing", True),
        ("loss_type", "dft"),
        ("completion_only_loss", False),
    ],
)
def test_settings_that_cannot_apply_to_trees_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        TreeSFTConfig(output_dir="unused", bf16=False, **{field: value})


def test_max_length_becomes_the_branch_limit():
    assert TreeSFTConfig(output_dir="unused", bf16=False, max_length=512).max_branch_tokens == 512
    assert (
        TreeSFTConfig(output_dir="unused", bf16=False, max_length=None, max_packed_tokens=256).max_branch_tokens is None
    )
    capped = TreeSFTConfig(output_dir="unused", bf16=False, max_length=8192, max_packed_tokens=1024)
    assert capped.max_branch_tokens == 1024


def test_sft_config_is_refused_by_tree_trainer(tokenizer):
    with pytest.raises(ValueError, match="TreeSFTConfig"):
        TreeSFTTrainer(
            model=tiny_model(vocab_size=VOCAB),
            args=SFTConfig(output_dir="unused", bf16=False),
            train_dataset=prompt_completion_dataset(),
            processing_class=tokenizer,
        )


def test_tree_rows_pass_through_unchanged(tmp_path, tokenizer):
    from hf_tree.builders import build_tree_dataset

    trees = build_tree_dataset(prompt_completion_dataset(), tokenizer)
    trainer = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, trees, str(tmp_path))
    assert trainer.train_dataset.to_list() == trees.to_list()
