"""The oracle of hf_tree's exactness claims, in one place: tiny models built from configs, the per-branch reference
loss and gradients, and the error measures. Used by the tests (``tests/helpers.py``), the model zoo
(``hf_tree.zoo``, ``hf_tree.vision.zoo``) and the benchmarks.

The oracle for anything tree-shaped: run the same model on each branch as an ordinary sequence with the model's own
attention (``sdpa``, or ``eager`` where the model refuses ``sdpa``: ``own_attention_name``), standard shifted
cross-entropy in float64, and combine with the same normalization. Exactness is judged in float64 with
``relative_error`` and ``max_grad_error``; ``float64_norms`` keeps HF's RMSNorm in float64 so that 1e-9 holds.

Nothing here is imported by hf_tree's training code; importing this module builds no model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree.models.introspection import causal_lm_of, own_attention, own_attention_name

__all__ = [
    "EXACT_GRAD_FLOOR",
    "FLOAT32_FLOOR",
    "FLOAT32_GRAD_FLOOR",
    "HYBRIDS",
    "MOE_SETTINGS",
    "SLOW_HYBRIDS",
    "TINY",
    "VOCAB",
    "float64_kimi_linear",
    "float64_norms",
    "float64_qwen3_5_norms",
    "grads_of",
    "hybrid_model",
    "max_grad_error",
    "own_attention_name",
    "per_branch_forest_loss",
    "per_branch_loss",
    "relative_error",
    "replaced",
    "tiny_config",
    "tiny_model",
]

# ------------------------------------------------------------------------------------------ tiny models
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
VOCAB = TINY["vocab_size"]  # token ids of the tiny-model workloads (tests/workloads.py)


# Mixture-of-experts families (4 experts, top-2, float64-capable eager experts); gpt-oss also has sinks in every
# layer and a small window on half of them, Qwen3.5-MoE a GatedDeltaNet layer before its attention layer.
MOE_SETTINGS = {
    "mixtral": dict(num_local_experts=4),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8),
    "olmoe": dict(num_experts=4),
    "gpt_oss": dict(num_local_experts=4, sliding_window=4, head_dim=8),
    "qwen3_5_moe_text": dict(
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
}


def tiny_config(family: str = "llama", **overrides) -> transformers.PretrainedConfig:
    """A tiny random config of a decoder family (GQA: 4 query heads, 2 KV heads; ``MOE_SETTINGS`` for MoE ones)."""
    kwargs = dict(TINY, **overrides)
    if family == "qwen3":
        kwargs.setdefault("head_dim", 8)
    if family in MOE_SETTINGS:
        kwargs = dict(MOE_SETTINGS[family], num_experts_per_tok=2, experts_implementation="eager") | kwargs
    return transformers.AutoConfig.for_model(family, **kwargs)


def tiny_model(
    family: str = "llama", dtype: torch.dtype = torch.float64, attn: str = "tree_flash", seed: int = 0, **overrides
) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype)


@contextlib.contextmanager
def float64_norms() -> Iterator[None]:
    """HF's RMSNorm upcasts to float32 even in a float64 model, which rounds a shared token's gradient
    differently in a tree than per branch (~1e-7). Keep float64 in both models for 1e-9 tests (Gemma 3's too)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    def forward(self, hidden_states):
        compute = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        h = hidden_states.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)

    classes = (
        LlamaRMSNorm,
        MistralRMSNorm,
        Qwen2RMSNorm,
        Qwen3RMSNorm,
        GptOssRMSNorm,
        Qwen2VLRMSNorm,
        Qwen2_5_VLRMSNorm,
        Qwen3VLTextRMSNorm,
    )

    def gemma3_forward(self, x):  # Gemma 3 scales by (1 + weight), in float32 upstream
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(compute))).type_as(x)

    with replaced(classes, "forward", forward), replaced((Gemma3RMSNorm,), "forward", gemma3_forward):
        yield


