"""Exact tree training on hybrid models: tree-aware causal convolutions, gated delta rule and Mamba2 scan.

Oracles:
- ops: each root-to-leaf branch gathered out of the packed row and run alone through the model's own torch function
  (float64 inputs). Those functions compute in float32 inside (``.float()``), so they bound the tree op's error at
  the float32 floor; the float64 exactness of the tree decomposition itself is checked against the same op run on
  the lone branch with a different chunk size (other chunk boundaries, no tree), at 1e-12, values and gradients.
- models: per-branch training with the model's own attention (tests/helpers.py), float64 weights. Their mixers and
  norms compute in float32 inside, so the bound is the float32 floor (measured ~1e-7..1e-6); the bug this guards
  against (siblings leaking into a branch's state) moves gradients by 1e-3..4e-1.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

from hf_tree import tree_causal_lm_loss
from hf_tree.models.check import SELF_CHECK_ENV_VAR, probe_tree_exactness
from hf_tree.models.mixers import (
    build_topology,
    install_tree_mixers,
    tree_causal_conv1d,
    tree_chunk_gated_delta_rule,
    tree_mamba2_chunk_scan,
    uninstall_tree_mixers,
)
from tests.helpers import (
    FLOAT32_FLOOR,
    HYBRIDS,
    SLOW_HYBRIDS,
    check_tree_op,
    float32_floor_grad_error,
    float64_norms,
    generate_and_score,
    grads_of,
    hybrid_model,
    max_grad_relative_error,
    one_rank_context_parallel_errors,
    per_branch_forest_loss,
    random_token_inputs,
    relative_error,
    tiny_model,
)
from tests.workloads import packed_batch


# ------------------------------------------------------------------------------------------------- topology
def test_topology_of_a_forest_row_with_padding():
    batch, _ = packed_batch()
    kv_end = batch["kv_end"]
    topology = build_topology(kv_end)
    pred = topology.pred.reshape(kv_end.shape)[0]
    position_ids = batch["position_ids"][0]
    real = kv_end[0] > torch.arange(kv_end.shape[1]) + 1  # padding: kv_end[j] == j + 1 (and single-token roots)
    for i in torch.nonzero(pred >= 0).flatten().tolist():  # a predecessor is one position shallower and an ancestor
        assert position_ids[i] == position_ids[pred[i]] + 1 and pred[i] < i < kv_end[0, pred[i]]
    assert (pred[position_ids == 0] == -1).all()
    assert not bool(torch.isin(torch.nonzero(~real).flatten(), pred).any())  # padding feeds nobody
    # Segments are cut at forks. Tree 1: [5] | [6 7 8], [50] | [9..12], [20 21], [51 52], [60] | [22], [30 31] |
    # [32], [40..43]; tree 2: [70] | [71 72], [90 91] | [73 74], [80]; level 0 also holds each padding token.
    assert topology.num_levels == 5
    levels = topology.levels(4)
    assert [sum(len(layout.parent) for layout in level) for level in levels][1:] == [2 + 2, 4 + 2, 2, 2]
    # Buckets by chunk size: level 0 holds [5], [70] and 1-token padding (chunks of 1); level 2's [9..12] (chunks
    # of 4) and its 2-token segments (chunks of 2) and [60] (chunks of 1).
    assert [layout.chunk_size for layout in levels[0]] == [1]
    assert [layout.chunk_size for layout in levels[2]] == [4, 2, 1]


def test_topology_refuses_a_malformed_kv_end():
    with pytest.raises(ValueError, match=r"kv_end\[0, 2\] = 2 must lie in \[3, 4\]"):
        build_topology(torch.tensor([[4, 4, 2, 4]]))


# ------------------------------------------------------------------------------------------------------ ops
@pytest.mark.parametrize("width", [2, 4])
def test_tree_causal_conv1d_matches_each_branch(width):
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    batch, _ = packed_batch()
    kv_end = batch["kv_end"]
    topology = build_topology(kv_end)
    (x,) = random_token_inputs(kv_end, (6,))
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(6, width, dtype=torch.float64, generator=generator)
    bias = torch.randn(6, dtype=torch.float64, generator=generator)
    original = causal_conv1d_fn.__hf_tree_original__

    def channels_first(fn):
        return lambda x: fn(x.transpose(1, 2)).transpose(1, 2)

    check_tree_op(
        channels_first(lambda x: tree_causal_conv1d(x, weight, bias, "silu", topology=topology)),
        channels_first(lambda x: original(x, weight, bias, "silu")),
        lambda lone, x: channels_first(lambda y: tree_causal_conv1d(y, weight, bias, "silu", topology=lone))(x),
        [x],
        kv_end,
    )


@pytest.mark.parametrize("chunk_size", [2, 64])
def test_tree_gated_delta_rule_matches_each_branch(chunk_size):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    batch, _ = packed_batch()
    kv_end = batch["kv_end"]
    topology = build_topology(kv_end)
    query, key, value, a, b = random_token_inputs(kv_end, (1, 4), (1, 4), (2, 3), (2,), (2,))
    original = torch_chunk_gated_delta_rule.__hf_tree_original__

    def run(fn, size):
        def call(q, k, v, a, b):
            g, beta = -torch.nn.functional.softplus(a), b.sigmoid()  # decays <= 0, rates in (0, 1)
            return fn(q, k, v, g=g, beta=beta, chunk_size=size, use_qk_l2norm_in_kernel=True)[0]

        return call

    check_tree_op(
        run(lambda *t, **k: tree_chunk_gated_delta_rule(*t, topology=topology, **k), chunk_size),
        run(original, chunk_size),
        lambda lone, *t: run(lambda *u, **k: tree_chunk_gated_delta_rule(*u, topology=lone, **k), 3)(*t),
        [query, key, value, a, b],
        kv_end,
    )


@pytest.mark.parametrize("chunk_size", [2, 256])
def test_tree_mamba2_scan_matches_each_branch(chunk_size):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    batch, _ = packed_batch()
    kv_end = batch["kv_end"]
    topology = build_topology(kv_end)
    x, dt, b, c = random_token_inputs(kv_end, (4, 3), (4,), (2, 5), (2, 5))
    generator = torch.Generator().manual_seed(3)
    A = -torch.rand(4, dtype=torch.float64, generator=generator) - 0.1
    D, dt_bias = torch.randn(2, 4, dtype=torch.float64, generator=generator)
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")))
    original = mamba2_chunk_scan.__hf_tree_original__

    check_tree_op(
        lambda *t: tree_mamba2_chunk_scan(t[0], t[1], A, t[2], t[3], chunk_size, topology=topology, **options),
        lambda *t: original(t[0], t[1], A, t[2], t[3], chunk_size, **options),
        lambda lone, *t: tree_mamba2_chunk_scan(t[0], t[1], A, t[2], t[3], 3, topology=lone, **options),
        [x, dt, b, c],
        kv_end,
    )


# ---------------------------------------------------------------------------------------------------- models


def tree_and_branch_gradients(model, max_packed_tokens: int = 64):
    batch, groups = packed_batch(max_packed_tokens)
    loss = tree_causal_lm_loss(model, batch)
    loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    reference = per_branch_forest_loss(model, groups)
    reference.backward()
    return loss, reference, tree_grads, grads_of(model), batch


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_model_tree_training_matches_on_branch(family):
    model = hybrid_model(family)
    loss, reference, tree_grads, ref_grads, batch = tree_and_branch_gradients(model)
    assert batch["input_ids"].shape[0] == 1 and (batch["kv_end"][0, -1] == batch["kv_end"].shape[1])  # forest+pad
    assert relative_error(loss, reference) <= FLOAT32_FLOOR
    assert float32_floor_grad_error(tree_grads, ref_grads) <= FLOAT32_FLOOR


def test_gradient_checkpointing_recomputes_the_same_tree():
    """Recomputed layers in backward see the same kv_end (and the cached topology): still per-branch exact."""
    model = hybrid_model("qwen3_5_text")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss, reference, tree_grads, ref_grads, _ = tree_and_branch_gradients(model)
    assert relative_error(loss, reference) <= FLOAT32_FLOOR
    assert float32_floor_grad_error(tree_grads, ref_grads) <= FLOAT32_FLOOR


@pytest.mark.parametrize("family", [pytest.param("qwen3_5_text", marks=pytest.mark.slow), "bamba"])
def test_bfloat16_tree_error_is_no_worse_than_on_branch(family):
    """In bfloat16 (float32 states) the tree's gradient error against float64 per-branch training is within 2x of
    bfloat16 per-branch training's own error (measured ratios 0.7-1.4)."""
    model = hybrid_model(family)
    exact = tree_and_branch_gradients(model)[3]
    low = copy.deepcopy(model).to(torch.bfloat16)
    low.zero_grad(set_to_none=True)
    _, _, tree_grads, branch_grads, _ = tree_and_branch_gradients(low)
    tree_error = float32_floor_grad_error({n: g.double() for n, g in tree_grads.items()}, exact)
    branch_error = float32_floor_grad_error({n: g.double() for n, g in branch_grads.items()}, exact)
    assert tree_error <= 2 * branch_error


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in SLOW_HYBRIDS if f != "mamba2"])
def test_more_hybrid_models_match_on_branch(family):
    test_hybrid_model_tree_training_matches_on_branch(family)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_pure_mamba2_model_matches_on_branch(checkpointing):
    """Mamba2ForCausalLM.forward drops the model's keyword arguments; hf_tree hands kv_end on to its backbone
    (hf_tree.models.mixers.install.KWARG_DROPPING_CLASSES), whose blocks pass it to the tree-aware scan and conv. A
    block's checkpoint keeps the keyword arguments it was called with, so a recompute sees kv_end too."""
    model = hybrid_model("mamba2")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    sdpa_refused = type(model).set_attn_implementation  # no attention at all: the oracle's "sdpa" means "eager"
    model.set_attn_implementation = lambda name: sdpa_refused(model, "eager" if name == "sdpa" else name)
    loss, reference, tree_grads, ref_grads, _ = tree_and_branch_gradients(model)
    assert relative_error(loss, reference) <= FLOAT32_FLOOR
    assert float32_floor_grad_error(tree_grads, ref_grads) <= FLOAT32_FLOOR


