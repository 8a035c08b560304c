"""Model-zoo conformance (hf_tree.zoo): every architecture ends exact, refused or not buildable; none silently
wrong.

Oracle: each branch run alone with the model's own attention (``sdpa``, else ``eager``) and the model's own logits,
in float64 (float32 where the model cannot), for the tree loss and every parameter gradient; and the model's own
attention for dual mode (``tree_flash`` without ``kv_end``). The fast subset has one model per layer kind; the
whole causal-LM mapping is the ``slow`` test (and ``python benchmarks/model_zoo.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_tree.attention.families import refused_family
from hf_tree.zoo import (
    ZOO_VARIANTS,
    RefusedOnLoad,
    build_runnable,
    check_architecture,
    probe_branches,
    tiny_config,
    zoo_model_types,
    zoo_variants,
)

ROOT = Path(__file__).resolve().parent.parent

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
    "mamba": "exact",  # Mamba-1 selective scan + conv, no attention (hf_tree.models.mixers)
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


# Types the generic shrink could not build before hf_tree.zoo.FAMILY_OVERRIDES and the per-layer / MLA rules
# (issue 43), built tiny and run through their own forward (build only: ~10 s for all on an idle machine); the
# verdicts are the zoo's (docs/models.md). First the families users fine-tune most, ...
FORMERLY_NOT_BUILDABLE = [
    "gemma4_text",
    "gemma3n_text",
    "qwen4_exp_text",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "longcat_flash",
    "youtu",
    "axk1",
    "axk2",
    "mamba2",
    "gptj",
    "codegen",
    "ministral",
    "nemotron",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "kimi_linear",
    "lfm2_moe",
    "zamba",
    "zamba2",
    "dbrx",
    "dots1",
]
# ... then multimodal composites and the rest.
FORMERLY_NOT_BUILDABLE_MORE = [
    "gemma4",
    "gemma4_unified",
    "gemma4_unified_text",
    "qwen4_exp",
    "bailing_hybrid",
    "blt",
    "cohere_compass_text",
    "dory",
    "dots3_note",
    "dots3_note_text",
    "laguna",
    "musicgen",
    "musicgen_melody",
    "reformer",
    "xlnet",
    "xlstm",
    "xmod",
    "zaya",
]


@pytest.mark.parametrize("model_type", FORMERLY_NOT_BUILDABLE + FORMERLY_NOT_BUILDABLE_MORE)
def test_formerly_not_buildable_types_build_tiny(model_type):
    """Each builds tiny and runs its own forward, or is refused by name on load (the sparse-attention indexers)."""
    try:
        model, _ = build_runnable(model_type, probe_branches()[0][0])
    except RefusedOnLoad as error:
        assert refused_family(tiny_config(model_type)) is not None and "hf_tree refuses" in str(error)
        return
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny: no default-sized table left over


def test_per_layer_fields_follow_the_kept_layers():
    """Gemma 4: ``per_layer_config`` (the full-attention layers' wider heads) renumbered to the kept layers; Laguna:
    a per-layer list keeps the same layers; MLA: query/key dims tied, one key head per query head."""
    gemma4 = tiny_config("gemma4_text")
    assert gemma4.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.head_dim for layer in gemma4.per_layer_config] == [16, 32]  # the default's layer 5 is kept layer 1
    laguna = tiny_config("laguna")
    assert len(laguna.num_attention_heads_per_layer) == laguna.num_hidden_layers == len(laguna.layer_types)
    mla = tiny_config("deepseek_v3")
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert mla.num_key_value_heads == mla.num_attention_heads


def test_a_type_transformers_cannot_run_is_unrunnable_with_its_error():
    result = check_architecture("git")
    assert result.state == "unrunnable"
    assert "GIT_SELF_ATTENTION_CLASSES" in result.detail and "KeyError: 'tree_flash'" in result.detail


def test_an_output_embedding_per_codebook_is_refused_by_name():
    """MusicGen (built from its decoder sub-config): one LM head per codebook, not one vocabulary projection."""
    result = check_architecture("musicgen")
    assert result.state == "refused"
    assert "MusicgenForCausalLM's output embedding is a ModuleList" in result.detail


def test_readme_counts_match_the_docs_table():
    """``python benchmarks/model_zoo.py --write-docs`` writes both; a hand edit of one shows here."""

    def block(path: Path, name: str) -> str:
        return re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", path.read_text(), re.DOTALL)[1]

    table = block(ROOT / "docs" / "models.md", "zoo-table")
    assert block(ROOT / "README.md", "zoo-counts") == table.splitlines()[-1]


@pytest.mark.slow
def test_whole_zoo_has_no_silent_mismatch():
    """Every causal-LM type is built tiny and judged: exact, refused or unrunnable (transformers itself cannot run it
    on token ids), never a silent mismatch, "not buildable" or "error"."""
    results = [check_architecture(model_type) for model_type in zoo_model_types() + zoo_variants()]
    silent = [(r.model_type, r.detail) for r in results if r.state == "MISMATCH"]
    assert not silent
    assert sum(r.state == "exact" for r in results) >= 100  # the suite really ran models
    unjudged = {r.model_type: r.detail for r in results if r.state in ("not buildable", "error")}
    assert not unjudged, unjudged
