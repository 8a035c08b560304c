"""Shared test helpers: tiny HF models built from configs, the per-branch oracle, exact training runs and the
pieces of the TRL-against-tree-trainer comparisons.

The oracle for anything tree-shaped: run the same model on each branch as an ordinary sequence
(``attn_implementation="sdpa"``, standard shifted cross-entropy) and combine with the same normalization.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

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
    if family in ("qwen3", "gpt_oss"):
        kwargs.setdefault("head_dim", 8)
    if family == "gpt_oss":  # sinks in every layer, a small window on half of them; float64-capable experts
        gpt_oss = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, experts_implementation="eager")
        kwargs = gpt_oss | kwargs
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
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, hidden_states):
        compute = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        h = hidden_states.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)

    classes = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, GptOssRMSNorm)
    originals = [cls.forward for cls in classes]
    for cls in classes:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, original in zip(classes, originals):
            cls.forward = original


def own_attention(model: torch.nn.Module) -> str:
    """The model's own attention: ``sdpa``, or ``eager`` for models that refuse sdpa (softcapping, sinks)."""
    return "sdpa" if model._supports_sdpa else "eager"


def per_branch_loss(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]] | None,
    normalization: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted CE, divisor) running each branch alone through ``model`` with its own attention."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(own_attention(model))
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


# ------------------------------------------------------------------------------- SmolLM2's real tokenizer
def smollm2_tokenizer_or_skip() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's tokenizer from the offline asset; skips the calling test (or fixture) when it is missing."""
    from hf_tree.assets import load_smollm2_tokenizer, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing (CI installs it): {error}")
    return load_smollm2_tokenizer()


def rendered(tokenizer, messages, **kwargs) -> list[int]:
    """The builders' oracle: the chat template's own tokenization of ``messages``."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


# ------------------------------------------------------------------------------------------- training runs
def exact_sgd_args(output_dir: str, **settings) -> dict:
    """Keyword arguments of ``TrainingArguments`` (or a TRL config) for runs compared against an oracle.

    Constant-rate SGD without clipping or weight decay keeps a gradient error visible in the update (Adam would
    normalise it away, clipping rescale it); the loss is logged every step; nothing is saved or reported, and data
    loads in the main process. ``settings`` add to or override these.
    """
    defaults = dict(
        output_dir=output_dir,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return {**defaults, **settings}


def train_and_measure_updates(trainer) -> dict[str, torch.Tensor]:
    """Run ``trainer.train()`` with RMSNorm kept in float64; how far it moved each trainable parameter."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with float64_norms():
        trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------- TRL trainers vs tree twins
TRL_TOLERANCE = 1e-9
# Parameter updates of one step: TRL's fused log-prob kernel computes its gradients in float32 even in a float64
# model (hidden-state gradients and the LM head's weight gradient), rounding differently for a different number of
# rows (TRL: every position of the padded batch; tree: the scored ones). TRL itself moves by ~3e-8 when only its
# padding changes (pad_to_multiple_of); a missing, doubled or misplaced token changes updates by > 1e-3.
TRL_STEP_TOLERANCE = 1e-6


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A real (word-level) fast tokenizer over the tiny vocabulary: ids 0-2 special, ``w{i}`` -> id ``i``."""
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, TINY["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def saved_tiny_model(path, dtype: torch.dtype) -> str:
    """Save the tiny Llama (``sdpa``) to ``path`` for trainers that load their models by path; returns the path."""
    tiny_model(dtype=dtype, attn="sdpa").save_pretrained(path)
    return str(path)


def tiny_trl_config(cls, path: str, dtype: torch.dtype, **settings):
    """A TRL config (``cls``) for a CPU run of the tiny model saved at ``path`` (batches of 4, exact SGD when
    trained, see ``exact_sgd_args``); ``settings`` add to or override these."""
    defaults = dict(use_cpu=True, bf16=False, model_init_kwargs={"dtype": dtype}, per_device_train_batch_size=4)
    return cls(**exact_sgd_args(f"{path}/out", **{**defaults, **settings}))


def assert_same_step_as_trl(trl, trl_updates: dict, tree, tree_updates: dict) -> None:
    """The tree trainer logged TRL's loss and moved every parameter as TRL did (and TRL did move them)."""
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert trl_updates.keys() == tree_updates.keys()
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name
    assert any(u.norm() > 0 for u in trl_updates.values())
