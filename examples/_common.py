"""What the examples share: their command line, their model and a chat template. Not an example itself.

Each example imports it from its own folder (``python examples/<name>.py`` puts that folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import importlib.resources

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_tree.assets import load_smollm2_model

# TRL's copy of Qwen3's chat template: it renders reasoning and tool calls (SmolLM2's own renders neither)
QWEN3_TEMPLATE = str(importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja")


def example_parser(description: str) -> argparse.ArgumentParser:
    """The options every example takes: ``--tiny`` and ``--max_steps``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2-135M")
    parser.add_argument("--max_steps", type=int, default=4)
    return parser


def load_model(tiny: bool, vocab_size: int) -> torch.nn.Module:
    """SmolLM2-135M-Instruct (offline, float32), or with ``tiny`` a tiny random Llama over ``vocab_size`` tokens;
    seeded, so that every call returns the same weights."""
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(
            LlamaConfig(vocab_size=vocab_size, **shape), attn_implementation="tree_flash"
        )
    return load_smollm2_model(dtype=torch.float32)
