"""The exact tree loss: a gather of predicting hidden states, the model's own head step, chunked CE.

HF's shifted causal-LM loss cannot score several children of one position, so the tree loss gathers
``hidden[loss_positions]`` and scores each edge against ``loss_targets`` with ``loss_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from hf_tree.attention.mask import autocast_inputs, compute_dtype
from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.models.check import check_model_for_trees, refuse_not_tree_aware
from hf_tree.models.head import LogitHead, forward_then_score, gathered_head, head_input
from hf_tree.models.introspection import capture_last_hidden_state, causal_lm_of
from hf_tree.models.length_rope import check_rope_lengths
from hf_tree.models.router_loss import router_aux_loss_coef, tree_router_loss
from hf_tree.packing import DEPTH_FIRST_KEY
from hf_tree.token_metrics import TokenMetrics

# Bytes of one float32 [rows, vocab] logits tile: sets the rows per loss chunk (``loss_chunk_rows``). The fused
# cross-entropy over SmolLM2's 49k vocabulary took 4% less time with 512-row chunks (this size) than 256, the
# same with 1024, and a tiny-model train step 1.6x longer with 2048 (400 MB fresh buffers, page-faulted in on
# every use; docs/data_and_benchmarks.md).
LOSS_CHUNK_BYTES = 96 << 20


def loss_chunk_rows(vocab_size: int) -> int:
    """Rows of logits computed at once: a float32 ``[rows, vocab]`` tile of about ``LOSS_CHUNK_BYTES``, a multiple
    of 64 in ``[64, 1024]`` (512 for a 49k vocabulary, 128 for 150k)."""
    rows = LOSS_CHUNK_BYTES // (4 * vocab_size)
    return max(64, min(1024, rows - rows % 64))


def _vocab_size(head: torch.nn.Module) -> int:
    """Output size of the LM head (plain, tied or PEFT-wrapped linear); DeepSpeed ZeRO-3 keeps an empty shard outside
    the head's forward and the full shape as ``ds_shape``."""
    return getattr(head.weight, "ds_shape", head.weight.shape)[0]


