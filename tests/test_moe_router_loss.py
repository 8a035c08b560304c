"""MoE router load-balancing loss on trees (issue 26, item 2).

Oracles: the model's own forward on the branches as one right-padded batch (``attention_mask``), whose ``loss``
adds ``router_aux_loss_coef * aux_loss``; and TRL 1.16's SFT, GRPO and DPO trainers on MoE models, with TRL's
defaults (``router_aux_loss_coef=None``: the architecture's coefficient) and with a coefficient set by hand. The
load-balancing function computes in float32 inside every model (``routing_weights.float()``) and transformers'
causal-LM loss casts logits to float32, so comparisons are at float32 level (``TRL_STEP_TOLERANCE``); a tree that
counted each shared token once instead of once per branch is off by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig
from transformers import Trainer, TrainingArguments
from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.depth_first import refuse_for_depth_first
from hf_tree.loss import tree_losses
from hf_tree.models.router_loss import tree_router_loss
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    MOE_SETTINGS,
    TRL_STEP_TOLERANCE,
    VOCAB,
    collate_branches,
    common_args,
    float32_floor_grad_error,
    float64_norms,
    grads_of,
    one_step,
    own_attention,
    relative_error,
    saved_tiny_model,
    sft_step,
    tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import branch_dataset, branch_groups, tree_dataset

FAMILIES = list(MOE_SETTINGS)
# Loading by path: float64 with the eager experts (the grouped-GEMM experts refuse float64).
LOAD_MOE = {"model_init_kwargs": {"dtype": torch.float64, "experts_implementation": "eager"}}
# Three branches sharing a 3-token prompt (two also share a 4th token) and a tree of one branch.
SEQUENCES = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 7, 11, 13, 14, 15], [20, 21, 22]]
MASKS = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1]]


def peaked_routers(model: torch.nn.Module) -> torch.nn.Module:
    """Scale the routers' weights up: a random tiny router is nearly uniform, so any weighting of the tokens gives
    about the same load-balancing loss; peaked, token-dependent routing makes a wrong weighting visible."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                parameter.mul_(40)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_loss_adds_the_router_loss_of_the_branches(family):
    model = peaked_routers(tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.3))
    rows = [Tree.from_sequences(SEQUENCES[:3], MASKS[:3]).to_dict(), Tree.from_sequences(SEQUENCES[3:], MASKS[3:])]
    batch = TreeDataCollator(max_packed_tokens=16)([rows[0], rows[1].to_dict()])
    with float64_norms():
        losses = tree_losses(model, batch, self_check=False)
        assert torch.equal(losses.model_loss(), tree_causal_lm_loss(model, batch, self_check=False))
        losses.model_loss().backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        model.set_attn_implementation(own_attention(model))
        padded = collate_branches([{"sequences": SEQUENCES, "masks": MASKS}])  # right-padded, -100 labels
        outputs = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
        logits, labels = outputs.logits[:, :-1], padded["labels"][:, 1:]
        token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)  # float64, HF's mean
        (token_loss + 0.3 * outputs.aux_loss).backward()
    assert relative_error(losses.router, outputs.aux_loss) <= TRL_STEP_TOLERANCE
    assert relative_error(losses.token, token_loss) <= 1e-8  # Qwen3.5's norms and delta rule: float32 inside
    assert float32_floor_grad_error(tree_grads, grads_of(model)) <= TRL_STEP_TOLERANCE
    # The weights matter: each packed token counted once (padding excluded) is another loss.
    model.set_attn_implementation("tree_flash")
    packed = {k: batch[k] for k in ("input_ids", "position_ids", "kv_end")}
    router_logits = model(**packed, output_router_logits=True, use_cache=False).router_logits
    once = tree_router_loss(model, router_logits, (batch["token_multiplicity"] > 0).reshape(-1))
    assert relative_error(once, outputs.aux_loss) > 1e-3


def test_a_router_loss_of_another_form_is_refused(monkeypatch):
    model = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda gate_logits, num_experts, num_keys, top_k: 0.0)
    batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences(SEQUENCES[:3], MASKS[:3]).to_dict()])
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1.*cannot reproduce that router loss"):
        tree_causal_lm_loss(model, batch)


