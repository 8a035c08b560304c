"""Model-zoo conformance: every causal-LM architecture of the installed transformers, built tiny, ends in one state.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``check_architecture`` builds the model from its
default config shrunk generically (``tiny_config``: hidden 32, 2 heads, one decoder layer of each kind in
``layer_types`` with every per-layer field following, a small vocabulary, windows/chunks of 4 tokens so that they
matter; ``FAMILY_OVERRIDES`` where a family ties fields the generic shrink cannot know) in float64 (float32 where the
model cannot run float64; judged at the float32 bar where ``FLOAT32_INTERNALS`` says it computes in float32), and
checks

(a) training: ``tree_causal_lm_loss`` (with its first-use self-check) and every parameter gradient equal training
    on each branch alone with the model's own attention (``sdpa``, else ``eager``) and its own logits;
(b) dual mode: ``tree_flash`` without ``kv_end`` (generation, evaluation, rollouts) equals the model's own attention
    on an unpadded and a left-padded batch;
(c) MoE models: with the router load-balancing loss on (``output_router_logits``, as TRL's defaults turn it on), the
    tree's loss and gradients equal per-branch training plus the model's own router loss of the branches.

States: ``exact`` (a and b hold), ``refused`` (``tree_causal_lm_loss`` raised a ``ValueError`` before training;
dual mode is still checked), ``unrunnable`` (transformers itself cannot run the type on token ids: ``UNRUNNABLE``
says why), ``not buildable`` (with the reason), ``error`` (an exception that is not our
``ValueError``) and ``MISMATCH`` (a silent difference: the bar is zero). Used by ``benchmarks/model_zoo.py`` and
``tests/test_model_zoo.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree.collator import TreeDataCollator
from hf_tree.loss import tree_causal_lm_loss, tree_losses
from hf_tree.models.introspection import own_attention, raised_by_hf_tree
from hf_tree.testing import FLOAT32_GRAD_FLOOR, grads_of, max_grad_error, per_branch_forest_loss, relative_error
from hf_tree.tree import Tree

VOCAB = 128
WINDOW = 4  # sliding windows / attention chunks, shorter than the test sequences
# Relative error accepted as exact: float64 models still keep some float32 internals (HF's RMSNorm upcasts to
# float32; see docs/ECOSYSTEM facts), ~1e-7 here; the silent failures this suite exists for are >= 1e-4.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
# Types that compute part of their forward in float32 even in a float64 model, judged at the float32 bar: the part,
# and why a leak still shows (a branch leak moves gradients by >= 1e-4).
FLOAT32_INTERNALS = {
    "longcat_flash": "its router computes its logits in float32 (router gradients ~2e-6 apart in float64)",
}
STATES = ("exact", "refused", "unrunnable", "not buildable", "error", "MISMATCH")

# Size keys (whichever a config has) and their tiny values.
_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "dim"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads"), 2),
    **dict.fromkeys(("num_attention_heads_per_layer",), 2),
    **dict.fromkeys(("decoder_attention_heads",), 2),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "v_head_dim", "kv_lora_rank"), 16),
    # MLA: query/key heads of qk_nope + qk_rope = 24 dims against 16-dim value heads, as in the released models
    **dict.fromkeys(("qk_nope_head_dim",), 16),
    **dict.fromkeys(("qk_rope_head_dim", "q_lora_rank"), 8),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "inner_dim"), 64),
    **dict.fromkeys(("decoder_ffn_dim", "encoder_ffn_dim", "dim_ff"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(("encoder_layers",), 1),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "linear_key_head_dim"), 8),
    **dict.fromkeys(("linear_value_head_dim", "mamba_head_dim", "linear_conv_kernel_dim"), 8),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "n_groups"), 2),
    **dict.fromkeys(("linear_head_dim",), 8),
    **dict.fromkeys(("linear_num_heads",), 2),
    **dict.fromkeys(("mamba_n_groups",), 1),
    # sparse-attention indexers (DeepSeek V3.2, GLM-DSA, dots3, AXK2): fewer selected keys than the branches have
    **dict.fromkeys(("index_n_heads",), 2),
    **dict.fromkeys(("index_head_dim",), 16),
    **dict.fromkeys(("index_topk",), WINDOW),
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


# Keys left at their defaults from shrink level 1 on: per-head and mixer geometry that some architectures tie to
# each other in ways a generic shrink cannot know (rotary splits, MLA ranks, Mamba heads).
_GEOMETRY = {
    "head_dim",
    "kv_channels",
    "attention_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "state_size",
    "ssm_state_size",
    "mamba_d_state",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "mamba_head_dim",
    "linear_conv_kernel_dim",
    "linear_head_dim",
    "linear_num_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "mamba_n_heads",
    "n_groups",
    "mamba_n_groups",
}
# Per level, overrides of ``_SIZES``: level 1 keeps the geometry and uses 4 query / 2 KV heads; level 2 also a
# wider hidden size.
_LEVELS = (
    {},
    {
        **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), 4),
        **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    },
    {
        **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), 4),
        **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
        **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "dim"), 64),
    },
)


_GEMMA4_TEXT = {
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "per_layer_config": {"1": {"head_dim": 32}},
}
_GEMMA4_ASSISTANT_TEXT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
# Per-family values applied after the generic shrink, where it cannot know a constraint of the family (each
# entry says which). Keyed by ``model_type``; applied to nested configs (``text_config``) of that type too.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # the default config leaves head_dim None, and the attention computes head_dim ** -0.5
    "ministral": {"head_dim": 16},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    # the default leaves num_key_value_heads None, and the attention divides by it
    "nemotron": {"num_key_value_heads": 1},
    # GPT-J / CodeGen: the rotary part of a head (rotary_dim, 64 by default) must fit the 16-dim tiny head
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    # the default leaves the expert counts None (the MoE block needs them)
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # dots3: its sliding-window layers' head_dim must equal qk_nope_head_dim + qk_rope_head_dim (MLA elsewhere)
    "dots3_note_text": {"head_dim": _SIZES["qk_nope_head_dim"] + _SIZES["qk_rope_head_dim"]},
    # Cohere Compass indexes rope_parameters by layer type, and the default has one flat entry
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # LFM2-MoE: the default has no layer_types and 2 dense layers first; one short-convolution layer, one
    # attention layer and a conv layer with experts
    "lfm2_moe": {
        "num_hidden_layers": 3,
        "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention", "conv"],
    },
    # LongCat-Flash: its zero (identity) experts and its experts' width are fields of their own
    "longcat_flash": {"zero_expert_num": 2, "expert_ffn_hidden_size": 32},
    # Gemma 3n: the last num_kv_shared_layers layers reuse the KV of the last earlier layer of their kind, so
    # two layers of each kind (sliding, full) with the last two shared; per-layer lists follow the 4 layers
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "intermediate_size": [64] * 4,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "laurel_rank": 8,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
    },
    # Gemma 4: per-layer input embeddings of vocab_size_per_layer_input x (layers * hidden_size_per_layer_input)
    # of the per-layer inputs; the full-attention layers (kept layer 1, per_layer_config) have heads twice as wide as
    # the sliding ones, as released (512 vs 256), which the generic shrink would make equal
    "gemma4_text": _GEMMA4_TEXT,
    "gemma4_unified_text": _GEMMA4_TEXT,
    # Qwen 4-exp's QSA indexer: every field set or none, indexer_kv_heads 1, the budget a multiple of the
    # compression ratio and shorter than the probe branches (so selection drops blocks); hyper-connections > 1
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "hc_count": 2,
        "hc_lowrank": 8,
    },
    # pure Mamba2: num_heads * head_dim = expand * hidden_size (2 * 32), chunks shorter than the branches
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "chunk_size": WINDOW},
    # Zamba2: the derived sizes of its __post_init__ (stored in the default, not recomputed from a dict):
    # mamba heads * head dim = mamba_expand * hidden, attention over the concatenated [hidden, embeddings]
    "zamba2": {
        "n_mamba_heads": 4,
        "mamba_headdim": 16,
        "attention_hidden_size": 64,
        "attention_head_dim": 32,
        "kv_channels": 16,
        "num_query_groups": 2,
        "chunk_size": WINDOW,
        "layers_block_type": ["linear_attention", "hybrid"],
        "hybrid_layer_ids": [1],
    },
    # Zamba ties every hybrid layer's shared transformer to the first one's, so it needs two hybrid layers
    # (its attention runs over [hidden, embeddings]: 2 * hidden wide)
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "attention_hidden_size": 64,
        "attention_head_dim": 32,
    },
    # DBRX reads rope_theta from its attention sub-config, whose default has none, and clamps q/k/v with clip_qkv,
    # which fails when None (the default); the released model clips at 8
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # dots3 (image-text-audio): each encoder's adapter input width is its hidden size, its output width the text's
    "dots3_note_vision_encoder": {"adapter_in_dim": 32, "adapter_out_dim": 32},
    "dots3_note_audio_encoder": {"adapter_input_size": 32, "adapter_out_dim": 32},
    # Gemma 4 assistants (draft models): no per-layer inputs, every layer reads the target model's shared KV
    "gemma4_assistant": {"text_config": {"model_type": "gemma4_text", **_GEMMA4_ASSISTANT_TEXT}},
    "gemma4_unified_assistant": {"text_config": {"model_type": "gemma4_text", **_GEMMA4_ASSISTANT_TEXT}},
    # MusicGen's decoder reads a (batch * num_codebooks, length) input; a packed tree row is one stream
    "musicgen_decoder": {"num_codebooks": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1},
    # XLNet: d_head = d_model // n_head
    "xlnet": {"d_head": 16},
    # ZAYA supports one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # X-MOD routes through per-language adapters and needs a language for plain input_ids
    "xmod": {"default_language": "en_XX"},
    # xLSTM: its embedding width is a separate field from hidden_size
    "xlstm": {"embedding_dim": 32, "chunk_size": WINDOW},
    # BLT: the byte encoder/decoder read the global transformer's width from their own fields
    # (and its hash n-gram embeddings have a vocabulary of their own, 500002 by default)
    "blt": {"encoder_hash_byte_group_vocab": 64},
    "blt_local_encoder": {"hidden_size_global": 32},
    "blt_local_decoder": {"hidden_size_global": 32},
    "blt_global_transformer": {"encoder_cross_output_size": 32},
    # Reformer: the axial position embedding widths sum to hidden_size, their shape covers the positions
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 8], "attention_head_size": 16},
    # Dory: n_input_layers + n_recurrent_layers + n_output_layers = num_hidden_layers (the middle one looped)
    "dory": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
}


# Types whose causal-LM class is built from one sub-config of the type's composite config (MusicGen's decoder; the
# composite config itself lacks the decoder's fields): the key of that sub-config.
CAUSAL_LM_SUBCONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def _apply_family_overrides(values: dict, model_type: str, level: int) -> None:
    """``FAMILY_OVERRIDES`` of ``model_type``, and of each nested config's own ``model_type``, in place. An override
    of a sub-config updates only the fields it names; one naming a ``model_type`` where the default has no
    sub-config starts from that type's tiny default."""
    for value in values.values():
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            _apply_family_overrides(value, value["model_type"], level)
    for key, value in FAMILY_OVERRIDES.get(model_type, {}).items():
        value = copy.deepcopy(value)
        if isinstance(value, dict) and not isinstance(values.get(key), dict) and "model_type" in value:
            sub_type = value["model_type"]
            values[key] = shrink_config(transformers.AutoConfig.for_model(sub_type).to_dict(), level)
            _apply_family_overrides(values[key], sub_type, level)
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key].update(value)  # a sub-config: only the fields named
        else:
            values[key] = value


