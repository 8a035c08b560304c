"""The trainers on a hybrid model: a tiny float64 Qwen3.5 (GatedDeltaNet + attention) through ``TreeTrainer`` with
LoRA and through ``TreeGRPOTrainer``, against ``transformers.Trainer`` on the branches and TRL's ``GRPOTrainer``.

Bounds: the model's GatedDeltaNet and RMSNorms compute in float32 inside even in a float64 model, so the tree and
the oracle agree to the float32 floor (measured 1e-8..1e-6), not 1e-9; the bug these guard against (siblings
in a branch's recurrent state) moves log-probs by ~6e-4 (the log-prob test checks it) and gradients by 1e-2..4e-1
(test_without_tree_mixers_the_same_check_fails).
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from hf_tree.models.check import SELF_CHECK_ENV_VAR
from hf_tree.models.mixers import install_tree_mixers, uninstall_tree_mixers
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from tests.helpers import (
    FLOAT32_FLOOR,
    branch_loss_func,
    collate_branches,
    common_args,
    float32_floor_grad_error,
    hybrid_model,
    one_step,
    relative_error,
    trainer_args,
    word_tokenizer,
    zero_reward,
)
from tests.workloads import BRANCHES_PER_TREE, branch_dataset, branch_groups, padded_batch, scenario, tree_dataset

# Log-probs of a random tiny model are near uniform (-log 97), so siblings leaking into the state move them by only
# ~1e-3 relative; the float32 floor is ~1e-8.
LOGPROB_BOUND = 1e-6
FAMILY = "qwen3_5_text"  # Qwen3_5ForCausalLM: two GatedDeltaNet layers and one full-attention layer


def lora_qwen3_5():
    """A tiny float64 Qwen3.5 with LoRA on every linear layer (GatedDeltaNet projections included)."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(hybrid_model(FAMILY), config)


def updates(model, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}


def test_lora_tree_trainer_matches_trainer_on_branches(tmp_path):
    """Three SGD steps of LoRA: TreeTrainer on trees (split over rows of 24 tokens) and transformers.Trainer on the
    unrolled branches (own attention, right padding) move every adapter matrix alike."""
    groups = branch_groups(num_trees=6)
    tree_model = lora_qwen3_5()
    reference = copy.deepcopy(tree_model)
    reference.get_base_model().set_attn_implementation("sdpa")
    before = {n: p.detach().clone() for n, p in tree_model.named_parameters()}
    assert sum(".linear_attn." in n and "lora_A" in n for n in before) >= 2 * 2  # adapters inside GatedDeltaNet

    tree_args = TreeTrainingArguments(**common_args(tmp_path, "tree", 2, 1), max_packed_tokens=24)
    tree = TreeTrainer(model=tree_model, args=tree_args, train_dataset=tree_dataset(groups))
    tree.train()
    ref_args = TrainingArguments(**common_args(tmp_path, "ref", 2, 1), remove_unused_columns=False)
    ref = Trainer(
        model=reference,
        args=ref_args,
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
        compute_loss_func=branch_loss_func("token", BRANCHES_PER_TREE * 2),
    )
    ref.train()

    tree_updates, ref_updates = updates(tree_model, before), updates(reference, before)
    assert tree_updates.keys() == ref_updates.keys() and all("lora_" in n for n in tree_updates)
    for name, update in ref_updates.items():
        assert update.norm() > 0, name
        assert relative_error(tree_updates[name], update) <= FLOAT32_FLOOR, name
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    tree_losses = [h["loss"] for h in tree.state.log_history if "loss" in h]
    assert len(tree_losses) == 3 and tree_losses == pytest.approx(ref_losses, rel=FLOAT32_FLOOR)


@pytest.fixture(scope="module")
def grpo_trainers(tmp_path_factory):
    """(TRL trainer, tree trainer) loading the same saved tiny float64 Qwen3.5; each builds its reference model."""
    path = str(tmp_path_factory.mktemp("grpo_qwen3_5"))
    hybrid_model(FAMILY, attn="sdpa").save_pretrained(path)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trl = GRPOTrainer(path, zero_reward, trainer_args(GRPOConfig, path, torch.float64), **setup)
    tree = TreeGRPOTrainer(path, zero_reward, trainer_args(TreeGRPOConfig, path, torch.float64), **setup)
    return trl, tree


@pytest.mark.parametrize(
    "name", ["full_group", *(pytest.param(n, marks=pytest.mark.slow) for n in ("partial_groups", "several_prompts"))]
)
def test_grpo_logprobs_and_entropies_match_trl(grpo_trainers, name, monkeypatch):
    """TRL runs each row alone (left-padded prompt); the tree packs the rows' shared prompts. Without the tree
    mixers the same packed pass is refused (the mixer ops changed after the first-use check), and with the check off
    it is off by far more than the bound."""
    trl, tree = grpo_trainers
    ids, mask, keep = padded_batch(*scenario(name))

    def scores(trainer, model, entropy=True):
        return trainer._get_per_token_logps_and_entropies(
            model, ids, mask, keep, batch_size=2, compute_entropy=entropy
        )[:2]

    with torch.no_grad():
        trl_logps, trl_entropy = scores(trl, trl.model)
        logps, entropy = scores(tree, tree.model)
        ref_trl, ref_tree = scores(trl, trl.ref_model, False)[0], scores(tree, tree.ref_model, False)[0]
        uninstall_tree_mixers()
        try:
            with pytest.raises(ValueError, match="is no longer hf_tree's tree-aware mixer op"):
                scores(tree, tree.model)
            monkeypatch.setenv(SELF_CHECK_ENV_VAR, "0")
            leaky = scores(tree, tree.model)[0]
        finally:
            install_tree_mixers()
    assert tree.tree_head.layout_stats.num_tree_tokens < int(mask.sum()), "the tree pass did not share prompts"
    assert torch.equal(logps == 0, trl_logps == 0)  # padding scores exactly zero in both
    for ours, theirs in [(logps, trl_logps), (entropy, trl_entropy), (ref_tree, ref_trl)]:
        assert relative_error(ours, theirs) <= LOGPROB_BOUND, relative_error(ours, theirs)
    assert relative_error(leaky, trl_logps) > 100 * LOGPROB_BOUND  # measured 6e-4 on random weights


@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_grpo_one_step_matches_trl(tmp_path, monkeypatch, peft):
    """One GRPO optimizer step (old policy, reference and policy passes, backward through the tree mixers; the
    pattern of tests/test_grpo.py): same loss and parameter updates as TRL's to the float32 floor (measured: loss
    equal, updates 1e-7 (LoRA) and 3e-5 (full: the tiny A_log/dt_bias updates); without the tree mixers 6e-2 and
    1.0)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    hybrid_model(FAMILY, attn="sdpa").save_pretrained(tmp_path)
    trl, trl_updates = one_step(GRPOTrainer, GRPOConfig, str(tmp_path), peft)
    tree, tree_updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, str(tmp_path), peft)
    assert tree.state.log_history[0]["tree/dedup_ratio"] > 1
    assert tree.state.log_history[0]["loss"] == pytest.approx(trl.state.log_history[0]["loss"], rel=LOGPROB_BOUND)
    assert trl_updates.keys() == tree_updates.keys()
    # LoRA (q_proj/v_proj) trains the attention layer only, on hidden states the GatedDeltaNet layers computed
    moved = [name for name, u in trl_updates.items() if u.norm() > 0]
    assert moved and (peft or any(".linear_attn." in name for name in moved))
    assert float32_floor_grad_error(tree_updates, trl_updates) <= FLOAT32_FLOOR
