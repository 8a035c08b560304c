"""Dropout on trees: same expectation as per-branch training, different noise; said once, never silent.

A token shared by several branches is computed once in a tree, so a dropout layer draws one mask for it where
per-branch training (TRL's padded rows) draws one per branch. Each branch's loss still sees dropout with the same
probability (the expected gradient is unchanged), but the branches of a tree share their prefix's noise, and no seed
can make two runs draw the same masks. TRL's ``--use_peft`` keeps LoRA's ``lora_dropout=0.05`` (``ModelConfig``), and
``SFTConfig``/``GRPOConfig`` keep ``disable_dropout=False``; ``DPOConfig`` disables dropout by default.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hf_tree")

DROPOUT_WARNING = "hf_tree: dropout is active"


def active_dropout(model: torch.nn.Module) -> list[str]:
    """Names of the ``nn.Dropout`` modules of ``model`` with ``p > 0`` (LoRA's ``lora_dropout`` included), plus
    ``config.attention_dropout`` when it is set."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    if config is not None and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        names.append(f"config.attention_dropout={config.attention_dropout}")
    return names


def warn_if_dropout(model: torch.nn.Module, fix: str) -> None:
    """Log one warning when training ``model`` would apply dropout (see the module docstring); ``fix`` says how to
    turn it off for this trainer."""
    names = active_dropout(model)
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning(
            "%s in %d modules (%s): a token shared by several branches gets one dropout mask in the tree where "
            "per-branch training draws one per branch (same expectation, shared noise), so runs are not comparable "
            "draw for draw with TRL's. For training identical to per-branch, %s.",
            DROPOUT_WARNING,
            len(names),
            shown,
            fix,
        )
