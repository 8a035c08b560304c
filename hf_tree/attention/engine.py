"""The one interface of the tree attention engines: ``engine(query, key, value, kv_end, options) -> out``.

Every engine of ``hf_tree.attention.ENGINES`` (and a scoped one, such as tree context parallel's) is a
``TreeAttentionEngine``: it takes the row's tensors and one ``TreeAttentionOptions``, honours every option it can
compute exactly and refuses the others with a ``ValueError`` (an engine never drops an option).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TreeAttentionOptions:
    """What one tree attention call asks of its engine, beside the row's tensors.

    ``hf_tree.attention.options.tree_mode_options`` builds it from a model's attention call (and refuses what no
    engine can honour); tests and benchmarks build it directly.
    """

    scaling: float
    """Multiplier of ``query @ key^T``."""
    sliding_window: int | None = None
    """Window in depth positions, as each branch alone would see it (needs ``position_ids``), or ``None``."""
    softcap: float | None = None
    """``softcap * tanh(scores / softcap)`` before masking (Gemma-style), or ``None``."""
    sinks: torch.Tensor | None = None
    """``[H]`` attention-sink logits (gpt-oss ``s_aux``): one extra logit per query head joins every query's softmax
    denominator and attends to nothing, as in the models' eager attention; or ``None``."""
    position_ids: torch.Tensor | None = None
    """``[B, N]`` depths (needed with ``sliding_window`` or ``attention_chunk``), or ``None``."""
    attention_chunk: int | None = None
    """Chunked attention's chunk size in depth positions (Llama 4): a query sees the keys of its own chunk only, as
    each branch alone would; or ``None``."""
    bidirectional_block: torch.Tensor | None = None
    """``[B, N]`` block id per token (``-1``: none): tokens of one block also see the block's later tokens (Gemma 3's
    image tokens; ``hf_tree.attention.mask.tree_mask_mod``); or ``None``."""


class EngineRefused(ValueError):
    """A forced engine was asked for what its kernel cannot compute exactly (the message names the option and the
    reason); the automatic engines route such calls elsewhere instead. Each kernel engine raises its own subclass."""


class TreeAttentionEngine(Protocol):
    """A tree attention engine (``hf_tree.attention.ENGINES``' values, ``attention_engine_scope``'s argument)."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_end: torch.Tensor,
        options: TreeAttentionOptions,
    ) -> torch.Tensor:
        """Attention of a packed tree row.

        Args:
            query: ``[B, H, N, D]``.
            key, value: ``[B, Hkv, N, D]`` with ``H % Hkv == 0`` (GQA/MQA).
            kv_end: ``[B, N]`` integer subtree ends (query ``i`` sees key ``j`` iff ``j <= i < kv_end[j]``).
            options: everything else the call asks for.

        Returns:
            ``[B, N, H, D]`` in ``query``'s dtype.
        """
        ...
