"""Model inputs a tree batch carries beyond its rows, e.g. the images of a vision-language tree.

The trainers read them through ``batch_model_inputs`` without importing the modules that build such batches: each
registers, when it is imported, how a batch holding its key becomes model inputs (``register_batch_inputs``;
``hf_tree.vision`` registers ``MediaTreeCollator`` batches under ``media_ids``). A batch with such a key can only be
built by that module, so its builder is always registered by then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BatchInputs = Callable[[torch.nn.Module, dict[str, Any], bool], dict[str, Any]]
"""``(model, batch, context_parallel) -> model inputs`` (keywords of the model's forward, e.g. image features)."""

_BUILDERS: dict[str, BatchInputs] = {}


def register_batch_inputs(key: str, builder: BatchInputs) -> None:
    """Let batches holding ``key`` reach the model with ``builder``'s inputs (a reloaded module replaces its own)."""
    _BUILDERS[key] = builder


def batch_model_inputs(model: torch.nn.Module, batch: dict[str, Any], context_parallel: bool = False) -> dict | None:
    """The further model inputs of ``batch`` (``None`` for a text batch): what the tree trainers pass to
    ``tree_causal_lm_loss`` as ``model_inputs``.

    Raises:
        ValueError: from the registered builder, e.g. for an image batch under context parallel.
    """
    for key, builder in _BUILDERS.items():
        if key in batch:
            return builder(model, batch, context_parallel)
    return None
