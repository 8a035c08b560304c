"""Model-zoo conformance (hf_tree.zoo): every architecture ends exact, refused or not buildable; none silently
wrong.

Oracle: each branch run alone with the model's own attention (``sdpa``, else ``eager``) and the model's own logits,
in float64 (float32 where the model cannot), for the tree loss and every parameter gradient; and the model's own
attention for dual mode (``tree_flash`` without ``kv_end``). The fast subset has one model per layer kind; the
whole causal-LM mapping is the ``slow`` test (and ``python benchmarks/model_zoo.py``).
"""

from __future__ import annotations

import pytest

from hf_tree.zoo import ZOO_VARIANTS, check_architecture, zoo_model_types, zoo_variants

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One model per layer kind, with the state it must reach.
FAST_SUBSET = {
    "llama": "exact",  # full attention, RMSNorm, rotary
    "qwen3": "exact",  # q/k norms
    "mistral": "exact",  # sliding window on every layer
    "gemma3_text": "exact",  # mixed sliding/full layers
    "gemma2": "exact",  # attention and final logit softcapping
    "gpt_oss": "exact",  # attention sinks, MoE (with its router load-balancing loss)
    "cohere": "exact",  # logit_scale
    "granite": "exact",  # logits_scaling (and residual/attention multipliers)
    "qwen3_next": "exact",  # GatedDeltaNet linear attention + conv (hybrid; hf_tree.models.mixers)
    "bamba": "exact",  # Mamba2 mixers + attention (hybrid; hf_tree.models.mixers)
    "bloom": "refused",  # ALiBi: the model builds its bias outside the attention function
    "bert": "refused",  # a transform before the vocabulary projection
    "opt": "exact",  # learned positions; its forward runs the inner decoder, not base_model
}


@pytest.mark.parametrize("model_type", sorted(FAST_SUBSET))
def test_fast_subset(model_type):
    result = check_architecture(model_type)
    assert result.state == FAST_SUBSET[model_type], result.detail
    if result.state == "exact":
        assert result.loss_error is not None and result.grad_error is not None and result.dual_error is not None
    # the MoE models of the subset: their router load-balancing loss is checked on trees too
    assert result.router == ("exact" if model_type in ("gpt_oss", "qwen3_next") else ""), result.detail


@pytest.mark.parametrize("variant", sorted(ZOO_VARIANTS))
def test_length_switch_variants_are_refused_when_crossed_and_exact_below(variant):
    """Phi-3 longrope and dynamic NTK: the probe branches (8-13 tokens) cross a switch at 10 and stay below 64."""
    result = check_architecture(variant)
    expected = "refused" if "switch 10" in variant else "exact"
    assert result.state == expected, result.detail
    if expected == "refused":
        assert "longest branch has 13 tokens" in result.detail


@pytest.mark.slow
def test_whole_zoo_has_no_silent_mismatch():
    results = [check_architecture(model_type) for model_type in zoo_model_types() + zoo_variants()]
    silent = [(r.model_type, r.detail) for r in results if r.state == "MISMATCH"]
    assert not silent
    assert sum(r.state == "exact" for r in results) >= 50  # the suite really ran models
