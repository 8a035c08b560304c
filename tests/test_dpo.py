"""TreeDPOTrainer against TRL's own DPOTrainer on the same tiny models and the same batches.

Oracle: TRL's fused-head forward on the concatenated ``[chosen; rejected]`` batch (each row alone, padded) and
TRL's full training step. Exactness in float64 with RMSNorm kept in float64; float32 against TRL's own float32
error. Both trainers load the same saved tiny Llama by path, the tree one with ``tree_flash``.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer

from hf_tree.trl.dpo import POLICY_OUTPUTS, TreeDPOConfig, TreeDPOTrainer
from hf_tree.trl.glue import TreeHeadSettings, add_tree_fused_lm_head
from tests.helpers import (
    TRL_TOLERANCE,
    add_trl_fused_head,
    assert_same_step_as_trl,
    float64_norms,
    needs_fused_head_trl,
    relative_error,
    saved_tiny_model,
    seed_before_the_adapter,
    tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import padded_batch, scenario

# Two pairs share a prompt (and so does one chosen/rejected start), prompts and responses of unequal lengths.
PAIRS = {
    "prompt": ["w10 w11 w12 w13", "w14 w15", "w10 w11 w12 w13", "w16 w17 w18"],
    "chosen": [" w20 w21", " w22", " w23 w24 w25", " w26 w27"],
    "rejected": [" w20 w28 w29 w30", " w31 w32", " w33", " w26"],
}
FIELDS = ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs")


def dpo_args(cls, path: str, dtype: torch.dtype, **overrides):
    return tiny_trl_config(cls, path, dtype, **{"use_weighting": True, **overrides})


def make_trainer(cls, config_cls, path: str, dtype: torch.dtype, peft: bool = False, **overrides):
    args = dpo_args(config_cls, path, dtype, **overrides)
    seed_before_the_adapter(args)
    return cls(
        path,
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=word_tokenizer(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
    )


def fused_outputs(model, batch):
    """What DPOTrainer's ``_compute_loss`` asks of the policy (and the reference, log_probs only)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad(), float64_norms():
        return model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True
        )


@needs_fused_head_trl  # TRL 1.9 has no fused-head values: test_plain_calls_get_the_models_logits
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_per_token_values_match_trl(tmp_path, dtype):
    path = saved_tiny_model(tmp_path, dtype)
    trl = make_trainer(DPOTrainer, DPOConfig, path, dtype)
    tree = make_trainer(TreeDPOTrainer, TreeDPOConfig, path, dtype)
    batch = trl.data_collator([trl.train_dataset[i] for i in range(len(PAIRS["prompt"]))])
    theirs, ours = fused_outputs(trl.model, batch), fused_outputs(tree.model, batch)
    ref_theirs, ref_ours = fused_outputs(trl.ref_model, batch), fused_outputs(tree.ref_model, batch)
    stats = tree.tree_head.layout_stats
    assert stats.num_tree_tokens < int(batch["attention_mask"].sum()), "chosen and rejected did not share prompts"
    assert torch.equal(ours.label_mask, theirs.label_mask)
    pairs = [(getattr(ours, f), getattr(theirs, f)) for f in FIELDS] + [(ref_ours.log_probs, ref_theirs.log_probs)]
    if dtype == torch.float64:
        for ours_value, theirs_value in pairs:
            assert relative_error(ours_value, theirs_value) <= TRL_TOLERANCE
        assert torch.equal(ours.is_top1, theirs.is_top1)
    else:  # no worse than twice TRL's own float32 error against its float64 twin (same weights)
        twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        add_trl_fused_head(twin, outputs=POLICY_OUTPUTS + ("log_sum_sq_probs",))
        exact = fused_outputs(twin, batch)
        truths = [getattr(exact, f) for f in FIELDS] + [exact.log_probs]
        for (ours_value, theirs_value), truth in zip(pairs, truths):
            assert relative_error(ours_value, truth) <= 2 * relative_error(theirs_value, truth) + 1e-7


def test_plain_calls_get_the_models_logits():
    """``TreeHeadSettings.logits_forward`` (TRL 1.9's DPO and KTO read ``model(...).logits`` themselves): the logits
    that predict each real token after a row's first equal the model's own, the rest are zero, prompts are computed
    once, gradients flow, and generation (a cached call) is the model's own."""
    reference, model = tiny_model(attn="sdpa"), tiny_model()
    head = add_tree_fused_lm_head(model, TreeHeadSettings(logits_forward=True))
    ids, mask, _ = padded_batch(*scenario("several_prompts"))
    with float64_norms():
        with torch.no_grad():
            theirs = reference(input_ids=ids, attention_mask=mask).logits
        ours = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert head.layout_stats.num_tree_tokens < int(mask.sum()), "the plain call did not share prompts"
    predicting = torch.cat([(mask[:, :-1] != 0) & (mask[:, 1:] != 0), torch.zeros_like(mask[:, :1], dtype=bool)], 1)
    assert ours.shape == theirs.shape
    assert relative_error(ours[predicting], theirs[predicting]) <= TRL_TOLERANCE
    assert not ours[~predicting].any()
    ours[predicting].logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def one_step(cls, config_cls, path: str, peft: bool, precompute: bool):
    """One SGD step (clipping at TRL's default 1.0 by both) on 4 pairs, two of them sharing a prompt."""
    trainer = make_trainer(
        cls, config_cls, path, torch.float64, peft, max_steps=1, learning_rate=1.0, precompute_ref_log_probs=precompute
    )
    return trainer, train_and_measure_updates(trainer)


@pytest.mark.parametrize(
    "peft, precompute",
    [(False, False), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["full-ref_model", "lora-precomputed_ref"],
)
def test_one_step_matches_trl(tmp_path, peft, precompute):
    """A separate reference model, and LoRA with the reference (adapter disabled) precomputed in __init__. The
    tolerance is float32-level: TRL's fused head computes its gradients in float32 (see
    TRL_STEP_TOLERANCE in tests/helpers.py)."""
    path = saved_tiny_model(tmp_path, torch.float64)
    with float64_norms():  # the precomputed reference runs inside __init__
        trl, trl_updates = one_step(DPOTrainer, DPOConfig, path, peft, precompute)
        tree, tree_updates = one_step(TreeDPOTrainer, TreeDPOConfig, path, peft, precompute)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    if precompute:
        for column in ("ref_chosen_logps", "ref_rejected_logps"):
            theirs, ours = torch.tensor(trl.train_dataset[column]), torch.tensor(tree.train_dataset[column])
            assert relative_error(ours, theirs) <= TRL_TOLERANCE
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_unsupported_setups_raise(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    with pytest.raises(ValueError, match="TreeDPOConfig"):
        TreeDPOTrainer(
            path,
            args=dpo_args(DPOConfig, path, torch.float64),
            train_dataset=Dataset.from_dict(PAIRS),
            processing_class=word_tokenizer(),
        )
    ref_model = tiny_model(attn="sdpa")  # an instance on sdpa is switched (as TreeSFTTrainer does), not refused
    TreeDPOTrainer(
        path,
        ref_model=ref_model,
        args=dpo_args(TreeDPOConfig, path, torch.float64),
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=word_tokenizer(),
    )
    assert ref_model.config._attn_implementation == "tree_flash"