def _length_switch(model_type: str, rope_type: str, switch: int) -> tuple[str, dict]:
    """A ``ZOO_VARIANTS`` entry: ``model_type`` with a length-dependent rope switching at ``switch`` tokens
    (8 rotary frequencies: the tiny head dimension is 16)."""
    if rope_type == "longrope":
        factors = dict(short_factor=[1.0 + i / 4 for i in range(8)], long_factor=[2.0 + 2 * i for i in range(8)])
        rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=switch, **factors)
        return model_type, dict(rope_parameters=rope, original_max_position_embeddings=switch)
    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
    return model_type, dict(rope_parameters=rope, max_position_embeddings=switch)


# Configs beyond the defaults: every length switch of the installed transformers' rope types
# (hf_tree.models.length_rope), crossed by the probe branches (8-13 tokens; refused) and not (exact).
# ``check_architecture`` takes these names.
ZOO_VARIANTS = {
    "phi3 (longrope, switch 10)": _length_switch("phi3", "longrope", 10),
    "phi3 (longrope, switch 64)": _length_switch("phi3", "longrope", 64),
    "llama (dynamic, switch 10)": _length_switch("llama", "dynamic", 10),
    "llama (dynamic, switch 64)": _length_switch("llama", "dynamic", 64),
}


# Types transformers itself cannot run as a causal LM on token ids, whatever the config (state "unrunnable"; the
# table gives this reason and transformers' error): why no tiny config exists.
UNRUNNABLE = {
    "gemma4_assistant": "transformers' own default config fails its validation (the error below); a valid one is a "
    "draft model for speculative decoding, whose forward requires the target model's inputs_embeds and "
    "shared_kv_states, not token ids",
    "gemma4_unified_assistant": "a draft model for speculative decoding: its forward requires the target model's "
    "inputs_embeds and shared_kv_states, not token ids",
    "git": "GIT picks its attention class from a fixed table keyed by the attention implementation's name "
    "(GIT_SELF_ATTENTION_CLASSES), so no registered attention function (tree_flash included) can be loaded",
    "gemma3n": "its vision tower is a timm model, and timm (with torchvision) is not a dependency of hf_tree; the "
    "text model (gemma3n_text) is the row that judges Gemma 3n",
}


