"""The central promise: the packed tree loss and every parameter gradient equal per-branch training.

Oracle: each branch run alone through the same model with ``sdpa`` and the standard shifted CE,
combined with the same normalization. float64, RMSNorm kept in float64 (see tests/helpers.py).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.loss import loss_chunk_rows, weighted_cross_entropy
from hf_tree.models.head import detect_logit_head
from tests.helpers import (
    VOCAB,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    needs_fused_head_trl,
    per_branch_loss,
    relative_error,
    tiny_model,
)
from tests.workloads import deep_tree_branches, random_tree_branches

TOLERANCE = 1e-9


def wide_tree_branches(fan_out: int = 33):
    prompt = [3, 1, 4, 1, 5]
    return [prompt + [i % VOCAB, (7 * i) % VOCAB] for i in range(fan_out)], None


def check_equivalence(family: str, groups, normalization: str, max_packed_tokens: int) -> None:
    """``groups``: list of (sequences, masks) each forming one tree."""
    with float64_norms():
        model = tiny_model(family, vocab_size=VOCAB)
        trees = [Tree.from_sequences(s, m) for s, m in groups]
        collator = TreeDataCollator(
            max_packed_tokens=max_packed_tokens, normalization=normalization, pad_to_multiple_of=8
        )
        batch = collator([t.to_dict() for t in trees])
        loss = tree_causal_lm_loss(model, batch)
        loss.backward()
        tree_grads = grads_of(model)
        model.zero_grad()

        total, divisor = 0.0, 0.0
        for s, m in groups:
            t, d = per_branch_loss(model, s, m, normalization)
            total, divisor = total + t, divisor + d
        reference = total / divisor
        reference.backward()
        ref_grads = grads_of(model)

    assert relative_error(loss, reference) <= TOLERANCE
    assert float(batch["num_loss_items"]) == pytest.approx(float(divisor), rel=1e-12)
    assert max_grad_relative_error(tree_grads, ref_grads) <= TOLERANCE
    return batch


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_wide_deep_multi_tree_row_matches_per_branch(family, normalization):
    rng = random.Random(0)
    groups = [wide_tree_branches(), deep_tree_branches(), random_tree_branches(rng, 6)]
    batch = check_equivalence(family, groups, normalization, max_packed_tokens=128)
    assert batch["input_ids"].shape[0] < 3  # trees share rows


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_split_trees_match_per_branch(normalization):
    rng = random.Random(1)
    groups = [random_tree_branches(rng, 10, max_len=20), wide_tree_branches(40)]
    batch = check_equivalence("llama", groups, normalization, max_packed_tokens=24)
    assert int(batch["num_split_trees"]) == 2


@given(
    seed=st.integers(0, 2**31),
    num_trees=st.integers(1, 3),
    normalization=st.sampled_from(["token", "sequence"]),
    family=st.sampled_from(["llama", "qwen3"]),
    max_packed_tokens=st.sampled_from([40, 64, 256]),
)
# max_examples: the tier's hypothesis profile (tests/conftest.py SWEEP_EXAMPLES: 10 in the fast tier, 40 in all)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_forests_match_per_branch(seed, num_trees, normalization, family, max_packed_tokens):
    rng = random.Random(seed)
    groups = []
    for _ in range(num_trees):
        sequences, masks = random_tree_branches(rng, rng.randint(1, 8))
        groups.append((sequences, masks))
    check_equivalence(family, groups, normalization, max_packed_tokens)


def test_loss_refuses_a_model_without_tree_attention():
    model = tiny_model("llama", attn="sdpa")
    batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences([[1, 2, 3]]).to_dict()])
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        tree_causal_lm_loss(model, batch)


def test_loss_divides_by_the_given_global_count():
    model = tiny_model("llama")
    batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences([[1, 2, 3], [1, 2, 4]]).to_dict()])
    own = tree_causal_lm_loss(model, batch)
    doubled = tree_causal_lm_loss(model, batch, num_items_in_batch=2 * batch["num_loss_items"])
    torch.testing.assert_close(doubled, own / 2)


def test_tied_embeddings_and_chunked_loss_match_per_branch():
    """Chunking the LM-head CE (chunk of 3 edges) and tied input/output embeddings keep exactness."""
    sequences, masks = random_tree_branches(random.Random(3), 6)
    with float64_norms():
        model = tiny_model("qwen3", vocab_size=VOCAB, tie_word_embeddings=True)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        batch = TreeDataCollator(max_packed_tokens=256)([Tree.from_sequences(sequences, masks).to_dict()])
        loss = tree_causal_lm_loss(model, batch, chunk_size=3)
        loss.backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        total, divisor = per_branch_loss(model, sequences, masks)
        (total / divisor).backward()
    assert relative_error(loss, total / divisor) <= TOLERANCE
    assert max_grad_relative_error(tree_grads, grads_of(model)) <= TOLERANCE


def test_peft_wrapped_model_with_lora_on_the_head_matches_per_branch():
    """LoRA on attention and on the LM head: the loss calls the (wrapped) head module, so adapters count."""
    from peft import LoraConfig, get_peft_model

    sequences, masks = random_tree_branches(random.Random(5), 5)
    with float64_norms():
        base = tiny_model("llama", vocab_size=VOCAB)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        model = get_peft_model(base, config)
        batch = TreeDataCollator(max_packed_tokens=256)([Tree.from_sequences(sequences, masks).to_dict()])
        loss = tree_causal_lm_loss(model, batch)
        loss.backward()
        tree_grads = grads_of(model)
        assert tree_grads and all("lora_" in name for name in tree_grads)
        model.zero_grad()
        total, divisor = per_branch_loss(model, sequences, masks)
        (total / divisor).backward()
    assert relative_error(loss, total / divisor) <= TOLERANCE
    assert max_grad_relative_error(tree_grads, grads_of(model)) <= TOLERANCE


def _reference_weighted_ce(head, hidden, targets, weights, softcap, scale=1.0):
    logits = head(hidden).float() if hidden.dtype == torch.bfloat16 else head(hidden)
    logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return (torch.nn.functional.cross_entropy(logits, targets, reduction="none") * weights).sum()


def _ce_problem(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False, dtype=dtype)
    hidden = torch.randn(7, 8, dtype=dtype, generator=generator, requires_grad=True)
    targets = torch.tensor([3, 3, 0, 10, 5, 3, 1])
    weights = torch.rand(7, dtype=torch.float64, generator=generator)
    return head, hidden, targets, weights


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("scale", [1.0, 0.0625])
@pytest.mark.parametrize("head_kind", ["linear", "wrapped"])
def test_weighted_cross_entropy_matches_torch_cross_entropy(softcap, scale, head_kind):
    """Both CE paths against autograd through ``F.cross_entropy`` (float64; chunks of 3 rows): a plain linear head
    takes the fused path (gradients during forward, the scale folded into the hidden states), any other module
    the checkpointed one."""
    head, hidden, targets, weights = _ce_problem(torch.float64)
    module = head if head_kind == "linear" else torch.nn.Sequential(head)
    total = weighted_cross_entropy(module, hidden, targets, weights, softcap=softcap, chunk_size=3, scale=scale)
    got = torch.autograd.grad(total, [hidden, head.weight])
    expected_total = _reference_weighted_ce(head, hidden, targets, weights, softcap, scale)
    expected = torch.autograd.grad(expected_total, [hidden, head.weight])
    torch.testing.assert_close(total, expected_total, rtol=1e-12, atol=0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


def test_fused_cross_entropy_in_bfloat16_is_as_accurate_as_eager():
    """bf16 head: the fused path's error against float64 is no worse than eager bf16 ``F.cross_entropy``'s."""
    head64, hidden64, targets, weights = _ce_problem(torch.float64)
    exact = torch.autograd.grad(_reference_weighted_ce(head64, hidden64, targets, weights, None), [hidden64])[0]
    head = copy.deepcopy(head64).to(torch.bfloat16)
    hidden = hidden64.detach().to(torch.bfloat16).requires_grad_()
    fused = torch.autograd.grad(weighted_cross_entropy(head, hidden, targets, weights, chunk_size=3), [hidden])[0]
    eager = torch.autograd.grad(_reference_weighted_ce(head, hidden, targets, weights.float(), None), [hidden])[0]
    assert relative_error(fused.double(), exact) <= 1.5 * relative_error(eager.double(), exact)


def test_fused_cross_entropy_without_gradients_matches():
    """Under ``no_grad`` (evaluation) and with a frozen head (LoRA elsewhere) the fused path still scores."""
    head, hidden, targets, weights = _ce_problem(torch.float64)
    expected = _reference_weighted_ce(head, hidden, targets, weights, None).detach()
    with torch.no_grad():
        torch.testing.assert_close(weighted_cross_entropy(head, hidden, targets, weights, chunk_size=3), expected)
    head.weight.requires_grad_(False)
    total = weighted_cross_entropy(head, hidden, targets, weights, chunk_size=3)
    torch.testing.assert_close(total.detach(), expected)
    assert head.weight.grad is None and torch.autograd.grad(total, hidden)[0].abs().sum() > 0


@pytest.mark.parametrize("evaluation", ["no_grad", "detached"])
def test_fused_cross_entropy_computes_no_gradients_in_evaluation(evaluation):
    """Under ``no_grad`` (or with inputs that need no grad) the fused path does the logits matmul only: no
    ``[M, D]``/``[vocab, D]`` gradient matmuls (counted by torch's FLOP counter), and still the exact loss."""
    from torch.utils.flop_counter import FlopCounterMode

    head, hidden, targets, weights = _ce_problem(torch.float64)
    expected = _reference_weighted_ce(head, hidden, targets, weights, None).detach()
    counter = FlopCounterMode(display=False)
    if evaluation == "no_grad":
        with torch.no_grad(), counter:
            total = weighted_cross_entropy(head, hidden, targets, weights, chunk_size=3)
    else:
        head.weight.requires_grad_(False)
        with counter:
            total = weighted_cross_entropy(head, hidden.detach(), targets, weights, chunk_size=3)
    logits_flops = 2 * hidden.numel() * head.out_features  # [M, D] @ [D, V]
    assert counter.get_total_flops() == logits_flops
    assert total.grad_fn is None
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)