@contextlib.contextmanager
def float64_family_norms() -> Iterator[None]:
    """``float64_norms`` for DeepSeek V2/V3's RMSNorms too (the same math as Llama's)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with float64_norms(), replaced((DeepseekV2RMSNorm, DeepseekV3RMSNorm), "forward", LlamaRMSNorm.forward):
        yield


@contextlib.contextmanager
def float64_qwen3_5_norms() -> Iterator[None]:
    """``float64_norms`` for Qwen3.5's RMSNorm (``1 + weight``) and its GatedDeltaNet's gated RMSNorm, which compute
    in float32 even in a float64 model (their float32 inputs are the same math in the same order)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    def norm(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return (self._norm(h) * (1.0 + self.weight.to(h.dtype))).type_as(x)

    def gated(self, hidden_states, gate):
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        h = hidden_states.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(hidden_states.dtype)
        return (h * F.silu(gate.to(compute))).to(hidden_states.dtype)

    with replaced([Qwen3_5RMSNorm], "forward", norm), replaced([Qwen3_5RMSNormGated], "forward", gated):
        yield


class _Float64Torch:
    """``torch`` with ``torch.float32`` read as ``torch.float64`` (see ``in_float64``)."""

    def __getattr__(self, name: str) -> object:
        return torch.float64 if name == "float32" else getattr(torch, name)


def in_float64(function: Callable) -> Callable:
    """``function``'s own code (unwrapped from its decorators) with every ``torch.float32`` read as ``torch.float64``:
    the models' upcasts to float32 then keep a float64 model in float64, and nothing else changes."""
    function = inspect.unwrap(function)
    globals_ = {**function.__globals__, "torch": _Float64Torch()}
    copy_ = types.FunctionType(
        function.__code__, globals_, function.__name__, function.__defaults__, function.__closure__
    )
    copy_.__kwdefaults__ = function.__kwdefaults__
    return copy_


@contextlib.contextmanager
def float64_kimi_linear() -> Iterator[None]:
    """Kimi Linear in float64 throughout, for a float64 model (``model.double()``: its ``dt_bias`` and router weight
    are kept in float32 on load): its RMSNorms, gated RMSNorm and MoE router run their own code with float32 read as
    float64 (``in_float64``), its forget gate (which upcasts with ``.float()``) the same math in float64, and a
    sequence without ``kv_end`` (the per-branch oracle) runs its delta attention through the model's own recurrence
    (``recurrent_kimi_delta_attention``, its decoding path, token by token over the whole branch) in float64: its
    chunked torch path rounds its decay mask to float32 (``.float()``), ~1e-8 off in float64. Tree batches still run
    the tree-aware delta rule (``hf_tree.models.mixers``)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from hf_tree.models.mixers.install import TREE_OPS, is_tree_dispatch, tree_dispatch

    def forget_gate(self, hidden_states):
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        forget = self.f_b_proj(self.f_a_proj(hidden_states)).to(compute) + self.dt_bias.to(compute).view(1, 1, -1)
        g = forget.view(*hidden_states.shape[:2], -1, self.head_dim)
        return -self.A_log.to(compute).exp() * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))

    name = "chunk_kimi_delta_attention"
    recurrence = kimi.recurrent_kimi_delta_attention
    own = recurrence.__hf_tree_original__ if is_tree_dispatch(recurrence) else recurrence
    classes = (kimi.KimiLinearRMSNorm, kimi.KimiLinearRMSNormGated, kimi.KimiLinearTopkRouter)
    with contextlib.ExitStack() as stack:
        for cls in classes:
            stack.enter_context(replaced([cls], "forward", in_float64(cls.forward)))
        stack.enter_context(replaced([kimi.KimiLinearForgetGate], "forward", forget_gate))
        stack.enter_context(replaced([kimi], name, tree_dispatch(in_float64(own), TREE_OPS[name])))
        yield


@contextlib.contextmanager
def replaced(owners: Sequence[object], name: str, value: object) -> Iterator[None]:
    """Set ``owner.<name> = value`` on every owner (classes or modules) for the block, then restore the originals."""
    originals = [getattr(owner, name) for owner in owners]
    for owner in owners:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, original in zip(owners, originals):
            setattr(owner, name, original)


# ------------------------------------------------------------------------------------------ hybrid models
# Their torch mixers and norms compute in float32 inside even in a float64 model: see FLOAT32_FLOOR and
# FLOAT32_GRAD_FLOOR below.
HYBRIDS = {
    "qwen3_next": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "qwen3_5_text": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "lfm2": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
    ),
    "nemotron_h": dict(
        hidden_size=32,
        intermediate_size=48,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        chunk_size=4,
        conv_kernel=4,
    ),
    "bamba": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=4,
        mamba_d_conv=4,
    ),
}


# More hybrids with the same mixers (slow: ~10 s each on a shared CPU).
SLOW_HYBRIDS = {
    "qwen3_5_moe_text": dict(
        HYBRIDS["qwen3_5_text"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "lfm2_moe": dict(
        HYBRIDS["lfm2"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1
    ),
    "falcon_h1": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=4,
        mamba_d_conv=4,
    ),
    "granitemoehybrid": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=4,
        mamba_d_conv=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=16,
    ),
    "zamba2": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layers_block_type=["mamba", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_head_dim=8,
        n_mamba_heads=4,
        mamba_ngroups=2,
        mamba_d_state=8,
        chunk_size=4,
    ),
    "olmo_hybrid": dict(
        pad_token_id=0,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    ),
    "lfm3": dict(
        pad_token_id=0,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        conv_L_cache=3,
    ),
    # Kimi delta attention (a gated delta rule with a decay per key channel, and its conv), MLA attention, MoE
    "kimi_linear": dict(
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=16,
        num_expert_group=1,
        topk_group=1,
    ),
    "mamba2": dict(
        hidden_size=16,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=8,
        expand=2,
        n_groups=2,
        state_size=8,
        chunk_size=4,
        conv_kernel=4,
    ),
}


def hybrid_model(family: str, attn: str = "tree_flash", **overrides) -> torch.nn.Module:
    """The tiny float64 hybrid of ``family`` (``HYBRIDS`` or ``SLOW_HYBRIDS``; ``overrides`` change its config), seeded,
    with eager experts."""
    torch.manual_seed(0)
    settings = {**{**HYBRIDS, **SLOW_HYBRIDS}[family], **overrides}
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, **settings)
    return AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attn, dtype=torch.float64, experts_implementation="eager"
    )  # grouped_mm experts refuse float64


# ------------------------------------------------------------------------------------------ the oracle
def per_branch_loss(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]] | None = None,
    normalization: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of weighted CE, divisor)`` running each branch alone through ``model`` (a causal LM, wrappers allowed)
    with its own attention (``own_attention_name``) and its own logits, CE in float64.

    ``loss_masks[b][k] = 1`` trains token ``k >= 1`` of branch ``b`` (``None``: every token; token 0 is never
    predicted). ``normalization="token"``: the divisor counts trained tokens; ``"sequence"``: each branch's mean CE,
    the divisor counts branches with a trained token. The loss is ``total / divisor``."""
    total, divisor = 0.0, 0.0
    with own_attention(causal_lm_of(model)):
        for b, seq in enumerate(sequences):
            ids = torch.tensor([list(seq)], device=model.device)
            trained_tokens = list(loss_masks[b]) if loss_masks is not None else [1] * len(seq)
            trained = torch.tensor(trained_tokens[1:], dtype=torch.float64, device=ids.device)
            if trained.sum() == 0:
                continue
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            ce = F.cross_entropy(logits.to(torch.float64), ids[0, 1:], reduction="none") * trained
            if normalization == "token":
                total, divisor = total + ce.sum(), divisor + trained.sum()
            else:
                total, divisor = total + ce.sum() / trained.sum(), divisor + 1
    return total, torch.as_tensor(divisor, dtype=torch.float64)


def per_branch_forest_loss(
    model: torch.nn.Module,
    groups: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]] | None]],
    normalization: str = "token",
) -> torch.Tensor:
    """The per-branch loss of every group ``(sequences, loss_masks)``: one differentiable scalar, each group's
    ``per_branch_loss`` summed and divided by the summed divisor (as one optimizer step over all their branches)."""
    total, divisor = 0.0, 0.0
    for sequences, masks in groups:
        t, d = per_branch_loss(model, sequences, masks, normalization)
        total, divisor = total + t, divisor + d
    return total / divisor


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: gradient}`` of every parameter that has one (detached copies)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------- error measures
def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` (Frobenius norms, in float64, on ``expected``'s device: a GPU result is
    measured against a CPU float64 oracle)."""
    got, expected = got.detach().to(expected.device, torch.float64), expected.detach().to(torch.float64)
    return float((got - expected).norm() / expected.norm().clamp_min(1e-300))


# A parameter whose true gradient is (near) zero, such as q/k projections when all attended tokens are equal, is
# measured against this fraction of the largest gradient norm instead of its own rounding-noise norm (~1e-18 in
# float64), which would turn float64 noise into O(1) "errors".
EXACT_GRAD_FLOOR = 1e-6
# The floor for models that compute in float32 inside even in a float64 model (hybrids' decay gates and norms:
# Qwen3.5's A_log / dt_bias gradients, ~1e-5 of the largest, carry ~4e-6 relative float32 rounding); a branch leak
# moves every gradient by >= 1e-4. The model zoo, which runs every architecture of transformers, uses it throughout.
FLOAT32_GRAD_FLOOR = 1e-3
# Relative errors below this are float32 rounding for the hybrids, whose mixers compute in float32 inside.
FLOAT32_FLOOR = 1e-4


def max_grad_error(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], floor: float = EXACT_GRAD_FLOOR
) -> float:
    """Largest per-tensor ``relative_error`` of same-named tensors (gradients, updates, state dicts); a tensor whose
    expected norm is below ``floor`` times the largest expected norm is measured against that instead (``floor=0``:
    each against its own norm). ``inf`` when the names differ (a parameter without a gradient on one side)."""
    if got.keys() != expected.keys():
        return float("inf")
    norms = {name: float(t.detach().to(torch.float64).norm()) for name, t in expected.items()}
    smallest = floor * max(norms.values(), default=0.0)
    return max(
        (
            float((got[name].detach().to(torch.float64) - t.detach().to(torch.float64)).norm())
            / max(norms[name], smallest, 1e-300)
            for name, t in expected.items()
        ),
        default=0.0,
    )
