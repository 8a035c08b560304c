"""TRL's SFT token metrics (``entropy``, ``mean_token_accuracy``) on the branches of tree batches.

TRL's ``SFTTrainer`` logs, per micro-batch, the mean over its trained (row, token) labels of the entropy of the
predicted distribution and of whether the target is the top-1 token (its fused head's ``entropy`` and ``is_top1``),
gathered over the processes. A tree scores a shared trained token once with the weight of the branches that train it
(``normalization="token"``: the weight *is* that count), so the same means are weighted sums over the scored edges.

``MeteredTokenLoss`` wraps the token loss that both the packed rows and depth-first units call
(``hf_tree.loss.score_hidden_states``): it returns the wrapped loss unchanged and hands it a ``TokenMetrics``
(``hf_tree.token_metrics``), to which the loss reports each chunk of logits it computes anyway
(``weighted_cross_entropy``'s and the SFT losses' ``metrics`` argument), so the statistics cost no head pass of their
own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from hf_tree.loss import _vocab_size, loss_chunk_rows, weighted_cross_entropy
from hf_tree.models.head import LogitHead
from hf_tree.token_metrics import TokenMetrics


def reports_metrics(token_loss: Callable[..., torch.Tensor]) -> bool:
    """Whether ``token_loss`` takes a ``metrics`` argument (a ``TokenMetrics`` its chunks report to)."""
    try:
        return "metrics" in inspect.signature(token_loss).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False


class MeteredTokenLoss:
    """A ``token_loss`` (``hf_tree.tree_causal_lm_loss``'s argument) that also sums TRL's per-token statistics of the
    scored edges into ``metrics`` (a ``TokenMetrics``), read and reset by the trainer per micro-batch (``take``).

    Args:
        token_loss: the wrapped loss (``None``: ``weighted_cross_entropy``).
    """

    def __init__(self, token_loss: Callable[..., torch.Tensor] | None) -> None:
        self.token_loss = token_loss or weighted_cross_entropy
        self.metrics = TokenMetrics()
        self.reports = reports_metrics(self.token_loss)

    def __call__(
        self,
        head: torch.nn.Module,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        softcap: float | None = None,
        chunk_size: int | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """``hidden [M, D]``, ``targets [M]`` int64, ``weights [M]``: the wrapped loss (0-dim)."""
        options = dict(softcap=softcap, chunk_size=chunk_size, scale=scale)
        if self.reports:
            return self.token_loss(head, hidden, targets, weights, **options, metrics=self.metrics)
        loss = self.token_loss(head, hidden, targets, weights, **options)
        # A token loss without a ``metrics`` argument (a user's own) cannot report its logits: only for it, the
        # statistics take a second, no-grad pass of the head over the hidden states (a [M, vocab] matmul more).
        logit_head = LogitHead(scale=scale, softcap=softcap)
        rows = chunk_size or loss_chunk_rows(_vocab_size(head))
        with torch.no_grad():
            for start in range(0, hidden.shape[0], rows):
                logits = logit_head.logits(head, hidden[start : start + rows].detach())
                logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 statistics, as TRL
                log_probs = torch.log_softmax(logits, dim=-1)
                self.metrics.add_log_probs(
                    logits, log_probs, targets[start : start + rows], weights[start : start + rows]
                )
        return loss

    def take(self) -> torch.Tensor:
        """The sums since the last call (``[3]`` float64: entropy, correct, count), then zeroed."""
        return self.metrics.take()