# ------------------------------------------------------------------ the model's own hidden -> logits step
SCALED_HEADS = {
    "cohere": dict(logit_scale=0.0625),  # logits * logit_scale
    "granite": dict(logits_scaling=4.0),  # logits / logits_scaling
    "gemma2": dict(head_dim=8, final_logit_softcapping=2.0),  # softcap * tanh(logits / softcap)
}


@pytest.mark.parametrize("family", sorted(SCALED_HEADS))
def test_logit_head_is_detected_from_the_models_own_forward(family):
    model = tiny_model(family, vocab_size=VOCAB, **SCALED_HEADS[family])
    head = detect_logit_head(model)
    config = model.config
    expected_scale = {"cohere": 0.0625, "granite": 1 / 4.0, "gemma2": 1.0}[family]
    assert head.scale == expected_scale  # the config's own value, not a fitted approximation
    assert head.softcap == getattr(config, "final_logit_softcapping", None)


@pytest.mark.parametrize("family", sorted(SCALED_HEADS))
def test_scaled_heads_train_exactly(family):
    """Tree loss and gradients of a scaled / soft-capped head against per-branch training with the model's own
    attention and its own logits (which apply the scale in the model's forward)."""
    from hf_tree.testing import per_branch_forest_loss

    sequences, masks = random_tree_branches(random.Random(3), 5, vocab=VOCAB)
    with float64_norms():
        model = tiny_model(family, vocab_size=VOCAB, **SCALED_HEADS[family])
        loss = tree_causal_lm_loss(
            model, TreeDataCollator(max_packed_tokens=256)([Tree.from_sequences(sequences, masks).to_dict()])
        )
        loss.backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        reference = per_branch_forest_loss(model, [(sequences, masks)])
        reference.backward()
    assert relative_error(loss, reference) <= TOLERANCE
    # Cohere's LayerNorm and Gemma 2's RMSNorm compute in float32 even in float64 models (float64_norms patches
    # only the Llama-family norms): ~1e-7 rounding, see tests/helpers.float64_norms. A missing scale is off by ~10x.
    assert max_grad_relative_error(tree_grads, grads_of(model)) <= 1e-6