def _logit_grad(log_probs: torch.Tensor, targets: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """``d/d logits`` of ``-sum_i scaled[i] * log_probs[i, targets[i]]``: ``softmax * scaled - onehot * scaled``,
    written once (``F.cross_entropy``'s backward writes a zero-filled NLL gradient, then the log-softmax one)."""
    grad = log_probs.exp().mul_(scaled[:, None])
    rows = torch.arange(log_probs.shape[0], device=log_probs.device)
    return grad.index_put_((rows, targets), -scaled, accumulate=True)


class _WeightedCrossEntropy(torch.autograd.Function):
    """``-sum_i weights[i] * log_softmax(logits[i])[targets[i]]`` with a one-pass backward; the chunk's statistics
    go to ``reports`` (``ChunkReports`` or ``None``) from the same log-softmax."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, reports: ChunkReports | None
    ) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        if reports is not None:
            reports.add_log_probs(logits, log_probs, targets, weights)
        ctx.save_for_backward(log_probs, targets, weights)
        return -(log_probs.gather(1, targets[:, None]).squeeze(1) * weights).sum()

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        log_probs, targets, weights = ctx.saved_tensors
        return _logit_grad(log_probs, targets, weights * grad_total), None, None, None


def _linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    softcap: float | None,
    chunk_size: int,
    need_hidden: bool = False,
    need_weight: bool = False,
    metrics: TokenMetrics | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Weighted CE of ``hidden [M, D] @ weight.T [D, V]``, chunk by chunk, and only the gradients asked for.

    Returns the 0-dim float32/64 total, ``d total / d hidden`` ``[M, D]`` (if ``need_hidden``) and
    ``d total / d weight`` ``[V, D]`` in the weight's own dtype (if ``need_weight``). With neither, each chunk
    costs one matmul and no gradient buffer exists (evaluation). ``metrics``: a ``TokenMetrics`` that each chunk
    reports its entropy and top-1 hits to, from the same scores.
    """
    # The head gradient sums its chunks in the parameter's dtype, as per-branch training sums its branches into
    # ``.grad``: bfloat16 weights in place (no float32 [vocab, D] copy), float32 weights under autocast in float32.
    grad_weight_dtype = weight.dtype
    hidden, weight = autocast_inputs(hidden, weight)  # the matmuls in autocast's dtype, as the model's head runs
    with torch.autocast(hidden.device.type, enabled=False):  # explicit dtypes below (and out= matmuls)
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        total = hidden.new_zeros((), dtype=accumulate)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The first chunk overwrites the head gradient (no zero fill); with no rows at all it is zero.
        new_grad = torch.empty if hidden.shape[0] else torch.zeros
        grad_weight = new_grad(weight.shape, dtype=grad_weight_dtype, device=weight.device) if need_weight else None
        # One [rows, vocab] buffer (two for half-precision weights) serves every chunk, and the gradient is written
        # over the scores: fresh buffers of this size are page-faulted in on every use, which cost as much as the
        # log-softmax itself on CPU (docs/data_and_benchmarks.md).
        rows = min(chunk_size, hidden.shape[0])
        logits_buffer = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        in_place = compute_dtype(weight.dtype) == weight.dtype  # else float32 scores beside half-precision logits
        scores_buffer = (
            logits_buffer if in_place else torch.empty_like(logits_buffer, dtype=compute_dtype(weight.dtype))
        )
        # With metrics the exponentials get a buffer of their own: the entropy needs them beside the shifted scores.
        exp_buffer = torch.empty_like(scores_buffer) if metrics is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start : start + chunk_size]
            chunk_targets = targets[start : start + chunk_size, None]
            chunk_weights = weights[start : start + chunk_size, None].to(accumulate)
            logits = torch.matmul(chunk, weight.T, out=logits_buffer[: chunk.shape[0]])
            scores = logits if in_place else scores_buffer[: chunk.shape[0]].copy_(logits)
            capped_tanh = None
            if softcap is not None:
                capped_tanh = scores.div_(softcap).tanh_().clone()
                scores.mul_(softcap)
            # log-sum-exp in place (torch.logsumexp would allocate a shifted copy): exps = exp(scores - max)
            target_scores = scores.gather(1, chunk_targets)
            if metrics is None:
                row_max = scores.amax(dim=-1, keepdim=True)
                exps = scores.sub_(row_max).exp_()
            else:
                row_max, top1 = scores.max(dim=-1, keepdim=True)  # top1: the first maximum, TRL's is_top1
                exps = torch.exp(scores.sub_(row_max), out=exp_buffer[: chunk.shape[0]])
            sum_exp = exps.sum(dim=-1, keepdim=True)
            total += ((row_max + sum_exp.log() - target_scores) * chunk_weights).sum()
            if metrics is not None:
                # TRL's entropy, log Z - sum_v e_v z_v / Z (trl/kernels/chunked_logprob.py), with z - max for z: the
                # terms are all >= 0 (no cancellation). The shifted scores are not needed after this.
                entropy = sum_exp.log() - scores.mul_(exps).sum(dim=-1, keepdim=True) / sum_exp
                metrics.add(entropy[:, 0], top1[:, 0] == chunk_targets[:, 0], weights[start : start + chunk_size])
            if not (need_hidden or need_weight):
                continue
            # d/d scores of the weighted CE: softmax * w - onehot * w, in place over the exponentials.
            grad = exps.mul_(chunk_weights.to(exps.dtype) / sum_exp)
            grad.scatter_add_(1, chunk_targets, -chunk_weights.to(grad.dtype))
            if capped_tanh is not None:
                grad.mul_(capped_tanh.square_().neg_().add_(1))
            if not in_place:
                grad = logits.copy_(grad)  # the weights' dtype for the matmuls
            if need_hidden:
                grad_hidden[start : start + chunk_size] = grad @ weight
            if need_weight:
                first = start == 0
                if grad.dtype == grad_weight.dtype:  # in place: no [vocab, D] temporary per chunk
                    grad_weight.addmm_(grad.T, chunk, beta=0 if first else 1)
                elif first:  # autocast: the matmul in autocast's dtype, summed in the float32 parameter's
                    grad_weight.copy_(grad.T @ chunk)
                else:
                    grad_weight.add_(grad.T @ chunk)
    return total, grad_hidden, grad_weight


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Weighted CE of ``hidden @ weight.T`` whose gradients are computed during forward, chunk by chunk.

    The checkpointed path computes every logit chunk twice (forward, then again in backward) to bound memory;
    with a plain linear head the chunk's gradients can be finished while its logits exist, so each chunk costs
    three matmuls instead of four. Keeps ``[M, D]`` and ``[vocab, D]`` gradients until backward instead, so
    it is only applied when autograd will run backward (``weighted_cross_entropy``).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, softcap, chunk_size, metrics):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        total, grad_hidden, grad_weight = _linear_cross_entropy(
            hidden, weight, targets, weights, softcap, chunk_size, need_hidden, need_weight, metrics
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # A 0-dim float32 factor keeps the gradients' dtype and multiplies in float32 (not rounded to bf16 first).
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total
        if grad_weight is not None:
            grad_weight = grad_weight * grad_total
        return grad_hidden, grad_weight, None, None, None, None, None


def _is_plain_linear(head: torch.nn.Module) -> bool:
    """A bias-free ``nn.Linear`` running ``nn.Linear.forward`` (FSDP2's class swap keeps it; PEFT/LoRA heads,
    quantized linears and accelerate hooks replace forward, so they take the generic path)."""
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and type(head).forward is torch.nn.Linear.forward
        and "forward" not in vars(head)
    )


