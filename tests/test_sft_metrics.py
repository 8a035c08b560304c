"""TRL's SFT token metrics (``hf_tree.sft_metrics``) come from the token loss's own logits: no head pass of their own,
the loss and gradients unchanged to the bit, and the statistics equal to a separate pass over the same hidden states
(TRL's definitions, float64). The trainer-level check against TRL's logged values is
``tests/test_in_batch_merging.py::test_sft_logs_trls_token_metrics``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.loss import weighted_cross_entropy
from hf_tree.sft_losses import sft_token_loss
from hf_tree.sft_metrics import MeteredTokenLoss, reports_metrics
from tests.helpers import tiny_model

LOSSES = {
    "nll": lambda: None,
    "dft": lambda: sft_token_loss("dft", 0.0),
    "label_smoothing": lambda: sft_token_loss("nll", 0.1),
}
# The fused path's first maximum and its bit-for-bit loss are kernels' properties: checked on CUDA too.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SEQUENCES = [[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6, 11, 12, 13, 14], [5, 6, 7, 8, 9]]


def own_loss(token_loss):
    """A user's token loss: the same loss behind a signature without ``metrics``, so it cannot report."""
    base = token_loss or weighted_cross_entropy

    def loss(head, hidden, targets, weights, softcap=None, chunk_size=None, scale=1.0):
        return base(head, hidden, targets, weights, softcap=softcap, chunk_size=chunk_size, scale=scale)

    return loss


