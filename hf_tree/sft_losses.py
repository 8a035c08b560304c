"""TRL's other SFT objectives on trees: DFT (``loss_type="dft"``) and label smoothing (``label_smoothing_factor``).

Both are sums of per-token terms, so on a tree each scored edge keeps its weight ``w_c`` (the branches that contain
and train it) and only the per-token term changes:

- DFT (TRL: ``-log p * p.detach()``, https://huggingface.co/papers/2508.05629): the edge weight becomes
  ``w_c * p_c`` with the target's probability ``p_c`` detached, i.e. ``w_c * p_c * CE_c``.
- Label smoothing (transformers' ``LabelSmoother``, which TRL's ``SFTTrainer`` uses for ``loss_type="nll"``):
  ``(1 - eps) * CE_c + eps * (-mean over the vocabulary of log p)``, both terms weighted by ``w_c``.

The divisor is the tree loss's (the step's trained-token count for ``"token"`` normalization, as TRL's
``num_items_in_batch``), so the loss and its gradients equal TRL's on every branch run separately. Logits are
computed in chunks of rows and recomputed in backward (``torch.utils.checkpoint``): ``[M, vocab]`` never exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hf_tree.loss import ChunkReports, chunked_token_loss
from hf_tree.models.head import LogitHead
from hf_tree.token_metrics import TokenMetrics

SFT_LOSS_TYPES = ("nll", "dft")


def _smoothed_dft_chunk(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    logit_head: LogitHead,
    dft: bool,
    label_smoothing: float,
    reports: ChunkReports | None = None,
) -> torch.Tensor:
    """The weighted sum of one chunk's per-token losses. ``hidden [m, D]``, ``targets``/``weights [m]``; the chunk's
    logits go to ``reports`` (``chunked_token_loss``)."""
    logits = logit_head.logits(head, hidden)
    log_probs = torch.log_softmax(logits, dim=-1)  # [m, vocab]
    if reports is not None:
        reports.add_log_probs(logits, log_probs, targets, weights)
    target_log_probs = log_probs.gather(1, targets[:, None]).squeeze(1)  # [m]
    weights = weights.to(log_probs.dtype)
    if dft:
        weights = weights * target_log_probs.detach().exp()
    total = -(1 - label_smoothing) * (weights * target_log_probs).sum()
    if label_smoothing:
        total = total - label_smoothing * (weights * log_probs.mean(dim=-1)).sum()
    return total


def smoothed_dft_cross_entropy(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    softcap: float | None = None,
    chunk_size: int | None = None,
    scale: float = 1.0,
    *,
    dft: bool = False,
    label_smoothing: float = 0.0,
    metrics: TokenMetrics | None = None,
) -> torch.Tensor:
    """``sum_i weights[i] * loss_i`` with DFT and/or label-smoothed per-token losses (see the module docstring).

    Same arguments as ``hf_tree.loss.weighted_cross_entropy`` (``hidden [M, D]``, ``targets``/``weights [M]``)
    plus ``dft`` and ``label_smoothing`` (and ``metrics``, as there); returns a 0-dim float32 (float64 for float64
    hidden states) tensor.
    """
    logit_head = LogitHead(scale=scale, softcap=softcap)
    return chunked_token_loss(
        _smoothed_dft_chunk,
        head,
        hidden,
        targets,
        weights,
        chunk_size,
        logit_head,
        dft,
        label_smoothing,
        metrics=metrics,
    )


def sft_token_loss(loss_type: str, label_smoothing_factor: float) -> Callable[..., torch.Tensor] | None:
    """The ``token_loss`` for ``tree_causal_lm_loss`` that reproduces TRL's SFT objective; ``None`` for plain NLL.

    As in TRL's ``SFTTrainer``, label smoothing applies to ``loss_type="nll"`` only (DFT ignores it).

    Raises:
        ValueError: for a ``loss_type`` TRL does not have, or a factor outside ``[0, 1)``.
    """
    if loss_type not in SFT_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} must be one of {SFT_LOSS_TYPES} (TRL's SFT loss types).")
    if not 0.0 <= label_smoothing_factor < 1.0:
        raise ValueError(f"label_smoothing_factor={label_smoothing_factor} must be in [0, 1).")
    dft = loss_type == "dft"
    smoothing = 0.0 if dft else float(label_smoothing_factor)
    if not dft and not smoothing:
        return None
    return functools.partial(smoothed_dft_cross_entropy, dft=dft, label_smoothing=smoothing)