def test_head_with_a_transform_before_the_vocabulary_projection_is_refused():
    config = transformers.AutoConfig.for_model(
        "bert",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        is_decoder=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tree_flash")
    batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences([[5, 6, 7], [5, 6, 8]]).to_dict()])
    with pytest.raises(ValueError, match="BertLMHeadModel's forward does not compute its logits"):
        tree_causal_lm_loss(model, batch)


@needs_fused_head_trl
@pytest.mark.parametrize("family", sorted(SCALED_HEADS))
def test_trl_log_prob_head_applies_the_models_logit_scaling(family):
    """The tree fused log-prob head against TRL's own fused head on the same weights (own attention)."""
    from trl.trainer.utils import add_fused_lm_head

    from hf_tree.models.introspection import own_attention_name
    from hf_tree.trl.glue import add_tree_fused_lm_head

    model = tiny_model(family, vocab_size=VOCAB, **SCALED_HEADS[family])
    twin = tiny_model(family, vocab_size=VOCAB, attn=own_attention_name(model), **SCALED_HEADS[family])
    add_fused_lm_head(twin)
    add_fused_lm_head(model)
    add_tree_fused_lm_head(model)
    # No padding: TRL's eager Gemma 2 twin returns NaN on left-padded rows, which says nothing about the head.
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13], [5, 6, 14, 15, 16, 17]])
    mask = torch.ones_like(ids)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    with torch.no_grad(), float64_norms():
        theirs = twin(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        ours = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert relative_error(ours.log_probs, theirs.log_probs) <= TOLERANCE


def test_loss_chunk_rows_follow_the_vocabulary():
    assert loss_chunk_rows(49152) == 512  # SmolLM2: a 96 MiB float32 logits tile
    assert loss_chunk_rows(151936) == 128  # Qwen
    assert loss_chunk_rows(97) == 1024 and loss_chunk_rows(10**7) == 64  # the bounds


def test_fused_cross_entropy_with_no_scored_rows_has_zero_gradients():
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(0, 8, requires_grad=True)
    total = weighted_cross_entropy(head, hidden, torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    total.backward()
    assert float(total) == 0.0 and torch.equal(head.weight.grad, torch.zeros_like(head.weight))


@pytest.mark.parametrize("mode", ["bfloat16", "autocast"])
def test_low_precision_tree_loss_within_twice_per_branch(mode):
    """bf16 weights, and float32 weights under CPU bf16 autocast (TRL's ``bf16=True`` on CPU): over a few random
    trees, the tree loss and every parameter gradient (the head's summed over loss chunks) err against float64
    per-branch training at most twice as much as the same-precision per-branch run (root mean square over the
    trees: one scalar loss's rounding errors cancel by luck, 2e-6 on one tree where bf16's unit is 4e-3)."""
    errors: dict[str, list[tuple[float, float]]] = {"tree": [], "per_branch": []}
    for seed in range(3):
        sequences, masks = random_tree_branches(random.Random(seed), 8, max_len=40, vocab=VOCAB)
        batch = TreeDataCollator(max_packed_tokens=512)([Tree.from_sequences(sequences, masks).to_dict()])
        with float64_norms():
            exact_model = tiny_model("llama", vocab_size=VOCAB, seed=seed)
            total, divisor = per_branch_loss(exact_model, sequences, masks)
            (total / divisor).backward()
            exact = (total / divisor, grads_of(exact_model))
        for method in errors:
            model = copy.deepcopy(exact_model).to(torch.bfloat16 if mode == "bfloat16" else torch.float32)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
                if method == "tree":
                    loss = tree_causal_lm_loss(model, batch, chunk_size=16)  # several chunks of the fused head
                else:
                    total, divisor = per_branch_loss(model, sequences, masks)
                    loss = total / divisor
            loss.backward()
            errors[method].append((relative_error(loss, exact[0]), max_grad_relative_error(grads_of(model), exact[1])))
    rms = {m: torch.tensor(e, dtype=torch.float64).square().mean(0).sqrt() for m, e in errors.items()}
    # Below bf16's eps / 256 (3.1e-5; the per-branch run's own loss error here is 1e-5 to 2e-5), which of the two
    # runs errs more is decided by single roundings: where bf16 is emulated (CPUs without AVX-512) the tree loss
    # erred 2.03e-5 against a bound of 2 x 1.01e-5. A wrong mask or weight moves the loss by far more.
    floor = torch.finfo(torch.bfloat16).eps / 256
    assert bool((rms["tree"] <= (2 * rms["per_branch"]).clamp_min(floor)).all()), errors
