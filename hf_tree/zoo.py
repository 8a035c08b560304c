"""Model-zoo conformance: every causal-LM architecture of the installed transformers, built tiny, ends in one state.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``check_architecture`` builds the model from its
default config shrunk generically (``tiny_config``: hidden 32, 2 heads, one decoder layer of each kind in
``layer_types``, a small vocabulary, windows/chunks of 4 tokens so that they matter) in float64 (float32 where the
model cannot run float64), and checks

(a) training: ``tree_causal_lm_loss`` (with its first-use self-check) and every parameter gradient equal training
    on each branch alone with the model's own attention (``sdpa``, else ``eager``) and its own logits;
(b) dual mode: ``tree_flash`` without ``kv_end`` (generation, evaluation, rollouts) equals the model's own attention
    on an unpadded and a left-padded batch;
(c) MoE models: with the router load-balancing loss on (``output_router_logits``, as TRL's defaults turn it on), the
    tree's loss and gradients equal per-branch training plus the model's own router loss of the branches.

States: ``exact`` (a and b hold), ``refused`` (``tree_causal_lm_loss`` raised a ``ValueError`` before training;
dual mode is still checked), ``not buildable`` (with the reason), ``error`` (an exception that is not our
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
STATES = ("exact", "refused", "not buildable", "error", "MISMATCH")

# Size keys (whichever a config has) and their tiny values.
_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "dim"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads"), 2),
    **dict.fromkeys(("decoder_attention_heads",), 2),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "v_head_dim", "kv_lora_rank"), 16),
    **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim", "q_lora_rank"), 8),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "inner_dim"), 64),
    **dict.fromkeys(("decoder_ffn_dim", "encoder_ffn_dim", "dim_ff"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "n_group", "topk_group"), 1),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(("encoder_layers",), 1),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "linear_key_head_dim"), 8),
    **dict.fromkeys(("linear_value_head_dim", "mamba_head_dim", "linear_conv_kernel_dim"), 8),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "n_groups"), 2),
    **dict.fromkeys(("mamba_n_groups",), 1),
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


def _one_layer_of_each_kind(values: dict) -> None:
    """Keep, of the per-layer lists (``layer_types``, ``mlp_layer_types``, ...), the first layer of every kind of
    each list (at least two layers), and set the layer count to match."""
    lists = {k: v for k, v in values.items() if str(k).endswith("layer_types") and isinstance(v, list) and v}
    if not lists:
        return
    length = len(next(iter(lists.values())))
    lists = {k: v for k, v in lists.items() if len(v) == length}
    keep = sorted({v.index(kind) for v in lists.values() for kind in dict.fromkeys(v)})
    if len(keep) < 2 and length >= 2:
        keep = sorted(set(keep) | {0, 1})
    for key, kinds in lists.items():
        values[key] = [kinds[i] for i in keep]
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in values:
            values[key] = len(keep)


def shrink_config(values: dict, level: int = 0) -> dict:
    sizes = {**_SIZES, **_LEVELS[level]}
    for key, value in list(values.items()):
        if isinstance(value, dict):
            values[key] = shrink_config(dict(value), level)  # nested text/decoder configs
        elif level > 0 and key in _GEOMETRY:
            continue
        elif key in sizes and isinstance(value, int) and not isinstance(value, bool):
            values[key] = sizes[key]
    for key in ("sliding_window", "attention_chunk_size", "local_attention", "window_size"):
        if isinstance(values.get(key), int) and not isinstance(values.get(key), bool) and values[key] > WINDOW:
            values[key] = WINDOW
    _one_layer_of_each_kind(values)
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
    values = shrink_config(default.to_dict(), level) | copy.deepcopy(overrides)
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
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="tree_flash", dtype=dtype
        )
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


def _build_runnable(model_type: str, ids: list[int]) -> tuple[torch.nn.Module, torch.dtype]:
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
    model, dtype = _build_runnable(result.model_type, branches[0])
    result.model_class, result.dtype = type(model).__name__, str(dtype).replace("torch.", "")
    result.layer_types = _layer_types(model)
    tolerance = TOLERANCE[dtype]

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


def state_counts(results: Sequence[Any]) -> str:
    """The tables' last line: how many results ended in each of ``STATES``."""
    counts = {state: sum(r.state == state for r in results) for state in STATES}
    return ", ".join(f"{state}: {n}" for state, n in counts.items()) + f" (of {len(results)})"


def run_zoo(
    check: Callable[[str], Any],
    model_types: Sequence[str],
    table: Callable[[Sequence[Any]], str],
    json_path: str | None = None,
) -> int:
    """The zoo benchmarks' driver: ``check`` each model type (one thread; progress on stderr), print the markdown
    ``table`` of the results, write them as JSON to ``json_path`` if given. Returns the exit status: 1 if any
    architecture is a silent ``MISMATCH``, else 0."""
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
    results = []
    for model_type in model_types:
        result = check(model_type)
        print(f"{model_type}: {result.state} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
        results.append(result)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 1 if any(r.state == "MISMATCH" for r in results) else 0