def _weighted_ce_chunk(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    logit_head: LogitHead,
    reports: ChunkReports | None = None,
) -> torch.Tensor:
    logits = logit_head.logits(head, hidden)  # the model's own hidden -> logits step (hf_tree.models.head)
    return _WeightedCrossEntropy.apply(logits, targets, weights.to(logits.dtype), reports)


class ChunkReports:
    """Where the chunks of one ``chunked_token_loss`` call report their logits (``add_log_probs``): to ``metrics``
    until the call's forward is done (``close``), so a chunk that ``checkpoint`` recomputes in backward reports
    nothing a second time."""

    def __init__(self, metrics: TokenMetrics) -> None:
        self.metrics: TokenMetrics | None = metrics

    def add_log_probs(self, *chunk: torch.Tensor) -> None:
        if self.metrics is not None:
            self.metrics.add_log_probs(*chunk)

    def close(self) -> None:
        self.metrics = None


def chunked_token_loss(
    chunk_loss: Callable[..., torch.Tensor],
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int | None,
    *args: object,
    metrics: TokenMetrics | None = None,
) -> torch.Tensor:
    """``sum`` over row chunks of ``chunk_loss(head, hidden[c], targets[c], weights[c], *args)``, each chunk's
    ``[chunk, vocab]`` logits recomputed in backward (checkpointed), so ``[M, vocab]`` never exists. Returns a 0-dim
    float32 tensor (float64 for float64 hidden states). ``chunk_size``: rows per chunk (None: ``loss_chunk_rows``).
    ``metrics``: a ``TokenMetrics``; each chunk then gets a ``reports=`` argument (``ChunkReports``) whose
    ``add_log_probs`` it calls with its logits and their log-softmax."""
    chunk_size = chunk_size or loss_chunk_rows(_vocab_size(head))
    total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    reports = {} if metrics is None else {"reports": ChunkReports(metrics)}
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        chunk = (hidden[start:end], targets[start:end], weights[start:end])
        total = total + checkpoint(chunk_loss, head, *chunk, *args, use_reentrant=False, **reports)
    if reports:
        reports["reports"].close()
    return total


def weighted_cross_entropy(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    softcap: float | None = None,
    chunk_size: int | None = None,
    scale: float = 1.0,
    metrics: TokenMetrics | None = None,
) -> torch.Tensor:
    """``sum_i weights[i] * CE(logits_i, targets[i])`` without materialising ``[M, vocab]`` logits, where
    ``logits_i = LogitHead(scale, softcap).logits(head, hidden[i])`` (``softcap * tanh(scale * head(h) / softcap)``).

    Args:
        head: the output embedding module (called, so LoRA-wrapped and tied heads work).
        hidden: ``[M, D]`` hidden states of the predicting positions.
        targets: ``[M]`` int64 token ids.
        weights: ``[M]`` per-edge weights (any float dtype; cast to the logits' dtype).
        softcap, scale: the model's final logit softcapping and logit multiplier (``detect_logit_head``).
        chunk_size: rows of logits computed at once (None: ``loss_chunk_rows`` of the vocabulary).
        metrics: a ``hf_tree.token_metrics.TokenMetrics`` that gets TRL's entropy and top-1 statistics of the scored
            edges, from the logits the loss computes (no further head pass); gradients and loss are unchanged.
    """
    logit_head = LogitHead(scale=scale, softcap=softcap)
    if _is_plain_linear(head):
        hidden = head_input(head, hidden)  # LogitHead.logits' cast, for the fused path that reads the weight itself
        chunk_size = chunk_size or loss_chunk_rows(_vocab_size(head))
        # A bias-free linear head is linear in its input: the scale is folded into the hidden states.
        scaled = hidden if scale == 1.0 else hidden * scale
        # The weight is read here, not in the head's forward (ZeRO-3 gathers it for the read); the fused Function
        # finishes its gradients inside, so its backward needs no gathered weight.
        with gathered_head(head):
            if torch.is_grad_enabled() and (scaled.requires_grad or head.weight.requires_grad):
                return _FusedLinearCrossEntropy.apply(
                    scaled, head.weight, targets, weights, softcap, chunk_size, metrics
                )
            # Evaluation: needs_input_grad ignores no_grad, so the Function would still build both gradients.
            return _linear_cross_entropy(scaled, head.weight, targets, weights, softcap, chunk_size, metrics=metrics)[0]
    return chunked_token_loss(
        _weighted_ce_chunk, head, hidden, targets, weights, chunk_size, logit_head, metrics=metrics
    )


