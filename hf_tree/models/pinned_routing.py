"""Pinned expert routing for the first-use probe: the reference runs route each token as the packed tree did.

A router's top-k over its experts is discontinuous: two experts whose logits tie (or nearly) in a low-precision
dtype swap on a one-unit rounding difference, and the token's output then differs by O(1). The tree engines round
differently from the model's own attention (float32 accumulation, other shapes), so a tie flips between the packed
tree and the branches alone with no branch seeing another (measured on gpt-oss in float16: experts 1 and 3 tie at
-0.051025390625 for one token of the branches alone, the tree rounds expert 1 one unit lower and picks expert 3;
its logits stay bit for bit the same when the sibling branches' tokens are replaced, and the probe saw 0.43 in the
next layer). That is rounding, not a leak, and no rounding floor measured between two reference runs sees it (they
round alike). So the probe records every top-k over an expert axis in the tree run and replays it in the reference
runs at the same tokens: routing is then equal by construction, and every continuous difference (a leak into the
router's input included) still shows in the experts' outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_TOPK = (torch.topk, torch.Tensor.topk)


def _topk_call(func, args, kwargs, experts: set[int]) -> tuple[torch.Tensor, int] | None:
    """``(input, k)`` of a largest-first top-k over the last axis of an expert-sized dim, else None."""
    if func not in _TOPK or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    k = args[1] if len(args) > 1 else kwargs.get("k")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    if x.dim() < 2 or not x.is_floating_point() or x.shape[-1] not in experts or not largest:
        return None
    if dim not in (-1, x.dim() - 1) or not isinstance(k, int):
        return None
    return x, k


class _Recorder(TorchFunctionMode):
    """Collects, per top-k call over experts, its indices as ``[tokens, k]``."""

    def __init__(self, experts: set[int]):
        super().__init__()
        self.experts, self.indices = experts, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _topk_call(func, args, kwargs, self.experts) is not None:
            self.indices.append(result[1].reshape(-1, result[1].shape[-1]))
        return result


class _Replayer(TorchFunctionMode):
    """Replaces the indices of the i-th top-k call over experts by the recorded call's at ``rows`` (``[tokens]``:
    the recorded row of each token of this run, -1 for a token of its own, e.g. padding), and its values by the
    input's at those indices. A call that does not match the recording (count, k) keeps its own routing."""

    def __init__(self, experts: set[int], recorded: list[torch.Tensor], rows: torch.Tensor):
        super().__init__()
        self.experts, self.recorded, self.rows, self.calls = experts, recorded, rows, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        call = _topk_call(func, args, kwargs, self.experts)
        if call is None:
            return result
        x, k = call
        recorded = self.recorded[self.calls] if self.calls < len(self.recorded) else None
        self.calls += 1
        flat_x = x.reshape(-1, x.shape[-1])
        if recorded is None or recorded.shape[1] != k or flat_x.shape[0] != self.rows.numel():
            return result
        rows = self.rows.to(x.device)
        indices = result[1].reshape(-1, k).clone()
        pinned = rows >= 0
        indices[pinned] = recorded[rows[pinned]].to(indices.device)
        values = torch.gather(flat_x, -1, indices)
        return type(result)((values.reshape(result[0].shape), indices.reshape(result[1].shape)))


@contextlib.contextmanager
def recording_routing(experts: set[int]) -> Iterator[list[torch.Tensor]]:
    """Within the block, record every top-k over an axis of a size in ``experts``; yields the list of indices."""
    with _Recorder(experts) as mode:
        yield mode.indices


@contextlib.contextmanager
def replaying_routing(experts: set[int], recorded: list[torch.Tensor], rows: torch.Tensor) -> Iterator[None]:
    """Within the block, route token ``t`` as recorded row ``rows[t]`` (``-1``: its own routing)."""
    with _Replayer(experts, recorded, rows):
        yield
