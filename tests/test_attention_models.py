"""tree_flash engines inside real tiny models, against per-branch training.

Oracle (tests/helpers.py): each branch run alone through the same model with ``sdpa`` and the standard
shifted cross-entropy. float64 with RMSNorm kept in float64; low precision compares errors against the
same-dtype per-branch run. Each test forces the engine it checks with ``set_attention_backend``.
"""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention import set_attention_backend
from tests.helpers import (
    float64_norms,
    grads_of,
    max_grad_relative_error,
    per_branch_forest_loss,
    relative_error,
    tiny_model,
)
from tests.workloads import forest, random_tree_branches

VOCAB = 97
TOLERANCE = 1e-9
FAMILIES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("qwen3", {}, id="qwen3"),
    pytest.param("mistral", {"sliding_window": 4}, id="mistral-window4"),
    pytest.param("gpt_oss", {}, id="gpt_oss-sinks-window4"),  # sinks in every layer, window 4 on half of them
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@contextlib.contextmanager
def backend(name: str):
    set_attention_backend(name)
    try:
        yield
    finally:
        set_attention_backend(None)


def tree_loss_and_grads(model, batch):
    model.zero_grad()
    loss = tree_causal_lm_loss(model, batch)
    loss.backward()
    return loss.detach(), grads_of(model)


def reference_loss_and_grads(model, groups):
    model.zero_grad()
    loss = per_branch_forest_loss(model, groups)
    loss.backward()
    return loss.detach(), grads_of(model)


WINDOWLESS = [
    *FAMILIES[:3],
    pytest.param("gpt_oss", {"layer_types": ["full_attention"] * 2}, id="gpt_oss-sinks-full"),
]


@pytest.mark.parametrize(
    "engine, family, overrides",
    [pytest.param("blocked", *p.values, id=f"blocked-{p.id}") for p in FAMILIES]
    + [pytest.param("segments", *p.values, id=f"segments-{p.id}") for p in WINDOWLESS],
)
def test_cpu_engines_match_per_branch_in_float64(engine, family, overrides):
    groups, batch = forest(seed=1)
    assert batch["input_ids"].shape[0] > 1
    with float64_norms(), backend(engine):
        model = tiny_model(family, vocab_size=VOCAB, **overrides)
        loss, grads = tree_loss_and_grads(model, batch)
        ref_loss, ref_grads = reference_loss_and_grads(model, groups)
    assert relative_error(loss, ref_loss) <= TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.mark.parametrize("family, overrides", FAMILIES[3:])
def test_segments_engine_refuses_sliding_windows_by_name(family, overrides):
    _, batch = forest(seed=1)
    with backend("segments"):
        model = tiny_model(family, vocab_size=VOCAB, **overrides)
        with pytest.raises(ValueError, match="use blocked_tree_attention"):
            tree_causal_lm_loss(model, batch)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_flex_engine_forward_matches_per_branch_in_float64(family, overrides):
    """Flex has no CPU backward: the loss value checks its block mask through each model family."""
    groups, batch = forest(seed=2)
    with float64_norms(), backend("flex"), torch.no_grad():
        model = tiny_model(family, vocab_size=VOCAB, **overrides)
        loss = tree_causal_lm_loss(model, batch)
        ref_loss = per_branch_forest_loss(model, groups)
    assert relative_error(loss, ref_loss) <= TOLERANCE


def branch_logits(model, tree: Tree, packed: bool) -> torch.Tensor:
    """Logits of every branch's tokens, branches concatenated: from one packed row, or from each branch
    run alone with ``sdpa`` (the eager per-branch oracle)."""
    if packed:
        batch = TreeDataCollator(max_packed_tokens=tree.num_tokens, pad_to_multiple_of=16)([tree])
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"]).logits
        return torch.cat([logits[0, tree.branch_flat_indices(b)] for b in range(tree.num_branches)])
    model.set_attn_implementation("sdpa")
    try:
        return torch.cat(
            [model(input_ids=torch.tensor([tree.branch_tokens(b)])).logits[0] for b in range(tree.num_branches)]
        )
    finally:
        model.set_attn_implementation("tree_flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, overrides", [FAMILIES[0], FAMILIES[3]])