@dataclass
class TreeLosses:
    """The losses of one packed tree batch.

    Attributes:
        token: 0-dim weighted cross-entropy (or ``token_loss``) divided by the divisor.
        router: 0-dim MoE load-balancing loss of the batch's branches (``hf_tree.models.router_loss``), ``None``
            when the model computes none.
        router_coef: the model's ``router_aux_loss_coef`` (0.0 without a router loss).
    """

    token: torch.Tensor
    router: torch.Tensor | None = None
    router_coef: float = 0.0

    def model_loss(self) -> torch.Tensor:
        """What the model's own forward returns as ``loss`` on the branches: ``token + coef * router``."""
        return self.token if self.router is None else self.token + self.router_coef * self.router


def tree_losses(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    num_items_in_batch: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    token_loss: Callable[..., torch.Tensor] | None = None,
    self_check: bool | None = None,
    model_inputs: dict[str, object] | None = None,
) -> TreeLosses:
    """The token loss and (MoE models with ``output_router_logits`` and a non-zero ``router_aux_loss_coef``) the
    router load-balancing loss of a packed tree batch; arguments and errors as ``tree_causal_lm_loss``. The router
    loss weights each packed token by ``batch["token_multiplicity"]``, so it is the per-branch batch's."""
    if batch.get(DEPTH_FIRST_KEY):
        raise ValueError(
            f"the batch holds {len(batch[DEPTH_FIRST_KEY])} trees left to depth-first execution (the collator's "
            "tree_execution), which this packed loss would skip. Train with TreeTrainer/TreeSFTTrainer, or call "
            "hf_tree.depth_first.depth_first_backward on them, or set tree_execution='packed'."
        )
    causal_lm, logit_head = checked_tree_model(model, batch["position_ids"], self_check)
    router_coef = router_aux_loss_coef(causal_lm)
    if router_coef and "token_multiplicity" not in batch:
        raise ValueError(
            f"router_aux_loss_coef={router_coef}: the MoE load-balancing loss needs the batch's token_multiplicity "
            "(TreeDataCollator adds it; context parallel shards do not carry it). Set router_aux_loss_coef=0.0 to "
            "train without the router loss."
        )
    if router_coef and model_inputs:
        raise ValueError(
            f"router_aux_loss_coef={router_coef} with image inputs: the MoE router loss of vision-language trees is "
            "not tested yet. Set router_aux_loss_coef=0.0 (or config.output_router_logits=False) for image trees."
        )
    router_inputs = {"output_router_logits": True} if router_coef else {}

    def score(_outputs) -> torch.Tensor:
        hidden = captured["hidden"]  # the backbone's last hidden state: what detect_logit_head verified
        gathered = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["loss_positions"])
        return score_hidden_states(
            causal_lm, logit_head, gathered, batch["loss_targets"], batch["loss_weights"], token_loss, chunk_size
        )

    with capture_last_hidden_state(causal_lm) as captured:
        # model_inputs may replace the rows' own (e.g. mRoPE positions and image features of a vision tree)
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"])
        outputs, total = forward_then_score(
            model,
            causal_lm,
            score,
            **inputs | (model_inputs or {}),
            use_cache=False,
            logits_to_keep=1,  # the tree loss applies the head itself, to the gathered positions only
            **router_inputs,
        )
    divisor = batch["num_loss_items"] if num_items_in_batch is None else num_items_in_batch
    losses = TreeLosses(token=divide_by_items(total, divisor), router_coef=router_coef)
    if router_coef:
        losses.router = tree_router_loss(causal_lm, outputs.router_logits, batch["token_multiplicity"].reshape(-1))
    return losses


