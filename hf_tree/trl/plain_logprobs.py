"""The tree fused head's per-token values in plain torch, for a TRL without its chunked log-prob kernel (TRL 1.9,
``hf_tree.trl.compat``): what TRL 1.9's GRPO and RLOO compute from full logits (``selective_log_softmax``,
``entropy_from_logits``), here on the predicting hidden states only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_tree.attention.mask import compute_dtype

# Scored tokens per head call: bounds the transient ``[tokens, vocab]`` logits (autograd keeps each chunk's softmax
# for the backward, as TRL 1.9 keeps its full logits).
TOKEN_CHUNK = 1024


def plain_log_prob_values(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    softcap: float | None,
    scale: float,
    outputs: Sequence[str],
) -> tuple[torch.Tensor | None, ...]:
    """``trl.kernels.ChunkedLogProbFunction.apply``'s contract in plain torch (``chunk_size``, its vocabulary tile,
    is not needed): logits ``softcap(scale * (hidden @ weight.T + bias)) / temperature`` in float32 (float64 kept).

    Args:
        hidden: ``[M, D]`` states that predict ``targets`` ``[M]``.
        outputs: fields to compute besides ``log_probs``, among ``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
            ``is_top1`` (the last three without gradient, as TRL's).

    Returns:
        ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[M]`` (``is_top1`` bool: the
        target is the first most likely token) or ``None`` when not in ``outputs``.
    """
    values: dict[str, list[torch.Tensor]] = {name: [] for name in ("log_probs", *outputs)}
    for start in range(0, hidden.shape[0], TOKEN_CHUNK):
        states = hidden[start : start + TOKEN_CHUNK]
        logits = torch.nn.functional.linear(states, weight, bias)  # in autocast's dtype under autocast, as TRL's
        logits = logits.to(compute_dtype(logits.dtype)) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        log_softmax = logits.log_softmax(-1)
        chunk_targets = targets[start : start + TOKEN_CHUNK].unsqueeze(-1)
        values["log_probs"].append(log_softmax.gather(-1, chunk_targets).squeeze(-1))
        if "entropy" in values:
            values["entropy"].append(-(log_softmax.exp() * log_softmax).sum(-1))
        with torch.no_grad():
            if "log_sum_sq_probs" in values:
                values["log_sum_sq_probs"].append(torch.logsumexp(2 * log_softmax, -1))
            if "mean_logits" in values:
                values["mean_logits"].append(logits.mean(-1))
            if "is_top1" in values:
                values["is_top1"].append(logits.argmax(-1) == chunk_targets.squeeze(-1))
    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    return tuple(torch.cat(values[name]) if name in values else None for name in names)