def test_depth_first_execution_refuses_a_router_loss():
    """Depth-first units run and backpropagate one by one; the router loss is a mean over the whole micro-batch."""
    model = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match=r"tree_execution='depth_first'.*router_aux_loss_coef=0\.1"):
        refuse_for_depth_first(model)


def test_no_router_loss_without_router_logits_or_coefficient():
    for settings in (dict(output_router_logits=False, router_aux_loss_coef=0.3), dict(output_router_logits=True)):
        model = tiny_model("mixtral", **({"router_aux_loss_coef": 0.0} | settings))
        batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences(SEQUENCES[:3], MASKS[:3]).to_dict()])
        assert tree_losses(model, batch, self_check=False).router is None


def test_tree_trainer_adds_the_router_loss_as_trainer_does(tmp_path):
    """transformers.Trainer on the branches uses the model's own loss: float32 cross-entropy over
    ``num_items_in_batch`` plus the coefficient times each micro-batch's router loss (not divided by the
    accumulation steps); TreeTrainer the same on trees (2 micro-batches of 2 trees, one SGD step)."""
    groups = branch_groups(num_trees=4)
    settings = dict(vocab_size=VOCAB, output_router_logits=True, router_aux_loss_coef=0.5)
    tree_model = peaked_routers(tiny_model("mixtral", **settings))
    reference_model = peaked_routers(tiny_model("mixtral", attn="sdpa", **settings))
    before = {n: p.detach().clone() for n, p in tree_model.named_parameters()}
    args = common_args(tmp_path, "tree", 2, 2, max_steps=1)
    tree = TreeTrainer(
        tree_model, TreeTrainingArguments(**args, max_packed_tokens=64), train_dataset=tree_dataset(groups)
    )
    reference = Trainer(
        reference_model,
        TrainingArguments(**common_args(tmp_path, "reference", 2, 2, max_steps=1), remove_unused_columns=False),
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
    )
    with float64_norms():
        tree.train()
        reference.train()
    updates = {n: p.detach() - before[n] for n, p in tree_model.named_parameters()}
    reference_updates = {n: p.detach() - before[n] for n, p in reference_model.named_parameters()}
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    assert tree.state.log_history[0]["loss"] == pytest.approx(reference.state.log_history[0]["loss"], rel=1e-6)
    assert float32_floor_grad_error(updates, reference_updates) <= TRL_STEP_TOLERANCE


# ---------------------------------------------------------------------------------------- through TRL trainers
SFT_ROWS = {
    "prompt": ["w10 w11 w12", "w10 w11 w12", "w13 w14", "w13 w14"],
    "completion": [" w20 w21", " w22 w23 w24", " w25", " w26 w27"],
}


def moe_sft_step(cls, config_cls, path: str, **settings):
    """``sft_step`` on ``SFT_ROWS`` with the MoE loaded in float64 (eager experts), without checkpointing."""
    return sft_step(cls, config_cls, path, SFT_ROWS, gradient_checkpointing=False, **LOAD_MOE, **settings)


def assert_same_moe_step(trl, trl_updates, tree, tree_updates) -> None:
    """Same logged loss and router loss, same update of every parameter (float32 level, see the module doc; an update
    of (near) zero, e.g. Qwen3.5's dt_bias at 1e-10, is measured against 1e-3 of the largest one)."""
    for key in ("loss", "aux_loss"):
        assert tree.state.log_history[0][key] == pytest.approx(trl.state.log_history[0][key], rel=TRL_STEP_TOLERANCE)
    assert float32_floor_grad_error(tree_updates, trl_updates) <= TRL_STEP_TOLERANCE
    assert any(u.norm() > 0 for u in trl_updates.values())


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_5_moe_text", marks=pytest.mark.slow)])
@pytest.mark.parametrize("coef", [None, 0.5], ids=["trl_default", "coef_by_hand"])
def test_sft_trains_trls_router_loss(tmp_path, family, coef):
    path = saved_tiny_model(tmp_path, torch.float64, family)
    trl, trl_updates = moe_sft_step(SFTTrainer, SFTConfig, path, router_aux_loss_coef=coef)
    tree, tree_updates = moe_sft_step(TreeSFTTrainer, TreeSFTConfig, path, router_aux_loss_coef=coef)
    assert trl.aux_loss_enabled and trl.state.log_history[0]["aux_loss"] > 0
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    assert_same_moe_step(trl, trl_updates, tree, tree_updates)


