"""TRL's SFT token metrics (``entropy``, ``mean_token_accuracy``) on the branches of tree batches.

TRL's ``SFTTrainer`` logs, per micro-batch, the mean over its trained (row, token) labels of the entropy of the
predicted distribution and of whether the target is the top-1 token (its fused head's ``entropy`` and ``is_top1``),
gathered over the processes. A tree scores a shared trained token once with the weight of the branches that train it
(``normalization="token"``: the weight *is* that count), so the same means are weighted sums over the scored edges.

``MeteredTokenLoss`` wraps the token loss that both the packed rows and depth-first units call
(``hf_tree.loss.score_hidden_states``): it returns the wrapped loss unchanged and adds the edges' weighted entropy
and top-1 counts, computed without gradients from the same hidden states and the model's own head step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_tree.loss import _vocab_size, loss_chunk_rows, weighted_cross_entropy
from hf_tree.models.head import LogitHead


class MeteredTokenLoss:
    """A ``token_loss`` (``hf_tree.tree_causal_lm_loss``'s argument) that also sums, per scored edge ``i`` with weight
    ``w_i``, ``w_i * entropy_i``, ``w_i * [target_i is the top-1 token]`` and ``w_i`` into ``sums`` (``[3]`` float64:
    entropy, correct, count), read and reset by the trainer per micro-batch.

    Args:
        token_loss: the wrapped loss (``None``: ``weighted_cross_entropy``).
    """

    def __init__(self, token_loss: Callable[..., torch.Tensor] | None) -> None:
        self.token_loss = token_loss or weighted_cross_entropy
        self.sums = torch.zeros(3, dtype=torch.float64)

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
        loss = self.token_loss(head, hidden, targets, weights, softcap=softcap, chunk_size=chunk_size, scale=scale)
        logit_head = LogitHead(scale=scale, softcap=softcap)
        rows = chunk_size or loss_chunk_rows(_vocab_size(head))
        with torch.no_grad():
            for start in range(0, hidden.shape[0], rows):
                logits = logit_head.logits(head, hidden[start : start + rows].detach())
                logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 statistics, as TRL
                log_probs = torch.log_softmax(logits, dim=-1)
                entropy = -(log_probs.exp() * log_probs).sum(-1)
                correct = logits.argmax(-1) == targets[start : start + rows]  # TRL's is_top1: the first maximum
                w = weights[start : start + rows].to(torch.float64)
                chunk = torch.stack([(w * entropy.double()).sum(), (w * correct.double()).sum(), w.sum()])
                self.sums = self.sums.to(chunk.device) + chunk
        return loss

    def take(self) -> torch.Tensor:
        """The sums since the last call (``[3]`` float64: entropy, correct, count), then zeroed."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        return sums