def _problem(dtype: torch.dtype, device: str, vocab: int = 40, rows: int = 23, width: int = 8):
    """A head whose tokens 2 and 5 have the same row, so every row's top two logits tie (2 first) and each target
    is one of them (or another token): the first maximum decides TRL's ``is_top1``."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, width, dtype=dtype, generator=generator))
        head.weight[2] = head.weight[5] = 4 * head.weight.norm(dim=1).max() / width**0.5
    hidden = torch.rand(rows, width, dtype=dtype, generator=generator) + 0.5  # positive: tokens 2 and 5 lead
    targets = torch.tensor([2, 5, 9] * (rows // 3) + [2] * (rows % 3))
    weights = torch.randint(1, 4, (rows,), generator=generator).to(dtype)
    return head.to(device), hidden.to(device), targets.to(device), weights.to(device)


def _oracle(head, hidden, targets, weights, softcap, scale) -> torch.Tensor:
    """TRL's statistics over the whole ``[M, vocab]`` logits in float64: entropy_from_logits and argmax."""
    logits = scale * head(hidden.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    w = weights.double()
    return torch.stack([(w * entropy).sum(), (w * (logits.argmax(-1) == targets)).sum(), w.sum()])


def _metered(module, token_loss, hidden, targets, weights, grad: bool, **options):
    """(loss, d loss / d hidden, d loss / d head weight, metric sums) of ``token_loss`` (metered unless ``None``)."""
    hidden = hidden.clone().requires_grad_(grad)
    head = module if isinstance(module, torch.nn.Linear) else module[0]
    head.weight.grad = None
    with torch.set_grad_enabled(grad):
        loss = token_loss(module, hidden, targets, weights, chunk_size=7, **options)
    if grad:
        loss.backward()
    sums = token_loss.take() if isinstance(token_loss, MeteredTokenLoss) else None
    return loss.detach(), hidden.grad, head.weight.grad, sums


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, dict(softcap=3.0, scale=0.5)], ids=["plain", "softcap_scale"])
@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("head_kind", ["linear", "wrapped"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_reported_metrics_equal_a_second_pass_in_float64(loss, head_kind, grad, options, device):
    """Reported by the loss's chunks (the fused linear path, the checkpointed one for other heads, DFT and label
    smoothing; with gradients and in evaluation) = the second no-grad pass (what a user's own token loss gets, and
    what every loss got before) = TRL's formulas on the whole logits, to float64 rounding; first maxima decide
    ties; and the loss is the unmetered loss's."""
    head, hidden, targets, weights = _problem(torch.float64, device)
    module = head if head_kind == "linear" else torch.nn.Sequential(head)
    token_loss = LOSSES[loss]()
    plain = _metered(module, token_loss or weighted_cross_entropy, hidden, targets, weights, grad, **options)
    reported = _metered(module, MeteredTokenLoss(token_loss), hidden, targets, weights, grad, **options)
    second_pass = _metered(module, MeteredTokenLoss(own_loss(token_loss)), hidden, targets, weights, grad, **options)
    expected = _oracle(head, hidden, targets, weights, options.get("softcap"), options.get("scale", 1.0))
    correct = weights[targets == 2].sum()  # token 2 ties with 5 and comes first: a hit; 5 never is, 9 is not a top-1
    assert expected[1] == correct > 0
    torch.testing.assert_close(reported[3], expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(second_pass[3], expected, rtol=1e-12, atol=0)
    assert torch.equal(reported[0], plain[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("head_kind", ["linear", "wrapped"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_metrics_leave_the_loss_and_gradients_bit_identical(loss, head_kind, softcap, dtype, device):
    """Reporting changes no bit of the loss or of the hidden-state and head gradients (low precision included)."""
    head, hidden, targets, weights = _problem(dtype, device)
    module = head if head_kind == "linear" else torch.nn.Sequential(head)
    token_loss = LOSSES[loss]()
    options = dict(softcap=softcap, scale=0.5)
    plain = _metered(module, token_loss or weighted_cross_entropy, hidden, targets, weights, True, **options)
    metered = _metered(module, MeteredTokenLoss(token_loss), hidden, targets, weights, True, **options)
    for got, expected in zip(metered[:3], plain[:3], strict=True):
        assert torch.equal(got, expected)
    assert metered[3][2] == weights.double().sum()


def _step_flops(model, token_loss, execution: str) -> int:
    """Matmul FLOPs of one tree step (loss and backward, the whole model), counted by torch's FLOP counter."""
    tree = Tree.from_sequences(SEQUENCES)
    model.zero_grad()
    with FlopCounterMode(display=False) as counter:
        if execution == "packed":
            batch = TreeDataCollator(max_packed_tokens=64)([tree.to_dict()])
            tree_causal_lm_loss(model, batch, token_loss=token_loss, chunk_size=3).backward()
        else:  # units of 3 tokens: the edges of one node scored in several units
            depth_first_backward(model, [tree], DepthFirstConfig(3, chunk_size=3), token_loss=token_loss)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("loss", "execution"),
    [  # the fast tier counts NLL's step both ways; DFT and label smoothing report through the same chunks (slow)
        (loss, execution) if loss == "nll" else pytest.param(loss, execution, marks=pytest.mark.slow)
        for loss in LOSSES
        for execution in ("packed", "depth_first")
    ],
)
def test_metrics_take_no_head_pass_of_their_own(loss, execution):
    """One tree step's matmul FLOPs are the same with the metered token loss as without: the statistics come from
    the logits the loss computes anyway (a second head pass added 2 * edges * hidden * vocab per micro-batch). A
    token loss that cannot report (a user's own) falls back on that second pass: exactly one logits matmul more,
    and the same statistics."""
    model = tiny_model()
    width, vocab = model.config.hidden_size, model.config.vocab_size
    batch = TreeDataCollator(max_packed_tokens=64)([Tree.from_sequences(SEQUENCES).to_dict()])
    edges, trained = batch["loss_targets"].numel(), batch["loss_weights"].sum()
    token_loss = LOSSES[loss]()
    _step_flops(model, token_loss, execution)  # the model's first tree step runs its self-check probes
    metered = MeteredTokenLoss(token_loss)
    assert _step_flops(model, metered, execution) == _step_flops(model, token_loss, execution)
    reported = metered.take()
    assert reported[2] == trained  # every scored edge reported once, with the branches that train it
    user = own_loss(token_loss)
    metered_user = MeteredTokenLoss(user)
    assert reports_metrics(metered.token_loss) and not reports_metrics(user)
    extra = 2 * edges * width * vocab
    assert _step_flops(model, metered_user, execution) == _step_flops(model, user, execution) + extra
    torch.testing.assert_close(metered_user.take(), reported, rtol=1e-12, atol=0)
