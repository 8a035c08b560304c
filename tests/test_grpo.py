"""TreeGRPOTrainer against TRL's own GRPOTrainer on the same tiny models and the same batches.

Oracle: TRL's ``_get_per_token_logps_and_entropies`` (each row run alone, padded) and TRL's full training step.
Exactness in float64 with RMSNorm kept in float64; float32 against float32 TRL's own error. Both trainers load the
same saved tiny Llama by path (so the reference model is built by TRL itself), the tree one with ``tree_flash``.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from hf_tree.trl.glue import TreeHeadSettings, add_tree_fused_lm_head, log_tree_stats
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from tests.helpers import (
    TRL_TOLERANCE,
    add_trl_fused_head,
    assert_same_step_as_trl,
    float64_norms,
    needs_fused_head_trl,
    on_completions,
    one_step,
    relative_error,
    saved_tiny_model,
    tiny_model,
    trainer_args,
    word_tokenizer,
    zero_reward,
)
from tests.workloads import padded_batch, scenario


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["float64", "float32"])
def trainers_of_dtype(request, tmp_path_factory):
    """(TRL trainer, tree trainer, model path) on the same saved model; both build their reference from the path."""
    dtype = request.param
    path = saved_tiny_model(tmp_path_factory.mktemp(f"grpo_{dtype}"), dtype)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trl = GRPOTrainer(path, zero_reward, trainer_args(GRPOConfig, path, dtype), **setup)
    tree = TreeGRPOTrainer(path, zero_reward, trainer_args(TreeGRPOConfig, path, dtype), **setup)
    return trl, tree, path


@pytest.fixture
def trainers(trainers_of_dtype):
    """``trainers_of_dtype`` with accelerate's process state as their accelerators left it: any test that builds a
    config resets that process-wide state (``TrainingArguments`` does), after which the trainers' ``accelerator.gather``
    raises, so without this a test's outcome would depend on the tests run before it."""
    Accelerator(cpu=True)  # re-initializes the shared state (one process, CPU) the trainers' accelerators read
    return trainers_of_dtype


@pytest.mark.parametrize("name", ["full_group", "partial_groups", "several_prompts"])
def test_logprobs_and_entropies_match_trl(trainers, name):
    """TRL runs rows in chunks of ``batch_size``; the tree packs all rows together (groups are never cut)."""
    trl, tree, path = trainers
    batch_size = 2
    ids, mask, keep = padded_batch(*scenario(name))
    with torch.no_grad(), float64_norms():
        trl_logps, trl_entropy, _ = trl._get_per_token_logps_and_entropies(
            trl.model, ids, mask, keep, batch_size=batch_size, compute_entropy=True
        )
        logps, entropy, _ = tree._get_per_token_logps_and_entropies(
            tree.model, ids, mask, keep, batch_size=batch_size, compute_entropy=True
        )
        ref_trl, _, _ = trl._get_per_token_logps_and_entropies(trl.ref_model, ids, mask, keep, batch_size=batch_size)
        ref_tree, _, _ = tree._get_per_token_logps_and_entropies(tree.ref_model, ids, mask, keep, batch_size=batch_size)
    stats = tree.tree_head.layout_stats
    assert stats.num_tree_tokens < int(mask.sum()), "the tree pass did not share the prompts"
    assert logps.shape == trl_logps.shape == (ids.shape[0], keep)
    assert torch.equal(logps == 0, on_completions(trl_logps, mask) == 0)  # the tree scores padding exactly zero
    pairs = [(logps, on_completions(trl_logps, mask)), (entropy, on_completions(trl_entropy, mask))]
    pairs.append((ref_tree, on_completions(ref_trl, mask)))
    if tree.model.dtype == torch.float64:
        for ours, theirs in pairs:
            assert relative_error(ours, theirs) <= TRL_TOLERANCE
    else:  # float32: no worse than twice TRL's own float32 error against float64 (same weights)
        twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        add_trl_fused_head(twin, outputs=("log_probs", "entropy"))
        with torch.no_grad(), float64_norms():
            truth, truth_entropy, _ = trl._get_per_token_logps_and_entropies(
                twin, ids, mask, keep, compute_entropy=True
            )
        for (ours, theirs), exact in zip(pairs, (truth, truth_entropy, truth)):
            exact = on_completions(exact, mask)
            assert relative_error(ours, exact) <= 2 * relative_error(theirs, exact) + 1e-7