def checked_tree_model(
    model: torch.nn.Module, position_ids: torch.Tensor, self_check: bool | None
) -> tuple[PreTrainedModel, LogitHead]:
    """The causal LM inside ``model`` and its ``LogitHead``, after every check a tree forward needs: the model is on
    ``tree_flash``, ``position_ids`` (depths) stay within its RoPE length switches, and ``check_model_for_trees``.

    Raises:
        ValueError: see ``tree_causal_lm_loss``.
    """
    config = extract_model_from_parallel(model).config
    if config._attn_implementation != TREE_ATTENTION_NAME:
        refuse_not_tree_aware(causal_lm_of(model))  # a family refused by name: say why, not "load it with tree_flash"
        raise ValueError(
            f"the model uses attn_implementation={config._attn_implementation!r}, which ignores kv_end and "
            f"would let sibling branches see each other. Load it with attn_implementation="
            f"'{TREE_ATTENTION_NAME}' or call model.set_attn_implementation('{TREE_ATTENTION_NAME}')."
        )
    check_rope_lengths(config, position_ids)
    logit_head = check_model_for_trees(model, self_check)
    return causal_lm_of(model), logit_head


def score_hidden_states(
    causal_lm: PreTrainedModel,
    logit_head: LogitHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    token_loss: Callable[..., torch.Tensor] | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``sum_i weights[i] * loss(head(hidden[i]), targets[i])`` (0-dim) with the model's own head: ``hidden [M, D]``,
    ``targets [M]`` int64, ``weights [M]``; ``token_loss`` defaults to ``weighted_cross_entropy``."""
    return (token_loss or weighted_cross_entropy)(
        causal_lm.get_output_embeddings(),
        hidden,
        targets,
        weights,
        softcap=logit_head.softcap,
        chunk_size=chunk_size,
        scale=logit_head.scale,
    )


def divide_by_items(total: torch.Tensor, divisor: torch.Tensor | float) -> torch.Tensor:
    """``total / divisor`` in ``total``'s dtype and device (a zero divisor leaves ``total``, which is then zero)."""
    divisor = torch.as_tensor(divisor, device=total.device, dtype=total.dtype)
    return total / divisor.clamp_min(torch.finfo(total.dtype).tiny)


def tree_causal_lm_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    num_items_in_batch: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    token_loss: Callable[..., torch.Tensor] | None = None,
    self_check: bool | None = None,
    model_inputs: dict[str, object] | None = None,
) -> torch.Tensor:
    """Weighted CE of a packed tree batch (from ``TreeDataCollator``), as a 0-dim tensor; for an MoE model whose
    forward adds its router load-balancing loss (``output_router_logits`` with a non-zero
    ``router_aux_loss_coef``), plus ``router_aux_loss_coef`` times that loss over the batch's branches, as the
    model's own ``loss`` on the branches (``TreeLosses.model_loss``).

    Args:
        model: a causal LM loaded with ``attn_implementation="tree_flash"`` (may be PEFT-, DDP- or
            FSDP-wrapped).
        batch: ``input_ids``, ``position_ids``, ``kv_end`` ``[B, N]`` and the loss gather tensors
            (``token_multiplicity`` ``[B, N]`` too for a router loss).
        num_items_in_batch: the divisor for the whole optimizer step (sum of weights, or trained
            branches for ``"sequence"``) across accumulation steps and ranks; defaults to the batch's
            own ``num_loss_items``.
        chunk_size: rows of logits computed at once (None: ``loss_chunk_rows`` of the vocabulary).
        token_loss: replaces ``weighted_cross_entropy`` (same arguments), e.g. the DFT or label-smoothed losses
            of ``hf_tree.sft_losses``.
        self_check: before the model's first tree batch, refuse known non-tree-aware models and probe the real
            model with a tiny tree against its branches run alone (``hf_tree.models.check``; once per model
            instance). ``None``: on unless ``HF_TREE_SELF_CHECK=0``.
        model_inputs: further model inputs of the batch, e.g. the images of a vision-language tree
            (``hf_tree.batch_inputs.batch_model_inputs``).

    Raises:
        ValueError: a model not on ``tree_flash``, one the self-check finds not tree-exact, a batch whose longest
            branch crosses a length switch of the model's RoPE (``hf_tree.models.length_rope``), a router loss the
            tree cannot weight (``hf_tree.models.router_loss``), or a batch holding trees left to depth-first
            execution (``hf_tree.depth_first``).
    """
    return tree_losses(model, batch, num_items_in_batch, chunk_size, token_loss, self_check, model_inputs).model_loss()
