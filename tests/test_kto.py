"""TreeKTOTrainer against TRL's own KTOTrainer on the same tiny models and the same batches.

Oracle: TRL's fused-head forward on KTO's padded batches (the policy rows and the KL rows, each row alone) and TRL's
full training step. Exactness in float64 with RMSNorm kept in float64. Both trainers load the same saved tiny Llama
by path, the tree one with ``tree_flash``.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl import KTOConfig, KTOTrainer

from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
from tests.helpers import (
    TRL_TOLERANCE,
    assert_same_step_as_trl,
    float64_norms,
    needs_fused_head_trl,
    relative_error,
    saved_tiny_model,
    seed_before_the_adapter,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import KTO_ROWS

FIELDS = ("log_probs", "entropy", "mean_logits")


def make_trainer(cls, config_cls, path: str, peft: bool = False, **overrides):
    args = tiny_trl_config(config_cls, path, torch.float64, per_device_train_batch_size=3, **overrides)
    seed_before_the_adapter(args)
    return cls(
        path,
        args=args,
        train_dataset=Dataset.from_dict(KTO_ROWS),
        processing_class=word_tokenizer(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
    )


def fused_outputs(model, batch, prefix: str = ""):
    """What KTOTrainer asks of a fused head: the policy rows (``prefix=""``) or the KL rows (``"KL_"``)."""
    ids = batch[f"{prefix}input_ids"]
    labels = ids.masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)
    with torch.no_grad(), float64_norms():
        return model(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"], labels=labels, fused_lm_head=True)


@needs_fused_head_trl  # TRL 1.9 has no fused-head values: tests/test_dpo.py::test_plain_calls_get_the_models_logits
def test_per_token_values_match_trl(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    trl = make_trainer(KTOTrainer, KTOConfig, path)
    tree = make_trainer(TreeKTOTrainer, TreeKTOConfig, path)
    batch = trl.data_collator([trl.train_dataset[i] for i in range(3)])
    for prefix in ("", "KL_"):
        theirs, ours = fused_outputs(trl.model, batch, prefix), fused_outputs(tree.model, batch, prefix)
        stats = tree.tree_head.layout_stats
        assert stats.num_tree_tokens < int(batch[f"{prefix}attention_mask"].sum()), f"{prefix}rows shared nothing"
        ref_theirs, ref_ours = fused_outputs(trl.ref_model, batch, prefix), fused_outputs(tree.ref_model, batch, prefix)
        assert torch.equal(ours.label_mask, theirs.label_mask)
        pairs = [(getattr(ours, f), getattr(theirs, f)) for f in FIELDS] + [(ref_ours.log_probs, ref_theirs.log_probs)]
        for ours_value, theirs_value in pairs:
            assert relative_error(ours_value, theirs_value) <= TRL_TOLERANCE


@pytest.mark.parametrize(
    "peft, precompute",
    [(False, False), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["full-ref_model", "lora-precomputed_ref"],
)
def test_one_step_matches_trl(tmp_path, peft, precompute):
    """One SGD step (clipping at 1.0) on 2 micro-batches of 3 rows (KL term on), with a separate reference model,
    and LoRA with the reference (adapter disabled) precomputed in __init__."""
    path = saved_tiny_model(tmp_path, torch.float64)
    settings = dict(max_steps=1, learning_rate=1.0, gradient_accumulation_steps=2, precompute_ref_log_probs=precompute)
    with float64_norms():  # the precomputed reference runs inside __init__
        trl = make_trainer(KTOTrainer, KTOConfig, path, peft, **settings)
        tree = make_trainer(TreeKTOTrainer, TreeKTOConfig, path, peft, **settings)
    trl_updates, tree_updates = train_and_measure_updates(trl), train_and_measure_updates(tree)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    if precompute:
        for column in ("ref_logps", "ref_KL_logps"):
            theirs, ours = torch.tensor(trl.train_dataset[column]), torch.tensor(tree.train_dataset[column])
            assert relative_error(ours, theirs) <= TRL_TOLERANCE
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_plain_config_is_refused(tmp_path):
    path = saved_tiny_model(tmp_path, torch.float64)
    with pytest.raises(ValueError, match="TreeKTOConfig"):
        make_trainer(TreeKTOTrainer, KTOConfig, path)
