"""Shared test helpers: tiny HF models built from configs and the per-branch oracle.

The oracle for anything tree-shaped: run the same model on each branch as an ordinary sequence
(``attn_implementation="sdpa"``, standard shifted cross-entropy) and combine with the same normalization.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

import hf_tree  # noqa: F401  (registers tree_flash)

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_config(family: str = "llama", **overrides) -> transformers.PretrainedConfig:
    """A tiny random config of a decoder family (GQA: 4 query heads, 2 KV heads)."""
    kwargs = dict(TINY, **overrides)
    if family == "qwen3":
        kwargs.setdefault("head_dim", 8)
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
    differently in a tree than per branch (~1e-7). Keep float64 in both models for 1e-9 tests."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, hidden_states):
        compute = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        h = hidden_states.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)

    classes = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)
    originals = [cls.forward for cls in classes]
    for cls in classes:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, original in zip(classes, originals):
            cls.forward = original


def per_branch_loss(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]] | None,
    normalization: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted CE, divisor) running each branch alone through ``model`` with SDPA."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    total, divisor = 0.0, 0.0
    try:
        for b, seq in enumerate(sequences):
            ids = torch.tensor([list(seq)])
            mask = torch.tensor(list(loss_masks[b]) if loss_masks is not None else [1] * len(seq), dtype=torch.float64)
            mask[0] = 0
            trained = mask[1:]
            if trained.sum() == 0:
                continue
            logits = model(input_ids=ids).logits[0, :-1]
            ce = F.cross_entropy(logits.to(torch.float64), ids[0, 1:], reduction="none") * trained
            if normalization == "token":
                total, divisor = total + ce.sum(), divisor + trained.sum()
            else:
                total, divisor = total + ce.sum() / trained.sum(), divisor + 1
    finally:
        model.set_attn_implementation(previous)
    return total, torch.as_tensor(divisor, dtype=torch.float64)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def max_grad_relative_error(model_grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> float:
    """Largest per-parameter relative error. A parameter whose true gradient is (near) zero, such as q/k
    projections when all attended tokens are equal, is measured against 1e-6 of the largest gradient norm
    instead of its own rounding-noise norm (~1e-18), which would turn float64 noise into O(1) "errors"."""
    assert model_grads.keys() == ref_grads.keys()
    floor = 1e-6 * max(float(g.to(torch.float64).norm()) for g in ref_grads.values())
    errors = []
    for name, ref in ref_grads.items():
        ref64, got64 = ref.to(torch.float64), model_grads[name].to(torch.float64)
        errors.append(float((got64 - ref64).norm()) / max(float(ref64.norm()), floor, 1e-300))
    return max(errors)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
