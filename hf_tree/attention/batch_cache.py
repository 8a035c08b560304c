"""Per-batch values shared by every attention layer of one forward (block masks, rectangle plans).

One model forward calls attention once per layer with the same ``kv_end`` tensor object (transformers
passes the keyword through unchanged), so what is derived from it is cached on that object's identity and
its in-place version counter. An entry holds a reference to the tensors it was built from: their memory
cannot be reused by a later batch while the entry lives, so an identity match cannot be stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Value = TypeVar("Value")


class BatchCache(Generic[Value]):
    """The last ``size`` values built from batch tensors (train and eval forwards may interleave)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[tuple[torch.Tensor | None, ...], Value]] = OrderedDict()

    def get(self, tensors: tuple[torch.Tensor | None, ...], options: tuple, build: Callable[[], Value]) -> Value:
        """``build()``, or its value from an earlier call with the same tensor objects (unmodified since) and
        the same ``options``."""
        key = (*((id(t), None if t is None else t._version) for t in tensors), options)
        entry = self._entries.get(key)
        if entry is not None and all(a is b for a, b in zip(entry[0], tensors, strict=True)):
            self._entries.move_to_end(key)
            return entry[1]
        value = build()
        self._entries[key] = (tensors, value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Drop every entry (and the references it holds to batch tensors)."""
        self._entries.clear()