@pytest.mark.parametrize("name", ["full_group", "partial_groups", "several_prompts"])
def test_high_entropy_mask_is_taken_over_trls_tokens(trainers, name):
    """``top_entropy_quantile``: the quantile runs over the per-row completion tokens, each row's copy of a shared
    or duplicated token counted once, as in TRL. In float64 (no threshold flip from rounding) the selected tokens
    must be TRL's for every quantile. (In float32, a token within one ulp of the threshold can flip, and does for
    TRL itself when only the padding changes: 6 of 900 random batches, vs 5 of 900 tree vs TRL.)"""
    trl, tree, _ = trainers
    if tree.model.dtype != torch.float64:
        pytest.skip("float64 only: in float32 a tie within one ulp of the threshold decides (see docstring)")
    ids, mask, keep = padded_batch(*scenario(name))
    with torch.no_grad(), float64_norms():
        _, theirs, _ = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, keep, compute_entropy=True)
        _, ours, _ = tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, compute_entropy=True)
    completion_mask = mask[:, -keep:]
    for quantile in (0.2, 0.5, 0.8):
        expected = trl.get_high_entropy_mask(theirs, completion_mask, 1 - quantile)
        assert torch.equal(tree.get_high_entropy_mask(ours, completion_mask, 1 - quantile), expected), quantile


@needs_fused_head_trl
def test_split_trees_and_chunked_forwards_match_trl():
    """Row capacity below one group (trees split by completions) and one packed row per backbone call."""
    reference, model = tiny_model(attn="sdpa"), tiny_model()
    add_trl_fused_head(reference, temperature=0.7, outputs=("log_probs", "entropy"))
    add_trl_fused_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    settings = TreeHeadSettings(temperature=0.7, outputs=("log_probs", "entropy"), max_packed_tokens=24)
    head = add_tree_fused_lm_head(model, settings)
    ids, mask, keep = padded_batch(*scenario("several_prompts"))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    with torch.no_grad(), float64_norms():
        theirs = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        ours = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, tree_tokens_per_forward=24)
    assert head.layout_stats.num_split_trees >= 1 and head.layout_stats.num_rows >= 2
    for field in ("log_probs", "entropy", "loss"):
        assert relative_error(getattr(ours, field), getattr(theirs, field)) <= TRL_TOLERANCE
    assert torch.equal(ours.label_mask, theirs.label_mask)


def test_generation_is_unchanged():
    model, twin = tiny_model(), tiny_model(attn="sdpa")
    add_trl_fused_head(model)
    add_tree_fused_lm_head(model)
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), twin.generate(prompt, **kwargs))


@needs_fused_head_trl  # the forward wrapped is TRL's head
def test_installing_again_replaces_the_head():
    """A second head wraps the forward the first replaced (TRL's), not the first head; its state stays on the head
    objects, none on the model."""
    model = tiny_model()
    add_trl_fused_head(model, outputs=("log_probs", "entropy"))
    trls = model.forward
    first = add_tree_fused_lm_head(model)
    second = add_tree_fused_lm_head(model, TreeHeadSettings(outputs=("log_probs", "entropy")))
    assert first.previous_forward is trls and second.previous_forward is trls and model.forward.__func__ is second
    ids, mask, keep = padded_batch(*scenario("full_group"))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert ours.entropy is not None and second.layout_stats.dedup_ratio > 1 and first.layout_stats is None
    assert not [name for name in vars(model) if name.startswith("hf_tree")]


