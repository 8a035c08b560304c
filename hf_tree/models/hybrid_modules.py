"""Which transformers modeling modules get tree-aware mixers (``hf_tree.models.mixers``). Torch-free: ``import
hf_tree`` watches for these modules (``hf_tree.post_import``) without importing torch or the modules themselves."""

# Modeling modules whose every sequence-mixing op is covered (their models train exactly on trees).
TREE_MIXER_MODULES = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "mamba2",
    "nemotron_h",
    "falcon_h1",
    "bamba",
    "granitemoehybrid",
    "zamba2",
    "olmo_hybrid",
    "lfm3",
    "kimi_linear",
    "mamba",
    "falcon_mamba",
    "jamba",
    "zamba",
    # no mixer of their own: their decoder layers drop kv_end before their attention (KWARG_DROPPING_CLASSES)
    "nemotron",
    "stablelm",
)


def modeling_module(name: str) -> str:
    """``"bamba"`` -> ``"transformers.models.bamba.modeling_bamba"``."""
    return f"transformers.models.{name}.modeling_{name}"