class RefusedOnLoad(Exception):
    """hf_tree refuses any forward of the model under ``tree_flash`` (the message says why)."""


class NotBuildable(Exception):
    """The architecture cannot be built or run tiny from its default config (the reason is the message)."""


@dataclass
class ZooResult:
    """One architecture's state and measurements (relative errors; ``None`` where not measured)."""

    model_type: str
    model_class: str = ""
    state: str = "not buildable"
    dtype: str = ""
    detail: str = ""
    loss_error: float | None = None
    grad_error: float | None = None
    dual_error: float | None = None
    router: str = ""  # MoE models: the router load-balancing loss on trees (a state of STATES; "" for none)
    router_error: float | None = None
    seconds: float = 0.0
    layer_types: list[str] = field(default_factory=list)


# Per-layer kind lists: ``layer_types`` and its relatives (``mlp_layer_types``, ``indexer_types``), Zamba's
# ``layers_block_type`` and GPT-Neo's ``attention_layers``.
_KIND_LIST_SUFFIXES = ("layer_types", "indexer_types", "layers_block_type", "attention_layers")


def _one_layer_of_each_kind(values: dict) -> None:
    """Keep, of the per-layer kind lists (``_KIND_LIST_SUFFIXES``), the first layer of every kind of each list (at
    least two layers) and set the layer count to match; every other list of one entry per layer (Gemma 3n's
    ``intermediate_size``, Laguna's ``num_attention_heads_per_layer``) keeps the same layers, and
    ``per_layer_config`` (keyed by layer index: Gemma 4, dots3) is renumbered to them."""
    lists = {k: v for k, v in values.items() if str(k).endswith(_KIND_LIST_SUFFIXES) and isinstance(v, list) and v}
    if not lists:
        return
    length = len(next(iter(lists.values())))
    lists = {k: v for k, v in lists.items() if len(v) == length}
    keep = sorted({v.index(kind) for v in lists.values() for kind in dict.fromkeys(v)})
    if len(keep) < 2 and length >= 2:
        keep = sorted(set(keep) | {0, 1})
    for key, value in values.items():
        if isinstance(value, list) and len(value) == length:
            values[key] = [value[i] for i in keep]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict):
        values["per_layer_config"] = {str(keep.index(int(k))): v for k, v in per_layer.items() if int(k) in keep}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in values:
            values[key] = len(keep)


