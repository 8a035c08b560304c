"""TreeRewardTrainer against TRL's own RewardTrainer on the same tiny model and the same batches.

Oracle: TRL's forward of the sequence-classification model on the padded ``[chosen; rejected]`` batch (each row
pooled at its last non-pad token by the model itself) and TRL's full training step. Exactness in float64 with RMSNorm
kept in float64. Both trainers load the same saved tiny Llama by path (TRL adds the same seeded ``score`` head).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from datasets import Dataset
from peft import LoraConfig
from trl import RewardConfig, RewardTrainer

from hf_tree.trl.reward import TreeRewardConfig, TreeRewardTrainer
from hf_tree.trl.reward_head import add_tree_reward_forward, layout_pooled_rows
from tests.helpers import (
    TRL_TOLERANCE,
    assert_same_step_as_trl,
    float64_norms,
    relative_error,
    saved_tiny_model,
    tiny_config,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import REWARD_PAIRS


def make_trainer(cls, config_cls, path: str, pad_is_eos: bool = False, peft: bool = False, **overrides):
    tokenizer = word_tokenizer()
    if pad_is_eos:  # the model then pools the token before the appended EOS (EOS is "padding" to it)
        tokenizer.pad_token = tokenizer.eos_token
    pairs = {k: v for k, v in REWARD_PAIRS.items() if k != "margin" or overrides.pop("margin", False)}
    return cls(
        path,
        args=tiny_trl_config(config_cls, path, torch.float64, **overrides),
        train_dataset=Dataset.from_dict(pairs),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS") if peft else None,
    )


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad", "pad_is_eos"])
def test_rewards_match_trl(tmp_path, pad_is_eos):
    path = saved_tiny_model(tmp_path, torch.float64)
    trl = make_trainer(RewardTrainer, RewardConfig, path, pad_is_eos)
    tree = make_trainer(TreeRewardTrainer, TreeRewardConfig, path, pad_is_eos, max_packed_tokens=16)
    batch = trl.data_collator([trl.train_dataset[i] for i in range(len(REWARD_PAIRS["prompt"]))])
    with torch.no_grad(), float64_norms():
        theirs = trl.model(**batch, use_cache=False).logits
        ours = tree.model(**batch, use_cache=False).logits
    stats = tree.tree_head.layout_stats
    assert stats.num_tree_tokens < int(batch["attention_mask"].sum()), "chosen and rejected did not share prompts"
    assert stats.num_rows >= 2, "max_packed_tokens=16 should split the batch over several packed rows"
    assert ours.shape == theirs.shape == (8, 1)
    assert relative_error(ours, theirs) <= TRL_TOLERANCE


@pytest.mark.parametrize(
    "peft, settings",
    [(False, dict(margin=True, center_rewards_coefficient=0.01)), pytest.param(True, {}, marks=pytest.mark.slow)],
    ids=["full-margin-centered", "lora"],
)
def test_one_step_matches_trl(tmp_path, peft, settings):
    """One SGD step (clipping at TRL's default 1.0) on 4 pairs; LoRA trains the adapter and the
    ``score`` head (PEFT's SEQ_CLS task keeps it trainable)."""
    path = saved_tiny_model(tmp_path, torch.float64)
    runs = {}
    for cls, config_cls in ((RewardTrainer, RewardConfig), (TreeRewardTrainer, TreeRewardConfig)):
        trainer = make_trainer(cls, config_cls, path, peft=peft, max_steps=1, learning_rate=1.0, **settings)
        runs[cls] = trainer, train_and_measure_updates(trainer)
    (trl, trl_updates), (tree, tree_updates) = runs.values()
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert any("score" in name for name in tree_updates)
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_unsupported_setups_raise(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    with pytest.raises(ValueError, match="TreeRewardConfig"):
        make_trainer(TreeRewardTrainer, RewardConfig, path)
    with pytest.raises(ValueError, match="neftune_noise_alpha=5"):
        tiny_trl_config(TreeRewardConfig, path, torch.float64, neftune_noise_alpha=5.0)
    with pytest.raises(ValueError, match="max_packed_tokens"):
        tiny_trl_config(TreeRewardConfig, path, torch.float64, max_packed_tokens=0)
    causal_lm = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config()))
    with pytest.raises(ValueError, match="GenericForSequenceClassification"):
        add_tree_reward_forward(causal_lm)
    ids = torch.tensor([[5, 6, 7, 9], [5, 6, 8, 8]])
    with pytest.raises(ValueError, match="column 3, which is padding"):  # padded with a token that is not the pad id
        layout_pooled_rows(ids, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), 0, 16)
    with pytest.raises(ValueError, match="max_packed_tokens=3"):
        layout_pooled_rows(ids, None, 0, 3)
    with pytest.raises(ValueError, match="position_ids"):
        tree = make_trainer(TreeRewardTrainer, TreeRewardConfig, path)
        tree.model(input_ids=ids, position_ids=ids)


def test_tree_forward_false_keeps_trls_forward(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    trainer = make_trainer(TreeRewardTrainer, TreeRewardConfig, path, tree_forward=False)
    assert trainer.tree_head is None and "forward" not in vars(trainer.model)  # the class's own forward
    assert trainer.model.config._attn_implementation == "sdpa"