@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_one_step_matches_trl(tmp_path, monkeypatch, peft):
    """Full fine-tuning (separate reference model) and LoRA (reference = the adapter disabled)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = saved_tiny_model(tmp_path, torch.float64)
    trl, trl_updates = one_step(GRPOTrainer, GRPOConfig, path, peft)
    tree, tree_updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


def test_unsupported_setups_raise(trainers, tmp_path):
    _, tree, _ = trainers
    ids, mask, keep = padded_batch(*scenario("full_group"))
    with pytest.raises(ValueError, match="pixel_values"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, pixel_values=torch.zeros(1, 3, 4, 4))
    # a text model's token_type_ids (GPT-2 adds their embeddings) are not image markers: refused, not dropped
    with pytest.raises(ValueError, match="token_type_ids"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, token_type_ids=torch.zeros_like(ids))
    holed = mask.clone()
    holed[0, -keep] = 0  # a hole between prompt and completion
    holed[0, -keep + 1] = 1
    with pytest.raises(ValueError, match="contiguous"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, holed, keep)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    sdpa_model = tiny_model(attn="sdpa")
    with pytest.raises(ValueError, match="TreeGRPOConfig"):
        TreeGRPOTrainer(
            sdpa_model, zero_reward, trainer_args(GRPOConfig, str(tmp_path), torch.float64, beta=0.0), **setup
        )
    with pytest.raises(ValueError, match="max_packed_tokens"):
        trainer_args(TreeGRPOConfig, str(tmp_path), torch.float64, max_packed_tokens=1)
    small = tiny_model()
    add_tree_fused_lm_head(small, TreeHeadSettings(max_packed_tokens=4))
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.raises(ValueError, match="max_packed_tokens=4"):
        small(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def test_model_instance_on_sdpa_is_switched(tmp_path, caplog):
    """As TreeSFTTrainer does: an instance on sdpa is switched to tree_flash with one warning, not refused."""
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    model = tiny_model(attn="sdpa")
    with caplog.at_level("WARNING", logger="hf_tree"):
        TreeGRPOTrainer(
            model, zero_reward, trainer_args(TreeGRPOConfig, str(tmp_path), torch.float64, beta=0.0), **setup
        )
    assert model.config._attn_implementation == "tree_flash"
    assert sum("switched model from attn_implementation='sdpa'" in r.getMessage() for r in caplog.records) == 1


def test_a_pass_that_scores_nothing_works(tmp_path):
    """mask_truncated_completions zeroes the completion mask of truncated rows; a micro-batch of only truncated rows
    scores nothing. The first such policy pass raised AttributeError (no layout stats yet) when logging, a later
    one logged the previous pass's dedup ratio again (``log_tree_stats``, also called by the DPO trainer)."""
    path = saved_tiny_model(tmp_path, torch.float64)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trl = GRPOTrainer(path, zero_reward, trainer_args(GRPOConfig, path, torch.float64), **setup)
    tree = TreeGRPOTrainer(path, zero_reward, trainer_args(TreeGRPOConfig, path, torch.float64), **setup)
    ids, mask, keep = padded_batch(*scenario("full_group"))

    def logged() -> int:
        return sum(len(metrics.get("tree/dedup_ratio", [])) for metrics in tree._metrics.values())

    log_tree_stats(tree)  # before any tree pass
    assert logged() == 0
    with torch.no_grad():
        tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, compute_entropy=True)
    assert logged() == 1
    mask[:, -keep:] = 0  # every completion truncated and masked, as TRL's mask_truncated_completions does
    theirs, their_entropy, _ = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, keep, compute_entropy=True)
    ours, entropy, _ = tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, compute_entropy=True)
    assert torch.equal(ours, on_completions(theirs, mask)) and not ours.any()
    assert torch.equal(entropy * 0, their_entropy * 0)
    log_tree_stats(tree)  # as DPO's compute_loss does after every pass
    assert logged() == 1  # nothing packed, nothing (stale) logged
    ours.sum().backward()  # the zero output stays connected to the model, as TRL's
