"""Model introspection: how hf_tree finds its way around a (wrapped) causal LM and runs it for a check.

The PreTrainedModel inside DDP/FSDP/PEFT wrappers, its backbone and the backbone's last hidden state, the model's
own attention for references, a no-grad eval-mode context that leaves training untouched, deterministic probe
token ids, and whether an error came from hf_tree itself. Used by the logit-head detection (``hf_tree.models.head``),
the self-check and its probe, the tree loss and the depth-first executor.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from collections.abc import Iterator

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import PreTrainedModel

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hf_tree/
_backbones: weakref.WeakKeyDictionary[PreTrainedModel, torch.nn.Module] = weakref.WeakKeyDictionary()


def causal_lm_of(model: torch.nn.Module) -> PreTrainedModel:
    """The ``PreTrainedModel`` inside DDP/FSDP/compile and PEFT wrappers (FSDP2 keeps the module itself): hf_tree's one
    unwrap helper, for every trained model (a causal LM, or the reward trainer's sequence classifier)."""
    unwrapped = extract_model_from_parallel(model)
    # a PEFT model has imported peft; not importing it for the others saves seconds (with bitsandbytes installed,
    # peft imports torch._inductor), as accelerate's is_peft_model would not
    peft = sys.modules.get("peft")
    return unwrapped.get_base_model() if peft is not None and isinstance(unwrapped, peft.PeftModel) else unwrapped


def remember_backbone(causal_lm: PreTrainedModel, backbone: torch.nn.Module) -> None:
    """Record the module ``detect_logit_head`` saw feed ``causal_lm``'s head, for ``backbone_of``."""
    _backbones[causal_lm] = backbone


def backbone_of(causal_lm: PreTrainedModel) -> torch.nn.Module:
    """The backbone whose ``last_hidden_state`` the head reads: the module ``detect_logit_head`` saw feed the head
    (e.g. OPT's and BART's inner ``decoder``), else ``base_model``, or ``model`` where the class's
    ``base_model_prefix`` names no attribute (Llama 4's text model: prefix ``language_model``, attribute ``model``)."""
    if causal_lm in _backbones:
        return _backbones[causal_lm]
    backbone = causal_lm.base_model
    if backbone is causal_lm and isinstance(getattr(causal_lm, "model", None), torch.nn.Module):
        return causal_lm.model
    return backbone


def training_kernel_modules() -> tuple[type[torch.nn.Module], ...]:
    """Module classes that run another computation in eval mode than in training and hold no dropout, so a check of
    the training computation keeps them in training mode: bitsandbytes' quantized linears (when it is imported).

    - ``Linear4bit``: an eval-mode forward without gradients on a CPU with AVX512-BF16 repacks the weight, for good,
      for a bfloat16 inference kernel (inputs rounded to bfloat16, ~6e-3 relative from the float32 compute dtype)
      that has no backward: every later training forward uses it and no gradient flows through the layer.
    - ``Linear8bitLt``: eval mode runs LLM.int8 (int8 activations, outlier columns picked over the whole batch, so
      rows round each other); training on CPU dequantizes the weight and runs an ordinary matmul.
    """
    bitsandbytes = sys.modules.get("bitsandbytes")  # a model with these layers has imported it
    return () if bitsandbytes is None else (bitsandbytes.nn.Linear4bit, bitsandbytes.nn.Linear8bitLt)


@contextlib.contextmanager
def eval_mode_no_grad(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout) under ``no_grad``, without autocast (a probe checks the model's
    computation in its parameters' dtype, not the trainer's mixed precision) and with a forked RNG; restores each
    module's own ``training`` flag and the RNG state afterwards, so a probe leaves training bit-for-bit unchanged.
    ``training_kernel_modules`` stay in training mode: the probe checks the kernels training runs, and an eval-mode
    forward would change them for the rest of training."""
    modes = [(module, module.training) for module in model.modules()]
    devices = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    device_type = next(model.parameters()).device.type
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            torch.autocast(device_type, enabled=False),
        ):
            model.eval()
            kernels = training_kernel_modules()
            for module in model.modules():
                if isinstance(module, kernels):
                    module.training = True
            yield
    finally:
        for module, training in modes:
            module.training = training


def probe_ids(vocab_size: int, length: int, seed: int, device: torch.device) -> torch.Tensor:
    """``[length]`` int64 token ids in ``[3, vocab_size)`` from a private generator (ids 0-2 are often special)."""
    generator = torch.Generator().manual_seed(seed)
    low = 3 if vocab_size > 8 else 0
    return torch.randint(low, vocab_size, (length,), generator=generator).to(device)


def _last_hidden_state(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.last_hidden_state


@contextlib.contextmanager
def capture_last_hidden_state(causal_lm: PreTrainedModel) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, ``captured["hidden"]`` is the ``[B, N, D]`` ``last_hidden_state`` of the backbone's latest
    forward: the tensor ``detect_logit_head`` verified the logits against (and the one TRL's fused head reads)."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        captured["hidden"] = _last_hidden_state(output)

    handle = backbone_of(causal_lm).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def own_attention_name(model: PreTrainedModel) -> str:
    """The model's own attention for references: ``sdpa``, or ``eager`` where the model refuses ``sdpa``."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
        return "sdpa"
    except (ValueError, ImportError):  # the model refuses sdpa (softcapping, sinks, ...)
        return "eager"
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def own_attention(model: PreTrainedModel) -> Iterator[str]:
    """Switch ``model`` to its own attention (``own_attention_name``) for the block, then back."""
    previous = model.config._attn_implementation
    name = own_attention_name(model)
    model.set_attn_implementation(name)
    try:
        yield name
    finally:
        model.set_attn_implementation(previous)


def raised_by_hf_tree(error: BaseException) -> bool:
    """Whether ``error`` was raised by hf_tree itself (its innermost frame is in the hf_tree package)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR)
