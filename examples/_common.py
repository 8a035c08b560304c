"""What the examples share: their command line, their model, their data and chat template. Not an example itself.

Each example imports it from its own folder (``python examples/<name>.py`` puts that folder on ``sys.path``).
"""

from __future__ import annotations

import argparse

import datasets
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_tree.assets import load_smollm2_model
from hf_tree.data.sources import AGENT_TEMPLATE, chat_template_file, read_rows

# TRL's copy of Qwen3's chat template: it renders reasoning and tool calls (SmolLM2's own renders neither)
QWEN3_TEMPLATE = chat_template_file(AGENT_TEMPLATE)


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


def agent_dataset() -> datasets.Dataset:
    """8 short synthetic agent trajectories (``messages`` with reasoning and tool calls, ``tools``): the built-in
    ``builtin:synthetic-agent`` read by the resolver ``launch/train.py`` and ``hf-tree stats`` use."""
    options = dict(max_user_turns=2, max_tool_steps=1)
    return read_rows("builtin:synthetic-agent", limit=8, synthetic_options=options)[0]
