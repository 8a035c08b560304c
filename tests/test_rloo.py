"""TreeRLOOTrainer against TRL's own RLOOTrainer on the same tiny models and the same batches.

The log-prob pass is GRPO's (``hf_tree.trl.rollout_logprobs``, covered in depth by tests/test_grpo.py); here: RLOO's
passes (policy and reference) equal TRL's in float64, and one optimizer step of the class swap moves every parameter
as TRL's does, full fine-tuning and LoRA. RLOO has no ``rollout_func`` hook, so both trainers sample their own
completions: the same seed and the same logits (``tree_flash`` without ``kv_end`` is ``sdpa``) give the same ones.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trl import RLOOConfig, RLOOTrainer

from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
from tests.helpers import (
    TRL_TOLERANCE,
    assert_same_step_as_trl,
    float64_norms,
    on_completions,
    one_step,
    relative_error,
    saved_tiny_model,
    trainer_args,
    word_tokenizer,
    zero_reward,
)
from tests.workloads import padded_batch, scenario


def test_logprobs_match_trl(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trl = RLOOTrainer(path, zero_reward, trainer_args(RLOOConfig, path, torch.float64), **setup)
    tree = TreeRLOOTrainer(path, zero_reward, trainer_args(TreeRLOOConfig, path, torch.float64), **setup)
    ids, mask, keep = padded_batch(*scenario("partial_groups"))
    with torch.no_grad(), float64_norms():
        theirs = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, keep, batch_size=2, compute_entropy=True)
        ours = tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, batch_size=2, compute_entropy=True)
        ref_theirs, _, _ = trl._get_per_token_logps_and_entropies(trl.ref_model, ids, mask, keep, batch_size=2)
        ref_ours, _, _ = tree._get_per_token_logps_and_entropies(tree.ref_model, ids, mask, keep, batch_size=2)
    assert tree.tree_head.layout_stats.num_tree_tokens < int(mask.sum()), "the tree pass did not share prompts"
    for mine, their in ((ours[0], theirs[0]), (ours[1], theirs[1]), (ref_ours, ref_theirs)):
        assert mine.shape == their.shape == (ids.shape[0], keep)
        assert relative_error(mine, on_completions(their, mask)) <= TRL_TOLERANCE


@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_one_step_matches_trl(tmp_path, monkeypatch, peft):
    """Full fine-tuning (separate reference model) and LoRA (reference = the adapter disabled)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = saved_tiny_model(tmp_path, torch.float64)
    trl, trl_updates = one_step(RLOOTrainer, RLOOConfig, path, peft, rollout=False)
    tree, tree_updates = one_step(TreeRLOOTrainer, TreeRLOOConfig, path, peft, rollout=False)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_plain_config_is_refused(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    with pytest.raises(ValueError, match="TreeRLOOConfig"):
        TreeRLOOTrainer(path, zero_reward, trainer_args(RLOOConfig, path, torch.float64), **setup)
