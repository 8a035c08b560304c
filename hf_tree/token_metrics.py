"""Sums of TRL's per-token SFT statistics (entropy, top-1 hits) over weighted scored edges, reported chunk by chunk
by the token losses (``hf_tree.loss``, ``hf_tree.sft_losses``) from the logits they compute; ``hf_tree.sft_metrics``
turns them into TRL's logged ``entropy`` and ``mean_token_accuracy``."""

from __future__ import annotations

import torch


class TokenMetrics:
    """Sums over scored edges ``i`` with weight ``w_i`` of TRL's per-token statistics: ``sums`` ``[3]`` float64 =
    (``sum w_i * entropy_i``, ``sum w_i * [target_i is the top-1 token]``, ``sum w_i``), added chunk by chunk by the
    token losses (their ``metrics`` argument) and read and reset per micro-batch (``take``)."""

    def __init__(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64)

    @torch.no_grad()
    def add(self, entropy: torch.Tensor, top1: torch.Tensor, weights: torch.Tensor) -> None:
        """One chunk: ``entropy [m]`` (float32 as TRL's, float64 for a float64 model), ``top1 [m]`` bool (the target
        is the *first* maximum of its logits, TRL's ``is_top1``), ``weights [m]``."""
        w = weights.detach().to(torch.float64)
        chunk = torch.stack([(w * entropy.double()).sum(), (w * top1.double()).sum(), w.sum()])
        self.sums = self.sums.to(chunk.device) + chunk

    @torch.no_grad()
    def add_log_probs(
        self, logits: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """One chunk from its ``logits [m, vocab]`` (float32, or float64) and their ``log_softmax``: TRL's
        ``entropy_from_logits`` and ``argmax`` (the first maximum). ``targets [m]`` int64, ``weights [m]``."""
        log_probs = log_probs.detach()
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        self.add(entropy, logits.detach().argmax(-1) == targets, weights)

    def take(self) -> torch.Tensor:
        """The sums since the last call (``[3]`` float64: entropy, correct, count), then zeroed."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        return sums