@pytest.mark.parametrize("family", ["nemotron", "stablelm"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_layers_that_drop_kv_end_match_on_branch(family, checkpointing):
    """Nemotron's and StableLM's decoder layers call their attention without the model's keyword arguments, so
    kv_end never reached tree_flash and the packed row ran as one causal sequence (the first-use probe refused them
    at 1.08 and 0.64); hf_tree hands the tree keywords on to the attention (KWARG_DROPPING_CLASSES). Partial rotary
    (Nemotron 0.5, StableLM 0.25), LayerNorm1P and relu2 are tree-agnostic: exact in float64, with checkpointing."""
    model = tiny_model(family, dtype=torch.float64)
    assert model.config.rope_parameters["partial_rotary_factor"] < 1
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    loss, reference, tree_grads, ref_grads, _ = tree_and_branch_gradients(model)
    assert relative_error(loss, reference) <= 1e-12
    assert max_grad_relative_error(tree_grads, ref_grads) <= 1e-9


@pytest.mark.parametrize("family", ["nemotron", "stablelm"])
def test_without_the_keyword_pass_the_probe_refuses_the_layer(family):
    model = tiny_model(family, dtype=torch.float64)
    uninstall_tree_mixers()
    try:
        with pytest.raises(ValueError, match=r"not tree-exact.*layer 0 .*self_attn"):
            probe_tree_exactness(model)
    finally:
        install_tree_mixers()


@contextlib.contextmanager
def float64_lfm2_norms() -> Iterator[None]:
    """``float64_norms`` (tests/helpers.py) also for LFM2's RMSNorm, which is the same math as Llama's."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    original = Lfm2RMSNorm.forward
    with float64_norms():
        Lfm2RMSNorm.forward = LlamaRMSNorm.forward  # the float64 forward while float64_norms is active
        try:
            yield
        finally:
            Lfm2RMSNorm.forward = original


@pytest.mark.parametrize("max_packed_tokens", [64, 24])
def test_lfm2_is_exact_in_float64(max_packed_tokens):
    """LFM2's short convolution has no float32 inside: with its norms kept in float64, tree training equals
    per-branch training at 1e-9, also with the tree split over several rows."""
    with float64_lfm2_norms():
        model = hybrid_model("lfm2")
        loss, reference, tree_grads, ref_grads, batch = tree_and_branch_gradients(model, max_packed_tokens)
    assert (batch["input_ids"].shape[0] > 1) == (max_packed_tokens == 24)
    assert relative_error(loss, reference) <= 1e-9
    assert max_grad_relative_error(tree_grads, ref_grads) <= 1e-9


@pytest.mark.slow  # the oracle's own teeth; the fast tier checks the tree mixers themselves
def test_without_tree_mixers_the_same_check_fails(monkeypatch):
    """The oracle has teeth: with the models' own mixers (the row seen as one sequence) siblings leak; the first-use
    self-check refuses such a model, and with the check off the gradients are visibly wrong."""
    model = hybrid_model("qwen3_5_text")
    uninstall_tree_mixers()
    try:
        with pytest.raises(ValueError, match="Qwen3_5GatedDeltaNet"):
            tree_and_branch_gradients(model)
        monkeypatch.setenv(SELF_CHECK_ENV_VAR, "0")
        loss, reference, tree_grads, ref_grads, _ = tree_and_branch_gradients(hybrid_model("qwen3_5_text"))
    finally:
        install_tree_mixers()
    assert float32_floor_grad_error(tree_grads, ref_grads) > 1e-2


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
def test_install_is_idempotent_and_leaves_batches_without_kv_end_unchanged(family):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    patched = modeling_qwen3_5.torch_chunk_gated_delta_rule
    install_tree_mixers()
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is patched  # no double wrapping
    model = hybrid_model(family).eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    attention_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    with torch.no_grad():
        installed = generate_and_score(model, input_ids, attention_mask)
        uninstall_tree_mixers()
        try:
            assert modeling_qwen3_5.torch_chunk_gated_delta_rule is patched.__hf_tree_original__
            original = generate_and_score(model, input_ids, attention_mask)
        finally:
            install_tree_mixers()
    torch.testing.assert_close(installed[0], original[0], rtol=0, atol=0)
    assert torch.equal(installed[1], original[1])


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
def test_tree_batches_refuse_a_cache(family):
    """A recurrent state cached after a packed tree would mix the branches' states: refused, not guessed."""
    model = hybrid_model(family)
    batch, _ = packed_batch()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"], use_cache=True)


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "bamba"])
def test_one_rank_context_parallel_equals_packed(family):
    """Under hf_tree's context parallel the mixers run on the whole row gathered from the ranks and keep their own
    slots (tests/test_context_parallel_windowed.py checks 2 ranks); on one rank this is the packed run."""
    batch, _ = packed_batch()
    loss_error, grad_error = one_rank_context_parallel_errors(hybrid_model(family), batch)
    assert loss_error <= 1e-12
    assert grad_error <= 1e-12
