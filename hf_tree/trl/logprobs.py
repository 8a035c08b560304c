"""Per-token log-probs of many completions that share prompts, each shared prefix computed once.

TRL's GRPO and DPO trainers score padded ``[B, T]`` batches through a *fused LM head*
(``trl.trainer.utils.add_fused_lm_head``): ``model(input_ids, attention_mask, labels=labels, fused_lm_head=True)``
returns per-token ``log_probs`` (and entropies, ...) of every label that is not ``-100``, in the shifted ``[B, T - 1]``
layout. Rows of a GRPO group (or a DPO pair) repeat the same prompt, so that forward recomputes every prompt once per
row.

``hf_tree.trl.glue.add_tree_fused_lm_head`` installs a fused head with the same contract that instead

1. strips each row's padding, merges the rows into tries (``Tree.from_sequences``: identical prompts, and any other
   shared prefix, become one node; rows are grouped by their tokens, never by their position in the batch),
2. packs the tries into rows (``pack_and_place``) and runs the backbone once on them with the tree mask
   (``kv_end``) and depth positions,
3. gathers the hidden state that predicts each scored token (the last prompt token predicts the first token of every
   completion), applies TRL's own chunked log-prob kernel to those states only (same temperature, softcapping and
   float32 statistics as TRL), and scatters the values back to ``[B, T - 1]``.

Values equal TRL's up to rounding (tests compare in float64), and gradients flow through the gather. Positions are
depths, as each row would have alone without padding (and as ``generate`` numbers a left-padded prompt); TRL's
forward numbers left-padded rows from the padding, which rotary models do not see (only position differences enter
attention). Models with absolute position embeddings would therefore get different (padding-free) values than TRL's.

This module is the layout and the kernel; the TRL glue (the fused-head installer, the config fields and helpers of
``TreeGRPOTrainer``/``TreeDPOTrainer``) is ``hf_tree.trl.glue``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from hf_tree.models.head import LogitHead, detect_logit_head, gathered_head
from hf_tree.models.introspection import backbone_of
from hf_tree.models.length_rope import check_rope_lengths
from hf_tree.models.router_loss import tree_router_loss
from hf_tree.packing import PackingStats, pack_and_place
from hf_tree.tree import Tree
from hf_tree.trl.compat import chunked_log_prob_values

# Vocabulary tile of TRL's fused head (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``): the same tiling keeps the
# float32 online-logsumexp of the kernel bit-compatible with TRL's.
VOCAB_CHUNK_SIZE = 32768
FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
ModelInputs = Callable[[dict[str, torch.Tensor]], dict[str, object]]


@dataclass
class ScoredLayout:
    """Where each scored token of a padded ``[B, T]`` batch is computed in the packed tree rows.

    Attributes:
        batch: ``input_ids``, ``position_ids`` ``[R, N]`` int64 and ``kv_end`` ``[R, N]`` int32 (``pack_and_place``).
        predictor_index: ``[M]`` int64, flat index into ``R * N`` of the hidden state that predicts each scored
            token, ascending (so each chunk of rows owns one contiguous range of it).
        targets: ``[M]`` int64, the scored token ids (the labels).
        output_index: ``[M]`` int64, flat index into ``B * (T - 1)``: TRL's shifted layout, where column ``j``
            holds the label at column ``j + 1``.
        output_shape: ``(B, T - 1)``.
        stats: packing statistics; ``stats.dedup_ratio`` = branch tokens / packed tokens.
        router_weights: ``[C, R * N]`` float32, for an MoE router loss: how many rows of each of ``C`` row chunks
            (TRL's forward chunks) contain each packed token (``hf_tree.models.router_loss``); ``None`` without one.
    """

    batch: dict[str, torch.Tensor]
    predictor_index: torch.Tensor
    targets: torch.Tensor
    output_index: torch.Tensor
    output_shape: tuple[int, int]
    stats: PackingStats
    router_weights: torch.Tensor | None = None

    @property
    def num_scored(self) -> int:
        return int(self.targets.numel())


def pack_rows(
    sequences: dict[int, list[int]], max_packed_tokens: int, merge: bool = True
) -> tuple[dict[str, torch.Tensor], PackingStats, dict[int, np.ndarray]]:
    """Merge rows into tries (rows are grouped by their tokens: one trie per first token) and pack them.

    Args:
        sequences: row -> its real tokens (non-empty).
        max_packed_tokens: capacity of a packed row; a tree larger than this is split by its branches (exact).
        merge: ``False`` packs every row as a tree of its own (``merge_in_batch=False``: nothing shared).

    Returns:
        The packed batch (``pack_and_place``: ``input_ids``, ``position_ids``, ``kv_end`` ``[R, N]``, ...), its
        statistics, and row -> ``[len(tokens)]`` int64 flat indices into ``R * N`` of the row's tokens.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for row, tokens in sequences.items():
        groups[tokens[0] if merge else row].append(row)
    trees = [Tree.from_sequences([sequences[r] for r in rows], branch_fields={"row": rows}) for rows in groups.values()]
    batch, stats, parts, placements = pack_and_place(trees, max_packed_tokens)
    row_length = batch["input_ids"].shape[1]
    token_index = {}
    for part, (packed_row, offset) in zip(parts, placements):
        for branch, row in enumerate(part.branch_fields["row"]):
            token_index[row] = packed_row * row_length + offset + part.branch_flat_indices(branch)
    return batch, stats, token_index


def layout_scored_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    max_packed_tokens: int,
    router_chunk_rows: int | None = None,
    merge: bool = True,
) -> ScoredLayout:
    """Merge the rows of a padded batch into trees and pack them, keeping track of every scored token.

    Args:
        input_ids: ``[B, T]`` token ids, padded on either side.
        attention_mask: ``[B, T]``, 1 on real tokens (one contiguous run per row), or ``None`` for no padding.
        labels: ``[B, T]``, the token to score at each column or ``-100``; column ``j`` is predicted from the hidden
            state at column ``j - 1``, as in TRL's fused head.
        max_packed_tokens: capacity of a packed row; a tree larger than this is split by its branches (exact).
        router_chunk_rows: for an MoE router loss, the rows of each of TRL's forward chunks: every row's real tokens
            are packed (scored or not, as TRL's router loss counts them) and ``router_weights`` counts, per chunk,
            the rows that contain each packed token. ``None``: rows are packed up to their last scored token.
        merge: ``False``: every row a tree of its own (``pack_rows``).

    Raises:
        ValueError: when a row's real tokens are not one contiguous run, a scored token lies outside it or is its
            first token (it would be predicted from padding), or a row is longer than ``max_packed_tokens``.
    """
    ids = input_ids.detach().cpu().numpy()
    real = np.ones(ids.shape, dtype=bool) if attention_mask is None else attention_mask.detach().cpu().numpy() != 0
    shifted_labels = labels[:, 1:].detach().cpu().numpy()
    batch_size, width = ids.shape

    sequences: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    scored_columns: dict[int, np.ndarray] = {}
    for row in range(batch_size):
        columns = np.nonzero(shifted_labels[row] != -100)[0] + 1
        run = np.nonzero(real[row])[0]
        if columns.size == 0 and (router_chunk_rows is None or run.size == 0):
            continue
        start, end = (int(run[0]), int(run[-1]) + 1) if run.size else (0, 0)
        if run.size != end - start:
            raise ValueError(
                f"row {row}: attention_mask is not one contiguous run of real tokens; hf_tree's tree log-probs "
                "support left-padded prompts and right-padded completions (set tree_forward=False otherwise)."
            )
        if columns.size and (columns[0] <= start or columns[-1] >= end):
            raise ValueError(
                f"row {row}: the scored token at column {int(columns[0] if columns[0] <= start else columns[-1])} "
                f"is outside the row's real tokens [{start + 1}, {end}) that have a real predecessor: it would be "
                "predicted from padding. Check the attention mask and labels."
            )
        stop = end if router_chunk_rows is not None else int(columns[-1]) + 1
        if stop - start > max_packed_tokens:
            raise ValueError(
                f"row {row} has {stop - start} tokens, more than max_packed_tokens={max_packed_tokens}: a row must "
                "fit in one packed row. Raise max_packed_tokens."
            )
        sequences[row] = ids[row, start:stop].tolist()
        starts[row], scored_columns[row] = start, columns

    batch, stats, token_index = pack_rows(sequences, max_packed_tokens, merge)
    router_weights = None
    if router_chunk_rows is not None:  # every row's real tokens, scored or not, count in TRL's router loss
        router_weights = torch.zeros(-(-batch_size // router_chunk_rows), batch["input_ids"].numel())
        for row, index in token_index.items():
            router_weights[row // router_chunk_rows, torch.from_numpy(index)] += 1
    predictors, targets, outputs = [], [], []
    for row, columns in scored_columns.items():
        predictors.append(token_index[row][columns - 1 - starts[row]])  # the token before each scored one
        targets.append(shifted_labels[row, columns - 1])
        outputs.append(row * (width - 1) + columns - 1)
    predictor_index = np.concatenate(predictors) if predictors else np.zeros(0, dtype=np.int64)
    order = np.argsort(predictor_index, kind="stable")

    def tensor(chunks: list[np.ndarray]) -> torch.Tensor:
        flat = np.concatenate(chunks)[order] if chunks else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(flat.astype(np.int64))

    return ScoredLayout(
        batch={k: batch[k] for k in ("input_ids", "position_ids", "kv_end")},
        predictor_index=tensor(predictors),
        targets=tensor(targets),
        output_index=tensor(outputs),
        output_shape=(batch_size, width - 1),
        stats=stats,
        router_weights=router_weights,
    )


def backbone_hidden_states(
    model: PreTrainedModel,
    batch: dict[str, torch.Tensor],
    router_logits: list | None = None,
    model_inputs: ModelInputs | None = None,
) -> torch.Tensor:
    """``[R * N, D]`` last hidden states of packed tree rows: what the LM head reads (``detect_logit_head`` checked
    that the model's logits are ``LogitHead.logits`` of exactly this tensor), and what a sequence-classification
    model's ``score`` head reads (``hf_tree.trl.reward_head``). With a ``router_logits`` list, the backbone's router
    logits (one ``[R * N, E]`` tensor per MoE layer) are appended to it; ``model_inputs`` builds the backbone's
    inputs from the rows (e.g. with their images, ``hf_tree.vision.rows``)."""
    check_rope_lengths(model.config, batch["position_ids"])
    inputs = model_inputs(batch) if model_inputs is not None else batch
    router_inputs = {} if router_logits is None else {"output_router_logits": True}
    outputs = backbone_of(model)(**inputs, use_cache=False, **router_inputs)
    if router_logits is not None:
        router_logits.append(outputs.router_logits)
    hidden = outputs.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def tree_token_log_probs(
    model: PreTrainedModel,
    layout: ScoredLayout,
    temperature: float = 1.0,
    outputs: Sequence[str] = ("log_probs",),
    tokens_per_forward: int | None = None,
    cast_lm_head_to_fp32: bool = False,
    logit_head: LogitHead | None = None,
    model_inputs: ModelInputs | None = None,
) -> dict[str, torch.Tensor]:
    """Run the backbone on the packed rows and TRL's chunked log-prob kernel on the predicting states.

    Args:
        model: the causal LM (``tree_flash``); called inside its own (patched) forward, so DDP/FSDP/PEFT hooks of
            the outer call are in effect.
        layout: from ``layout_scored_rows`` (CPU tensors; moved to the model's device here).
        temperature: logits are divided by it (TRL's ``temperature``).
        outputs: fields among ``FUSED_OUTPUTS`` to compute (``log_probs`` always).
        tokens_per_forward: packed tokens per backbone call (bounds activation memory); ``None``: all rows at once.
        cast_lm_head_to_fp32: run the head in float32 outside autocast, as TRL's option of that name.
        logit_head: the model's scale and softcap (``check_model_for_trees``; detected here when ``None``).
        model_inputs: builds the backbone's inputs from a chunk of packed rows (``input_ids``, ``position_ids``,
            ``kv_end``), e.g. ``hf_tree.vision.rows.RowMedia.model_inputs`` (images); ``None``: the rows themselves.

    Returns:
        ``{field: [M]}`` in the order of ``layout.predictor_index`` (float32; ``is_top1`` bool); with
        ``layout.router_weights``, also ``aux_loss``: the 0-dim router load-balancing loss of the padded batch (the
        mean over its row chunks, ``hf_tree.models.router_loss``).
    """
    if logit_head is None:
        logit_head = detect_logit_head(model)
    predicting, aux_loss = predicting_states(model, layout, tokens_per_forward, model_inputs)
    values = fused_head_values(
        model, predicting, layout.targets, temperature, outputs, cast_lm_head_to_fp32, logit_head
    )
    if aux_loss is not None:
        values["aux_loss"] = aux_loss
    return values


def tree_logits(
    model: PreTrainedModel,
    layout: ScoredLayout,
    logit_head: LogitHead,
    tokens_per_forward: int | None = None,
    model_inputs: ModelInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's logits of the padded batch, computed on the packed rows: ``[B, T, vocab]``, column ``j`` of a row
    the logits that predict its column ``j + 1`` where that is scored in ``layout``, zeros elsewhere (float32 for a
    half-precision model, ``LogitHead.logits``); differentiable through the gather. With ``layout.router_weights``,
    also the router loss (else ``None``). Arguments as ``tree_token_log_probs``."""
    predicting, aux_loss = predicting_states(model, layout, tokens_per_forward, model_inputs)
    head = model.get_output_embeddings()  # read after the backbone ran (FSDP2, see fused_head_values)
    with gathered_head(head):
        logits = logit_head.logits(head, predicting)
    batch_size, shifted = layout.output_shape
    # TRL's shifted [B, T - 1] index -> the [B, T] rows: row * (T - 1) + column -> row * T + column
    index = layout.output_index.to(logits.device)
    rows = logits.new_zeros(batch_size * (shifted + 1), logits.shape[-1]).index_copy(
        0, index + index // shifted, logits
    )
    return rows.view(batch_size, shifted + 1, -1), aux_loss


def predicting_states(
    model: PreTrainedModel,
    layout: ScoredLayout,
    tokens_per_forward: int | None = None,
    model_inputs: ModelInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backbone on the packed rows of ``layout``, in chunks of ``tokens_per_forward`` tokens: ``[M, D]`` hidden
    states that predict each scored token (in ``layout.predictor_index`` order) and, with ``layout.router_weights``,
    the 0-dim router loss of the padded batch (else ``None``). Arguments as ``tree_token_log_probs``."""
    device = model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in layout.batch.items()}
    num_rows, row_length = batch["input_ids"].shape
    rows_per_forward = num_rows if tokens_per_forward is None else max(1, tokens_per_forward // row_length)
    # Rows [r0, r1) own the scored tokens [lo, hi) of the ascending predictor index.
    row_starts = np.arange(0, num_rows + rows_per_forward, rows_per_forward).clip(max=num_rows)
    bounds = np.searchsorted(layout.predictor_index.numpy(), row_starts * row_length).tolist()
    predictor_index = layout.predictor_index.to(device)
    router_logits = None if layout.router_weights is None else []
    predicting = []  # [M, D] in chunks: the hidden state that predicts each scored token
    for r0, r1, lo, hi in zip(row_starts[:-1], row_starts[1:], bounds[:-1], bounds[1:]):
        chunk = {k: v[r0:r1] for k, v in batch.items()}
        hidden = backbone_hidden_states(model, chunk, router_logits, model_inputs)
        predicting.append(hidden.index_select(0, predictor_index[lo:hi] - int(r0) * row_length))
    aux_loss = None
    if router_logits is not None:  # the loss is a product of batch means: over all forwards' logits at once
        whole = tuple(torch.cat(layer) for layer in zip(*router_logits))
        aux_loss = tree_router_loss(model, whole, layout.router_weights)
    return torch.cat(predicting), aux_loss


def fused_head_values(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    outputs: Sequence[str],
    cast_lm_head_to_fp32: bool,
    logit_head: LogitHead,
) -> dict[str, torch.Tensor]:
    """TRL's chunked log-prob kernel on ``hidden [M, D]``, the states that predict ``targets [M]``, through the
    model's head: ``{field: [M]}`` for ``outputs`` (``log_probs`` always; arguments as ``tree_token_log_probs``)."""
    # The head is read after the backbone ran, as TRL's head does: under FSDP2 the root's parameters (the head among
    # them) are unsharded by then; read before, they can still be the sharded DTensors of the previous micro-batch.
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards the head; the kernel needs it whole (as in TRL's head)
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    hidden, targets = hidden.to(weight.device), targets.to(weight.device)
    autocast = nullcontext()
    if cast_lm_head_to_fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    kernel_outputs = tuple(name for name in FUSED_OUTPUTS if name in outputs or name == "log_probs")
    # One kernel call for all rows: the head's gradient then arrives in one piece, as from TRL's head (FSDP2
    # reduce-scatters the root's parameters once; a second piece arriving later stayed local to each rank). Under
    # ZeRO-3 the head is gathered for the call, as TRL's head does (the kernel gathers it again in its backward).
    with autocast, gathered_head(head):
        kernel_values = chunked_log_prob_values(
            hidden,
            weight,
            bias,
            targets,
            temperature,
            VOCAB_CHUNK_SIZE,
            logit_head.softcap,
            logit_head.scale,
            kernel_outputs,
        )
    return {name: value for name, value in zip(FUSED_OUTPUTS, kernel_values) if value is not None}


def scatter_to_rows(values: torch.Tensor, output_index: torch.Tensor, output_shape: tuple[int, int]) -> torch.Tensor:
    """``[M]`` values -> ``output_shape`` (TRL's shifted ``[B, T - 1]``; zeros where nothing is scored),
    differentiable; ``output_index [M]``: flat positions (``ScoredLayout.output_index``)."""
    flat = values.new_zeros(output_shape[0] * output_shape[1])
    return flat.index_copy(0, output_index.to(values.device), values).view(output_shape)