def _tie_mla_dims(values: dict) -> None:
    """Multi-head latent attention (DeepSeek V2/V3 and the families built on them): the stored query/key head
    dimension is ``qk_nope_head_dim + qk_rope_head_dim``, ``head_dim`` (the rotary's) is ``qk_rope_head_dim``, and
    every query head has its own key head (the eager path repeats keys by ``heads // num_key_value_heads``)."""
    nope, rope = values.get("qk_nope_head_dim"), values.get("qk_rope_head_dim")
    if isinstance(values.get("kv_lora_rank"), int) and isinstance(values.get("num_attention_heads"), int):
        if isinstance(values.get("num_key_value_heads"), int):
            values["num_key_value_heads"] = values["num_attention_heads"]
    if isinstance(nope, int) and isinstance(rope, int):
        if "qk_head_dim" in values:
            values["qk_head_dim"] = nope + rope
        if isinstance(values.get("head_dim"), int) and isinstance(values.get("kv_lora_rank"), int):
            values["head_dim"] = rope


def shrink_config(values: dict, level: int = 0) -> dict:
    sizes = {**_SIZES, **_LEVELS[level]}
    for key, value in list(values.items()):
        if isinstance(value, dict):
            values[key] = shrink_config(dict(value), level)  # nested text/decoder configs
        elif level > 0 and key in _GEOMETRY:
            continue
        elif key in sizes and isinstance(value, int) and not isinstance(value, bool):
            values[key] = sizes[key]
        elif key in sizes and isinstance(value, list) and value and all(type(v) is int for v in value):
            values[key] = [sizes[key]] * len(value)  # one size per layer
    for key in (
        "sliding_window",
        "attention_chunk_size",
        "local_attention",
        "window_size",
        "local_attention_window_len",
    ):
        if isinstance(values.get(key), int) and not isinstance(values.get(key), bool) and values[key] > WINDOW:
            values[key] = WINDOW
    _one_layer_of_each_kind(values)
    _tie_mla_dims(values)
    for head_dim, heads in (("mamba_d_head", "mamba_n_heads"), ("mamba_head_dim", "mamba_n_heads")):
        # Mamba: heads * head dim = expand * hidden size
        if level == 0 and isinstance(values.get(head_dim), int) and isinstance(values.get(heads), int):
            expand = values.get("mamba_expand", values.get("expand", 2))
            values[head_dim] = max(1, int(expand * sizes["hidden_size"]) // values[heads])
    for key in _TOKEN_IDS:
        ids = values.get(key)
        if isinstance(ids, int) and ids >= VOCAB:
            values[key] = VOCAB - 1
        elif isinstance(ids, list):
            values[key] = [i if i < VOCAB else VOCAB - 1 for i in ids]
    return values


def tiny_config(model_type: str, level: int = 0) -> transformers.PretrainedConfig:
    """``model_type``'s default config with every size shrunk (``_SIZES``; milder at higher ``level``, see
    ``_LEVELS``) and rebuilt, so derived fields follow. A name of ``ZOO_VARIANTS`` applies its overrides last."""
    model_type, overrides = ZOO_VARIANTS.get(model_type, (model_type, {}))
    default = transformers.AutoConfig.for_model(model_type)
    values = shrink_config(default.to_dict(), level)
    _apply_family_overrides(values, model_type, level)
    values |= copy.deepcopy(overrides)
    if model_type in CAUSAL_LM_SUBCONFIG:
        values = values[CAUSAL_LM_SUBCONFIG[model_type]]
        model_type = values["model_type"]
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        values.pop(key, None)
    values.update(attention_dropout=0.0, use_cache=False, tie_word_embeddings=values.get("tie_word_embeddings", True))
    if "is_decoder" in values:
        values["is_decoder"] = True  # encoder architectures registered as causal LMs need it to be causal
    return transformers.AutoConfig.for_model(model_type, **values)


def build_tiny(model_type: str, dtype: torch.dtype, level: int = 0) -> torch.nn.Module:
    """The tiny causal LM on ``tree_flash`` (deterministic init), in eval mode (no dropout); ``RefusedOnLoad`` for a
    family hf_tree refuses by name (``hf_tree.attention.families``)."""
    try:
        config = tiny_config(model_type, level)
    except Exception as error:  # noqa: BLE001 - any failure means: cannot be built tiny
        raise NotBuildable(f"config: {type(error).__name__}: {first_line(error)}") from error
    torch.manual_seed(0)
    base_type = ZOO_VARIANTS.get(model_type, (model_type,))[0]
    build = (
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[base_type])._from_config
        if base_type in CAUSAL_LM_SUBCONFIG  # the sub-config's type is not in the causal-LM mapping
        else transformers.AutoModelForCausalLM.from_config
    )
    try:
        model = build(copy.deepcopy(config), attn_implementation="tree_flash", dtype=dtype)
    except Exception as error:  # noqa: BLE001
        if isinstance(error, ValueError) and raised_by_hf_tree(error):  # a family refused by name on load
            raise RefusedOnLoad(f"load: {first_line(error, 400)}") from error
        raise NotBuildable(f"build: {type(error).__name__}: {first_line(error)}") from error
    return model.eval()