@pytest.mark.parametrize(
    "trainers, peft",
    [
        ((GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig), False),
        ((GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig), True),
        ((RLOOTrainer, RLOOConfig, TreeRLOOTrainer, TreeRLOOConfig), False),
    ],
    ids=["grpo-full", "grpo-lora", "rloo-full"],
)
def test_rollout_trainers_train_trls_router_loss(tmp_path, monkeypatch, trainers, peft):
    """GRPO (fixed completions) and RLOO (sampled: same seed, same logits): TRL's router loss is the mean over its
    forward chunks; each chunk's tokens are weighted by the rows of that chunk that contain them."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_cls, trl_config, tree_cls, tree_config = trainers
    path = saved_tiny_model(tmp_path, torch.float64, "qwen3_moe")
    rollout = trl_cls is GRPOTrainer
    settings = dict(rollout=rollout, router_aux_loss_coef=0.5, **LOAD_MOE)
    trl, trl_updates = one_step(trl_cls, trl_config, path, peft, **settings)
    tree, tree_updates = one_step(tree_cls, tree_config, path, peft, **settings)
    assert trl.aux_loss_enabled
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert_same_moe_step(trl, trl_updates, tree, tree_updates)


KTO_ROWS = {
    "prompt": ["w10 w11 w12 w13", "w10 w11 w12 w13", "w14 w15", "w16 w17 w18"],
    "completion": [" w20 w21", " w22", " w23 w24 w25", " w27"],
    "label": [True, False, True, False],
}
DPO_ROWS = {
    "prompt": ["w10 w11 w12 w13", "w14 w15", "w10 w11 w12 w13", "w16 w17 w18"],
    "chosen": [" w20 w21", " w22", " w23 w24 w25", " w26 w27"],
    "rejected": [" w20 w28 w29 w30", " w31 w32", " w33", " w26"],
}


@pytest.mark.parametrize(
    "trainers, family, rows",
    [
        ((DPOTrainer, DPOConfig, TreeDPOTrainer, TreeDPOConfig), "olmoe", DPO_ROWS),
        ((KTOTrainer, KTOConfig, TreeKTOTrainer, TreeKTOConfig), "mixtral", KTO_ROWS),
    ],
    ids=["dpo-olmoe", "kto-mixtral"],
)
def test_preference_trainers_train_trls_router_loss(tmp_path, trainers, family, rows):
    """One forward per pass in TRL (DPO: chosen and rejected rows; KTO: the policy rows), one router loss each."""
    trl_cls, trl_config, tree_cls, tree_config = trainers
    path = saved_tiny_model(tmp_path, torch.float64, family)

    def step(cls, config_cls):
        settings = dict(max_steps=1, learning_rate=1.0, router_aux_loss_coef=0.5, **LOAD_MOE)
        args = tiny_trl_config(config_cls, path, torch.float64, **settings)
        trainer = cls(path, args=args, train_dataset=Dataset.from_dict(rows), processing_class=word_tokenizer())
        return trainer, train_and_measure_updates(trainer)

    trl, trl_updates = step(trl_cls, trl_config)
    tree, tree_updates = step(tree_cls, tree_config)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert_same_moe_step(trl, trl_updates, tree, tree_updates)


def test_lora_sft_trains_trls_router_loss(tmp_path):
    """LoRA on attention of gpt-oss (sinks, a sliding window), TRL's default coefficient."""
    path = saved_tiny_model(tmp_path, torch.float64, "gpt_oss")
    peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trl, trl_updates = moe_sft_step(SFTTrainer, SFTConfig, path, peft_config=peft)
    tree, tree_updates = moe_sft_step(TreeSFTTrainer, TreeSFTConfig, path, peft_config=peft)
    assert_same_moe_step(trl, trl_updates, tree, tree_updates)
