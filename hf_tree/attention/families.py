"""Model families refused by name, from the first message: architectures that compute with their attention mask
outside the attention function, which ``tree_flash`` cannot honour (it builds the tree mask inside attention).

The model zoo (hf_tree.zoo, docs/models.md) finds them "refused by the attention function": under ``tree_flash`` any
forward of theirs fails. Refusing them by ``model_type`` when they are loaded with ``tree_flash`` or handed to a tree
trainer says what is wrong at once, instead of "load it with tree_flash" and then "load it with sdpa or eager".
Families refused for other reasons (recurrent mixers, heads, positions) are refused by ``hf_tree.models.check``.
"""

from __future__ import annotations

from typing import Any

_OWN_ATTENTION = "its own attention code adds the mask to the scores, outside transformers' attention interface"
_ALIBI = "ALiBi: a position bias added to the attention mask outside the attention function"
# DeepSeek sparse attention (DSA) and its descendants: per branch the selection would be exact if the indexer's scores
# were masked with the tree mask, but transformers applies the mask there, in model code that tree_flash cannot reach.
_INDEXER = (
    "a sparse-attention indexer selects each query's top-k keys from scores it masks with the attention mask itself, "
    "outside the attention function (tree_flash holds the tree mask only inside attention)"
)
_OWN_CLASSES = (
    "its own eager/sdpa/flash attention classes (chosen by the attention name: tree_flash would pick its flash-attn "
    "class) apply the mask, outside transformers' attention interface"
)

# model_type -> (family, why).
REFUSED_FAMILIES: dict[str, tuple[str, str]] = {
    "bloom": ("Bloom", _ALIBI),
    "mpt": ("MPT", "ALiBi: a position bias added to the attention scores in its own attention code"),
    "xglm": ("XGLM", _OWN_ATTENTION),
    "big_bird": ("BigBird", _OWN_ATTENTION),
    "megatron-bert": ("Megatron-BERT", _OWN_ATTENTION),
    "rembert": ("RemBERT", _OWN_ATTENTION),
    "roformer": ("RoFormer", _OWN_ATTENTION),
    "mvp": ("MVP", _OWN_ATTENTION),
    "trocr": ("TrOCR", _OWN_ATTENTION),
    "gpt_neox_japanese": ("GPT-NeoX-Japanese", _OWN_ATTENTION),
    "doge": ("Doge", "dynamic mask attention: the layer computes its mask from the attention mask itself"),
    "hy_v4": ("HY-v4", "indexed attention: the layer selects its keys from the attention mask itself"),
    "deepseek_v32": ("DeepSeek V3.2", _INDEXER),
    "glm_moe_dsa": ("GLM-MoE-DSA", _INDEXER),
    "axk2": ("AXK2", _INDEXER),
    "dots3_note": ("dots3-note", _INDEXER),
    "qwen4_exp": (
        "Qwen 4-exp",
        "its QSA indexer selects compressed key blocks per query with the attention mask itself, outside the "
        "attention function",
    ),
    "deepseek_v4": (
        "DeepSeek V4",
        "its compressed attention appends pooled key blocks to the keys and their bias to the attention mask, "
        "outside the attention function",
    ),
    "falcon": ("Falcon", _OWN_CLASSES),
    "gpt_neo": ("GPT-Neo", _OWN_CLASSES),
}


def refused_family(config: Any) -> tuple[str, str] | None:
    """``(family, why)`` when hf_tree refuses the model of ``config`` (a transformers ``PretrainedConfig``) by
    name."""
    model_type = getattr(config, "model_type", "")
    # a causal LM built from a family's text sub-config is named "<family>_text" (qwen4_exp_text, dots3_note_text)
    return REFUSED_FAMILIES.get(model_type) or REFUSED_FAMILIES.get(model_type.removesuffix("_text"))


def refuse_family(config: Any, model_name: str) -> None:
    """``ValueError`` naming the family and why when ``refused_family(config)``; ``model_name`` is the class."""
    refused = refused_family(config)
    if refused is None:
        return
    family, why = refused
    raise ValueError(
        f"hf_tree refuses {family} models ({model_name}, model_type={config.model_type!r}) for tree training: {why}, "
        "so attn_implementation='tree_flash' cannot keep sibling branches apart (any forward with it fails). Train "
        "this model on flat sequences, with attn_implementation='sdpa' or 'eager', without hf_tree."
    )