def first_line(error: BaseException, limit: int = 160) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe_branches() -> tuple[list[list[int]], list[list[int]]]:
    """A tree of four branches (shared prompt, a sub-branch, a prefix branch) longer than ``WINDOW``, and masks."""
    prompt = [5, 17, 33, 9, 61, 12]
    branches = [
        prompt + [40, 41, 42, 43, 44, 45],
        prompt + [40, 41, 90, 91, 92],
        prompt + [70, 71, 72, 73, 74, 75, 76],
        prompt + [40, 41],
    ]
    masks = [[0] * len(prompt) + [1] * (len(b) - len(prompt)) for b in branches]
    masks[2][2] = 1  # a trained prompt token in one branch only
    return branches, masks


def dual_mode_error(model: torch.nn.Module) -> float:
    """Relative error of ``tree_flash`` without ``kv_end`` against the model's own attention (real tokens only), on
    one unpadded row and a left-padded batch (skipped where the model's own attention cannot run padded batches)."""
    ids = torch.tensor(
        [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 0, 0, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    )
    attention = torch.ones_like(ids)
    attention[1, :3] = 0
    results = []
    with torch.no_grad():
        for kwargs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": attention}):
            try:
                with own_attention(model):
                    own = model(**kwargs, use_cache=False).logits
            except Exception:  # noqa: BLE001 - the model's own attention cannot run this input: no oracle for it
                if "attention_mask" in kwargs:
                    continue
                raise
            tree = model(**kwargs, use_cache=False).logits
            real = kwargs.get("attention_mask", torch.ones_like(kwargs["input_ids"])).bool()
            results.append(float((tree[real] - own[real]).abs().max() / own[real].abs().max().clamp_min(1e-300)))
    return max(results)


@contextmanager
def seconds_limit(seconds: int) -> Iterator[None]:
    def raise_timeout(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, raise_timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _layer_types(model: torch.nn.Module) -> list[str]:
    kinds = getattr(model.config.get_text_config(), "layer_types", None)
    return list(dict.fromkeys(kinds)) if isinstance(kinds, list) else []


def check_architecture(model_type: str, time_limit: int = 300) -> ZooResult:
    """Build ``model_type`` tiny and put it in exactly one state (see the module docstring)."""
    result = ZooResult(model_type)
    return classified(result, lambda: _check(result), time_limit)


def classified(result: Any, check: Callable[[], None], time_limit: int) -> Any:
    """Run ``check`` (which fills ``result``) within ``time_limit`` seconds; what it raises decides the state:
    ``NotBuildable`` and time-outs are "not buildable", ``RefusedOnLoad`` "refused", anything else "error" (reported,
    never hidden). Sets ``result.seconds`` and returns ``result``."""
    start = time.perf_counter()
    try:
        with seconds_limit(time_limit):
            check()
    except NotBuildable as error:
        result.state, result.detail = "not buildable", str(error)
    except RefusedOnLoad as error:
        result.state, result.detail = "refused", str(error)
    except TimeoutError as error:
        result.state, result.detail = "not buildable", f"timeout: {error}"
    except Exception as error:  # noqa: BLE001 - anything else is reported, never hidden
        result.state = "error"
        result.detail = (
            f"{type(error).__name__}: {first_line(error)} @ {traceback.extract_tb(error.__traceback__)[-1].name}"
        )
    result.seconds = time.perf_counter() - start
    return result


def build_runnable(model_type: str, ids: list[int]) -> tuple[torch.nn.Module, torch.dtype]:
    """The smallest shrink level and the widest dtype (float64, else float32) at which the tiny model builds and
    runs its own forward (it must, to serve as its own oracle); ``NotBuildable`` with the first reason otherwise."""
    first_error: NotBuildable | None = None
    for level in range(len(_LEVELS)):
        for dtype in (torch.float64, torch.float32):
            try:
                model = build_tiny(model_type, dtype, level)
                with torch.no_grad(), own_attention(model):
                    model(input_ids=torch.tensor([ids]), use_cache=False)
                return model, dtype
            except NotBuildable as error:
                first_error = first_error or error
                break  # the config or build fails at this level whatever the dtype
            except Exception as error:  # noqa: BLE001
                if raised_by_hf_tree(error):  # e.g. a model that cannot switch away from tree_flash
                    raise RefusedOnLoad(f"any forward: {type(error).__name__}: {first_line(error, 400)}") from error
                reason = NotBuildable(f"own forward: {type(error).__name__}: {first_line(error)}")
                first_error = first_error or reason
    raise first_error


def _check(result: ZooResult) -> None:
    branches, masks = probe_branches()
    try:
        model, dtype = build_runnable(result.model_type, branches[0])
    except NotBuildable as error:
        if result.model_type not in UNRUNNABLE:
            raise
        result.state, result.detail = "unrunnable", f"{UNRUNNABLE[result.model_type]} (transformers: {error})"
        return
    result.model_class, result.dtype = type(model).__name__, str(dtype).replace("torch.", "")
    result.layer_types = _layer_types(model)
    tolerance = TOLERANCE[torch.float32 if result.model_type in FLOAT32_INTERNALS else dtype]

    train_state, train_detail = _check_training(result, model, branches, masks, tolerance)
    router_detail = _check_router_loss(result, model, branches, masks, tolerance) if train_state == "exact" else ""
    if result.router == "MISMATCH":
        train_state = "MISMATCH"
    dual_state, dual_detail = "exact", ""
    try:
        result.dual_error = dual_mode_error(model)
        if result.dual_error > tolerance:
            dual_state, dual_detail = "MISMATCH", "dual mode differs from the model's own attention"
    except Exception as error:  # noqa: BLE001 - classified, never hidden
        dual_state = "refused" if raised_by_hf_tree(error) else "error"
        dual_detail = f"dual mode: {type(error).__name__}: {first_line(error, 300)}"
    for state in ("MISMATCH", "error", "refused", "exact"):
        if state in (train_state, dual_state):
            result.state = state
            break
    result.detail = "; ".join(d for d in (train_detail, router_detail, dual_detail) if d)


def _check_training(result: ZooResult, model, branches, masks, tolerance: float) -> tuple[str, str]:
    """Tree loss and gradients against per-branch training; ``(state, detail)``."""
    batch = TreeDataCollator(max_packed_tokens=64)([Tree.from_sequences(branches, masks).to_dict()])
    try:
        loss = tree_causal_lm_loss(model, batch, self_check=True)  # the default, whatever the environment says
    except Exception as error:  # noqa: BLE001
        if isinstance(error, ValueError) and raised_by_hf_tree(error):
            return "refused", f"training: {first_line(error, 400)}"
        return "error", f"training: {type(error).__name__}: {first_line(error, 300)}"
    loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    reference = per_branch_forest_loss(model, [(branches, masks)])
    reference.backward()
    reference_grads = grads_of(model)
    model.zero_grad()
    result.loss_error = relative_error(loss, reference)
    result.grad_error = max_grad_error(tree_grads, reference_grads, floor=FLOAT32_GRAD_FLOOR)
    if result.loss_error <= tolerance and result.grad_error <= tolerance:
        return "exact", ""
    return "MISMATCH", "tree training differs from per-branch training"


ROUTER_COEF = 0.5  # large, so that a wrongly weighted router loss shows in the loss and every gradient
ROUTER_SCALE = 40.0


def _peak_routers(model: torch.nn.Module) -> None:
    """Scale the routers' ``[num_experts, hidden]`` weights by ``ROUTER_SCALE``: a random tiny router is nearly
    uniform, so any weighting of the tokens gives about the same load-balancing loss (5e-5 apart); peaked,
    token-dependent routing makes a wrong weighting visible (experts' own weights are 3-D or named ``*_proj``)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            is_router = ("gate" in name or "router" in name) and "proj" not in name and parameter.ndim == 2
            if is_router and parameter.shape[0] == _SIZES["num_experts"]:
                parameter.mul_(ROUTER_SCALE)


def _check_router_loss(result: ZooResult, model, branches, masks, tolerance: float) -> str:
    """MoE models (a config with ``output_router_logits``): turn the router load-balancing loss on (as TRL's
    defaults do) and compare the tree's ``token + coef * router`` loss and gradients with per-branch training plus
    ``coef`` times the model's own router loss of the branches as one right-padded batch. Sets ``result.router``
    (``"exact"``, ``"refused"``, ``"MISMATCH"`` or ``"error"``) and returns the detail."""
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        return ""
    config.output_router_logits, config.router_aux_loss_coef = True, ROUTER_COEF
    _peak_routers(model)
    try:
        length = max(map(len, branches))
        ids = torch.tensor([list(b) + [0] * (length - len(b)) for b in branches])
        attention_mask = torch.tensor([[1] * len(b) + [0] * (length - len(b)) for b in branches])
        try:  # the oracle first: the model's own router loss of the branches as one right-padded batch
            with own_attention(model):
                padded_router = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).aux_loss
        except Exception as error:  # noqa: BLE001 - the model itself cannot compute it in this tiny config
            result.router = "not buildable"
            return f"router loss: the model's own forward fails: {type(error).__name__}: {first_line(error)}"
        batch = TreeDataCollator(max_packed_tokens=64)([Tree.from_sequences(branches, masks).to_dict()])
        try:
            losses = tree_losses(model, batch, self_check=False)  # the model passed the self-check above
        except ValueError as error:
            if not raised_by_hf_tree(error):
                raise
            result.router = "refused"
            return f"router loss: {first_line(error, 300)}"
        losses.model_loss().backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        with own_attention(model):  # the same forward again, now with the graph of the per-branch loss
            padded_router = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).aux_loss
        reference = per_branch_forest_loss(model, [(branches, masks)]) + ROUTER_COEF * padded_router
        reference.backward()
        reference_grads = grads_of(model)
        model.zero_grad()
    except Exception as error:  # noqa: BLE001 - classified, never hidden
        result.router = "error"
        return f"router loss: {type(error).__name__}: {first_line(error, 300)}"
    finally:
        config.output_router_logits = False
    result.router_error = max(
        relative_error(losses.model_loss(), reference),
        max_grad_error(tree_grads, reference_grads, floor=FLOAT32_GRAD_FLOOR),
    )
    result.router = "exact" if result.router_error <= tolerance else "MISMATCH"
    return "" if result.router == "exact" else "router loss differs from per-branch training"


def zoo_variants() -> list[str]:
    """The ``ZOO_VARIANTS`` names (configs beyond the defaults, checked like model types)."""
    return list(ZOO_VARIANTS)


def zoo_model_types() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown_table(results: Sequence[ZooResult]) -> str:
    """The docs table: one row per architecture, then the count per state."""

    def router_cell(r: ZooResult) -> str:
        return f"{r.router} ({error_cell(r.router_error)})" if r.router_error is not None else r.router

    lines = [
        "| model_type | class | state | dtype | loss err | grad err | dual-mode err | router loss | layer kinds "
        "| detail |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r.model_type} | {r.model_class} | {r.state} | {r.dtype} | {error_cell(r.loss_error)} | "
            f"{error_cell(r.grad_error)} | {error_cell(r.dual_error)} | {router_cell(r)} | "
            f"{', '.join(r.layer_types)} | {detail} |"
        )
    return "\n".join(lines + ["", state_counts(results)])


def error_cell(value: float | None) -> str:
    """A relative error as a table cell (empty where not measured)."""
    return "" if value is None else f"{value:.1e}"


def state_counts(results: Sequence[Any], states: Sequence[str] = STATES) -> str:
    """The tables' last line: how many results ended in each of ``states``."""
    counts = {state: sum(r.state == state for r in results) for state in states}
    return ", ".join(f"{state}: {n}" for state, n in counts.items()) + f" (of {len(results)})"


def run_zoo(
    check: Callable[[str], Any],
    model_types: Sequence[str],
    table: Callable[[Sequence[Any]], str],
    json_path: str | None = None,
    on_report: Callable[[str, Sequence[Any]], None] | None = None,
) -> int:
    """The zoo benchmarks' driver: ``check`` each model type (one thread; progress on stderr), print the markdown
    ``table`` of the results (after a line naming the versions), write them as JSON to ``json_path`` if given and
    pass the printed report and the results to ``on_report``. Returns the exit status: 1 if any architecture is a
    silent ``MISMATCH``, else 0."""
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
    results = []
    for model_type in model_types:
        result = check(model_type)
        print(f"{model_type}: {result.state} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
        results.append(result)
    report = f"transformers {transformers.__version__}, torch {torch.__version__}\n\n{table(results)}"
    print(report)
    if on_report:
        on_report(report, results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 1 if any(r.state == "MISMATCH" for r in results) else 0