def test_low_precision_error_within_twice_per_branch_eager(family, overrides, dtype):
    """Branch logits and the parameter gradients of a fixed linear function of them (float64 reduction on
    both sides), against a float64 per-branch run: error at most twice the same-dtype per-branch error."""
    tree = Tree.from_sequences(*random_tree_branches(random.Random(3), 6))
    results = {}
    with backend("blocked"):
        exact_model = tiny_model(family, vocab_size=VOCAB, **overrides)
        weights = None
        for name, model, packed in (("exact", exact_model, False), ("tree", None, True), ("eager", None, False)):
            model = model or copy.deepcopy(exact_model).to(dtype)
            logits = branch_logits(model, tree, packed)
            if weights is None:
                weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            (logits.to(torch.float64) * weights).sum().backward()
            grads = grads_of(model)
            results[name] = (logits.detach(), torch.cat([grads[k].flatten() for k in sorted(grads)]))
    for i in range(2):  # logits, gradients
        tree_error = relative_error(results["tree"][i], results["exact"][i])
        assert tree_error <= 2 * relative_error(results["eager"][i], results["exact"][i])


def test_attention_dropout_is_refused_in_training():
    _, batch = forest(seed=4)
    with backend("blocked"):
        model = tiny_model("llama", vocab_size=VOCAB, attention_dropout=0.1).train()
        with pytest.raises(ValueError, match="dropout"):
            tree_causal_lm_loss(model, batch)
        model.eval()  # dropout is off at evaluation: the same model works
        assert torch.isfinite(tree_causal_lm_loss(model, batch))


def test_without_kv_end_the_model_is_exactly_sdpa_and_generates():
    """Dual mode: ordinary (padded) batches and generate() behave as with attn_implementation="sdpa"."""
    tree_model = tiny_model("qwen2", vocab_size=VOCAB)
    sdpa_model = tiny_model("qwen2", vocab_size=VOCAB, attn="sdpa")
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 3, 4, 5, 6]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(tree_model(input_ids=input_ids[:1]).logits, sdpa_model(input_ids=input_ids[:1]).logits)
        padded = tree_model(input_ids=input_ids, attention_mask=attention_mask).logits
        assert torch.equal(padded, sdpa_model(input_ids=input_ids, attention_mask=attention_mask).logits)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    generated = tree_model.generate(input_ids, **kwargs)
    assert generated.shape == (2, 11)
    assert torch.equal(generated, sdpa_model.generate(input_ids, **kwargs))


def test_gradient_checkpointing_gives_the_same_gradients():
    groups, batch = forest(seed=5)
    with float64_norms(), backend("blocked"):
        model = tiny_model("llama", vocab_size=VOCAB).train()
        loss, grads = tree_loss_and_grads(model, batch)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ckpt_loss, ckpt_grads = tree_loss_and_grads(model, batch)
        ref_loss, ref_grads = reference_loss_and_grads(model, groups)
    assert relative_error(ckpt_loss, loss) <= 1e-12
    assert max_grad_relative_error(ckpt_grads, grads) <= 1e-12
    assert max_grad_relative_error(ckpt_grads, ref_grads) <= TOLERANCE


def test_lora_model_through_the_blocked_engine_matches_per_branch():
    from peft import LoraConfig, get_peft_model

    groups, batch = forest(seed=6)
    with float64_norms(), backend("blocked"):
        base = tiny_model("qwen3", vocab_size=VOCAB)
        model = get_peft_model(
            base, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
        )
        loss, grads = tree_loss_and_grads(model, batch)
        assert grads and all("lora_" in name for name in grads)
        ref_loss, ref_grads = reference_loss_and_grads(model, groups)
    assert relative_error(loss, ref_loss) <= TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.mark.slow  # dynamo traces the whole model: ~20 s on a busy 2-core machine
def test_compiled_model_runs_the_blocked_engine_eagerly():
    """torch.compile of the model: the engine is a compiler-disabled region, so the loss and gradients
    are those of the eager model (``eager`` backend here: the graph breaks are what is tested)."""
    _, batch = forest(seed=7)
    with float64_norms(), backend("blocked"):
        model = tiny_model("llama", vocab_size=VOCAB)
        loss, grads = tree_loss_and_grads(model, batch)
        compiled = torch.compile(model, backend="eager")
        compiled_loss, _ = tree_loss_and_grads(compiled, batch)
        compiled_grads = grads_of(model)
    assert relative_error(compiled_loss, loss) <= 1e-12
    assert max_grad_relative_error(compiled_grads, grads) <= 1e-12


