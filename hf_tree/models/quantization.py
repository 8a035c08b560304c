"""One log line confirming a quantized base model (QLoRA): which quantization, how many bits, which compute dtype.

A QLoRA run and a LoRA run on the same checkpoint log the same training lines; this line says which one ran (the
trainers log it once, before the first step; ``hf-tree train`` and ``hf-tree sft|dpo|kto|grpo|rloo|reward`` alike).
"""

from __future__ import annotations

import logging

import torch

from hf_tree.models.introspection import causal_lm_of

logger = logging.getLogger("hf_tree")


def quantized_base_description(model: torch.nn.Module) -> str | None:
    """``"bitsandbytes 4-bit nf4 (double quantization), compute dtype bfloat16"`` for a model whose base was loaded
    quantized (``from_pretrained(quantization_config=...)``, PEFT-wrapped or not); ``None`` for an ordinary model
    (a dequantized GGUF checkpoint included)."""
    base = causal_lm_of(model)
    quantizer = getattr(base, "hf_quantizer", None)
    if not getattr(base, "is_quantized", False) or quantizer is None:
        return None
    config = quantizer.quantization_config
    method = str(getattr(config.quant_method, "value", config.quant_method))
    if getattr(config, "load_in_4bit", False):
        double = ", double quantization" if config.bnb_4bit_use_double_quant else ""
        return (
            f"{method} 4-bit {config.bnb_4bit_quant_type}{double}, compute dtype "
            f"{str(config.bnb_4bit_compute_dtype).removeprefix('torch.')}"
        )
    dtype = str(base.dtype).removeprefix("torch.")
    if getattr(config, "load_in_8bit", False):
        return f"{method} 8-bit (LLM.int8), compute dtype {dtype}"
    bits = getattr(config, "bits", None)
    return f"{method}{f' {bits}-bit' if bits else ''}, model dtype {dtype}"


def log_quantized_base(model: torch.nn.Module) -> None:
    """Log ``quantized_base_description`` when ``model``'s base is quantized (nothing otherwise)."""
    description = quantized_base_description(model)
    if description is not None:
        logger.info("hf_tree: the base model is quantized: %s; trained through its adapters.", description)
