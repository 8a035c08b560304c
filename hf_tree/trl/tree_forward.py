"""``TreeForward``: a forward hf_tree installs in place of a model's own, as an object its trainer holds.

The TRL tree trainers replace a model's ``forward`` (the log-prob trainers' fused head, ``hf_tree.trl.glue``; the
reward model's pooled scores, ``hf_tree.trl.reward_head``), as TRL's ``add_fused_lm_head`` does. What those calls
need besides the model (the forward they replaced, for the first-use probe and plain calls) and what they leave for
the trainer's logs (the last call's packing) live on that object, not on the model.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from hf_tree.packing import PackingStats


class TreeForward:
    """Installed as ``model.forward`` (bound to the model) by ``install``; subclasses define ``__call__(model, ...)``.

    Attributes:
        previous_forward: the forward it replaced (TRL's fused head or the model's own); installing again on the same
            model replaces the earlier ``TreeForward`` and wraps the forward that one replaced.
        layout_stats: the packing of the last call that packed rows; ``None`` before any and after a call that scored
            nothing (no stale ratio to log).
    """

    previous_forward: Callable[..., Any]
    layout_stats: PackingStats | None

    def install(self, model: torch.nn.Module) -> None:
        """Make this ``model.forward``, keeping the signature of the model class's ``forward`` (``generate()``
        validates its keyword arguments against it)."""
        installed = getattr(model.forward, "__func__", None)
        self.previous_forward = installed.previous_forward if isinstance(installed, TreeForward) else model.forward
        self.layout_stats = None
        self.__wrapped__ = type(model).forward  # what inspect.signature reads
        model.forward = types.MethodType(self, model)