@pytest.mark.parametrize(
    "family, overrides",
    [
        pytest.param(
            "gemma3_text", dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]), id="gemma3"
        ),
        pytest.param("gemma2", dict(sliding_window=3, attn_logit_softcapping=0.5), id="gemma2-softcap"),
    ],
)
def test_gemma_sliding_and_softcapped_layers_match_per_branch(family, overrides):
    """Mixed sliding/full layers (Gemma 3) and softcapping (Gemma 2, eager oracle) in tree mode. Gemma's RMSNorm
    computes in float32 even in float64 (not patched by float64_norms): ~1e-7, against ~1e-1 for a lost window."""
    groups, batch = forest(seed=8)
    with backend("blocked"):
        model = tiny_model(family, vocab_size=VOCAB, head_dim=8, **overrides)
        loss, grads = tree_loss_and_grads(model, batch)
        ref_loss, ref_grads = reference_loss_and_grads(model, groups)
    assert relative_error(loss, ref_loss) <= 1e-6
    assert max_grad_relative_error(grads, ref_grads) <= 1e-6


def attention_call(model, batch, **extra):
    """Call ``tree_attention_forward`` as layer 0 of ``model`` would, on random q/k/v of ``batch``'s shape."""
    from hf_tree.attention import tree_attention_forward

    module = model.model.layers[0].self_attn
    n = batch["kv_end"].shape[1]
    q = torch.randn(batch["kv_end"].shape[0], 4, n, 8, dtype=torch.float64)
    k = v = torch.randn(batch["kv_end"].shape[0], 2, n, 8, dtype=torch.float64)
    options = dict(scaling=0.3, kv_end=batch["kv_end"], position_ids=batch["position_ids"]) | extra
    return tree_attention_forward(module, q, k, v, options.pop("attention_mask", None), **options)


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(position_bias=torch.zeros(1)), "position_bias"),
        (dict(indices=torch.zeros(1)), "indices"),
        (dict(sinks=torch.zeros(1)), "per-token attention sinks"),
        (dict(cu_seq_lens_q=torch.zeros(1)), "cu_seq_lens_q"),
        (dict(is_causal=False), "not causal"),
        (dict(s_aux=torch.zeros(3, dtype=torch.float64)), r"one logit per query head"),
    ],
)
def test_tree_mode_refuses_keywords_it_cannot_honour(extra, match):
    _, batch = forest(seed=9)
    model = tiny_model("llama", vocab_size=VOCAB)
    with backend("blocked"):
        attention_call(model, batch)  # the same call without the keyword runs
        with pytest.raises(ValueError, match=match):
            attention_call(model, batch, **extra)


def test_tree_mode_refuses_masks_it_cannot_reproduce():
    """A chunked layer's mask (what transformers builds for Llama 4's chunked_attention layers), a padding mask and
    a ready-made 4D mask next to kv_end, and a KV cache holding earlier tokens: ValueErrors, never ignored."""
    from transformers.masking_utils import chunked_causal_mask_function

    from hf_tree.attention.dual import tree_mask_function

    _, batch = forest(seed=10)
    rows, n = batch["kv_end"].shape
    model = tiny_model("llama", vocab_size=VOCAB)
    chunked = tree_mask_function(
        rows, n, n, mask_function=chunked_causal_mask_function(4, torch.zeros(rows, dtype=torch.long)), local_size=4
    )
    padding = torch.ones(rows, n, dtype=torch.bool)
    padding[0, 0] = False
    with backend("blocked"):
        with pytest.raises(ValueError, match="local_size=4"):
            attention_call(model, batch, attention_mask=chunked)
        with pytest.raises(ValueError, match="hides some tokens"):
            attention_call(model, batch, attention_mask=tree_mask_function(rows, n, n, attention_mask=padding))
        with pytest.raises(ValueError, match="ready-made attention mask"):
            attention_call(model, batch, attention_mask=torch.ones(rows, 1, n, n, dtype=torch.bool))
        with pytest.raises(ValueError, match="padding of packed rows|hides some tokens"):
            model(input_ids=batch["input_ids"], kv_end=batch["kv_end"], attention_mask=padding.long())
        cache = model(input_ids=batch["input_ids"][:, :3], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="KV cache"):
            model(**{k: batch[k] for k in ("input_ids", "position_ids", "kv_end")}, past_key_values=cache)
