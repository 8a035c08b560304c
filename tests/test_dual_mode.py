"""Dual mode: ``tree_flash`` without ``kv_end`` is exactly the model's own attention.

Oracle: the same weights loaded with the model's own attention (``sdpa``, or ``eager`` where the model refuses
sdpa: softcapping, sinks), on the same inputs. Models mix full and sliding-window layers with windows far
shorter than the sequences (so a lost window changes the logits), gpt-oss adds attention sinks and Gemma 2 logit
softcapping. The two runs compute the same math on the same masks, so they agree to rounding (float64; Gemma 2 in
float32, because its own eager attention returns NaN on left-padded rows in float64).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_tree.attention import tree_attention_forward
from tests.helpers import own_attention, relative_error, tiny_config, tiny_model

VOCAB = 97
TOLERANCE = 1e-12
GEMMA3 = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
GEMMA2 = dict(sliding_window=3, attn_logit_softcapping=0.5, dtype=torch.float32)
MODELS = [
    pytest.param("gemma3_text", GEMMA3, id="gemma3-window3"),
    pytest.param("mistral", dict(sliding_window=4), id="mistral-window4"),
    pytest.param("gpt_oss", dict(sliding_window=3), id="gpt_oss-sinks-window3"),
    pytest.param("gemma2", GEMMA2, id="gemma2-softcap-window3-float32"),
    pytest.param("qwen2", dict(), id="qwen2"),
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def twin_models(family: str, overrides: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(``tree_flash`` model, the same weights with the model's own attention), float64 unless ``overrides``
    give a ``dtype``, eval mode."""
    overrides = dict(overrides)
    dtype = overrides.pop("dtype", torch.float64)
    config = tiny_config(family, vocab_size=VOCAB, head_dim=8, **overrides)
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flash", dtype=dtype)
    own = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=own_attention(tree), dtype=dtype)
    own.load_state_dict(tree.state_dict())
    return tree.eval(), own.eval()


def prompts(seed: int, batch: int = 3, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids``/``attention_mask`` ``[batch, length]``: row b left-padded by ``2 * b`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        attention_mask[b, : 2 * b] = 0
        input_ids[b, : 2 * b] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("family, overrides", MODELS)
def test_prefill_logits_equal_the_models_own_attention(family, overrides):
    """Unpadded, padded, and HF-packed (position_ids restarting) batches of 12 tokens, windows of 3-4."""
    tree, own = twin_models(family, overrides)
    input_ids, attention_mask = prompts(seed=1)
    packed_positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(3, -1)  # two sequences per row
    cases = {
        "unpadded": dict(input_ids=input_ids[:1]),
        "padded": dict(input_ids=input_ids, attention_mask=attention_mask),
        "packed": dict(input_ids=input_ids[:, :12], position_ids=packed_positions),
    }
    with torch.no_grad():
        for name, inputs in cases.items():
            got, expected = tree(**inputs).logits, own(**inputs).logits
            real = inputs.get("attention_mask", torch.ones(got.shape[:2], dtype=torch.long)).bool()
            assert relative_error(got[real], expected[real]) <= TOLERANCE, name


@pytest.mark.parametrize("family, overrides", MODELS)
def test_cached_greedy_generation_equals_the_models_own_attention(family, overrides):
    """generate() with a KV cache (prefill, then one token at a time past the window): a left-padded batch and an
    unpadded prompt (whose prefill transformers would run maskless), dynamic and static caches (whose masks
    generate() prepares in advance), tokens and every step's logits."""
    tree, own = twin_models(family, overrides)
    input_ids, attention_mask = prompts(seed=2, length=6)
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    settings.update(output_logits=True, return_dict_in_generate=True)
    for inputs, cache in itertools.product(
        (dict(input_ids=input_ids, attention_mask=attention_mask), dict(input_ids=input_ids[:1])), ("dynamic", "static")
    ):
        generated = tree.generate(**inputs, **settings, cache_implementation=cache)
        expected = own.generate(**inputs, **settings, cache_implementation=cache)
        assert generated.sequences.shape == (inputs["input_ids"].shape[0], 16)
        assert torch.equal(generated.sequences, expected.sequences)
        assert relative_error(torch.stack(generated.logits), torch.stack(expected.logits)) <= TOLERANCE


@pytest.mark.parametrize("causal", [True, False])
def test_flash_varlen_packing_is_applied_as_a_mask(causal):
    """Vision towers pass cu_seq_lens_q/k when the attention name contains "flash": without kv_end that packing
    must hold (each sequence alone), as sdpa on each sequence would give."""
    module = tiny_model("llama", vocab_size=VOCAB).model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 10, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    out, _ = tree_attention_forward(module, q, k, v, None, scaling=0.3, is_causal=causal, **varlen)
    pieces = [
        sdpa_attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, scaling=0.3, is_causal=causal)[0]
        for a, b in ((0, 3), (3, 10))
    ]
    assert relative_error(out, torch.cat(pieces, dim=1)) <= TOLERANCE


def test_a_model_that_computes_with_its_mask_outside_attention_fails_loudly():
    """Bloom adds ALiBi and its mask in its own attention code (no AttentionInterface): no attention function can
    apply a tree or window there, and reading a missing mask as "no mask" would silently attend to the future.
    Bloom is refused by name on load (tests/test_refused_families.py); set past that refusal, it stands for a
    family missing from the name list."""
    model = tiny_model("bloom", vocab_size=VOCAB, n_head=4, n_layer=2, attn="eager")
    model.config._attn_implementation_internal = "tree_flash"
    with pytest.raises(ValueError, match="outside the attention function"):
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))


def test_non_causal_call_without_a_mask_stays_non_causal():
    """Inkling2 (transformers 5.24) attends over the stacked states of earlier layers with a non-causal attention
    call that passes no mask, in a model that refuses sdpa: dual mode ran eager with an explicit causal mask there,
    so every later layer differed (logits off by 4e-3 in float32). Oracle: the model's own eager attention."""
    from hf_tree.zoo import NotBuildable, build_tiny, dual_mode_error

    try:
        model = build_tiny("inkling2_text", torch.float32)
    except (NotBuildable, ValueError) as error:  # not in this transformers
        pytest.skip(f"inkling2_text: {error}")
    assert dual_mode_error(model) < 1e-6
