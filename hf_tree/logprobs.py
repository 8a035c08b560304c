"""Per-token log-probs of many completions that share prompts, each shared prefix computed once.

TRL's GRPO and DPO trainers score padded ``[B, T]`` batches through a *fused LM head*
(``trl.trainer.utils.add_fused_lm_head``): ``model(input_ids, attention_mask, labels=labels, fused_lm_head=True)``
returns per-token ``log_probs`` (and entropies, ...) of every label that is not ``-100``, in the shifted ``[B, T - 1]``
layout. Rows of a GRPO group (or a DPO pair) repeat the same prompt, so that forward recomputes every prompt once per
row.

``add_tree_fused_lm_head`` installs a fused head with the same contract that instead

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
"""

from __future__ import annotations

import functools
import types
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import FusedCausalLMOutput, get_config_model_id

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.head import LogitHead, backbone_of, detect_logit_head
from hf_tree.model_check import check_model_for_trees, tree_self_check_field
from hf_tree.packing import PackingStats, pack_and_place
from hf_tree.trainer import tree_model_init_kwargs, use_tree_attention
from hf_tree.tree import Tree
from hf_tree.versions import require_tested_trl

require_tested_trl()  # TRL internals below (ChunkedLogProbFunction, FusedCausalLMOutput) change between minors
# Vocabulary tile of TRL's fused head (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``): the same tiling keeps the
# float32 online-logsumexp of the kernel bit-compatible with TRL's.
VOCAB_CHUNK_SIZE = 32768
FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Inputs of a fused-head call that are ignored (``None`` values, e.g. from PEFT's forward, are ignored too).
IGNORED_INPUTS = ("use_cache", "return_dict")


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
    """

    batch: dict[str, torch.Tensor]
    predictor_index: torch.Tensor
    targets: torch.Tensor
    output_index: torch.Tensor
    output_shape: tuple[int, int]
    stats: PackingStats

    @property
    def num_scored(self) -> int:
        return int(self.targets.numel())


def layout_scored_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    max_packed_tokens: int,
) -> ScoredLayout:
    """Merge the rows of a padded batch into trees and pack them, keeping track of every scored token.

    Args:
        input_ids: ``[B, T]`` token ids, padded on either side.
        attention_mask: ``[B, T]``, 1 on real tokens (one contiguous run per row), or ``None`` for no padding.
        labels: ``[B, T]``, the token to score at each column or ``-100``; column ``j`` is predicted from the hidden
            state at column ``j - 1``, as in TRL's fused head.
        max_packed_tokens: capacity of a packed row; a tree larger than this is split by its branches (exact).

    Raises:
        ValueError: when a row's real tokens are not one contiguous run, a scored token lies outside it or is its
            first token (it would be predicted from padding), or a row is longer than ``max_packed_tokens``.
    """
    ids = input_ids.detach().cpu().numpy()
    real = np.ones(ids.shape, dtype=bool) if attention_mask is None else attention_mask.detach().cpu().numpy() != 0
    shifted_labels = labels[:, 1:].detach().cpu().numpy()
    batch_size, width = ids.shape

    groups: dict[int, list[int]] = defaultdict(list)  # first token -> rows: one trie per root token
    sequences: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    scored_columns: dict[int, np.ndarray] = {}
    for row in range(batch_size):
        columns = np.nonzero(shifted_labels[row] != -100)[0] + 1
        if columns.size == 0:
            continue
        run = np.nonzero(real[row])[0]
        start, end = (int(run[0]), int(run[-1]) + 1) if run.size else (0, 0)
        if run.size != end - start:
            raise ValueError(
                f"row {row}: attention_mask is not one contiguous run of real tokens; hf_tree's tree log-probs "
                "support left-padded prompts and right-padded completions (set tree_logprobs=False otherwise)."
            )
        if columns[0] <= start or columns[-1] >= end:
            raise ValueError(
                f"row {row}: the scored token at column {int(columns[0] if columns[0] <= start else columns[-1])} "
                f"is outside the row's real tokens [{start + 1}, {end}) that have a real predecessor: it would be "
                "predicted from padding. Check the attention mask and labels."
            )
        if columns[-1] + 1 - start > max_packed_tokens:
            raise ValueError(
                f"row {row} has {int(columns[-1] + 1 - start)} tokens, more than max_packed_tokens="
                f"{max_packed_tokens}: a row must fit in one packed row. Raise max_packed_tokens."
            )
        sequences[row] = ids[row, start : columns[-1] + 1].tolist()
        starts[row], scored_columns[row] = start, columns
        groups[sequences[row][0]].append(row)

    trees = [Tree.from_sequences([sequences[r] for r in rows], branch_fields={"row": rows}) for rows in groups.values()]
    batch, stats, parts, placements = pack_and_place(trees, max_packed_tokens)
    row_length = batch["input_ids"].shape[1]

    predictors, targets, outputs = [], [], []
    for part, (packed_row, offset) in zip(parts, placements):
        base = packed_row * row_length + offset
        for branch, row in enumerate(part.branch_fields["row"]):
            columns = scored_columns[row]
            flat = part.branch_flat_indices(branch)
            predictors.append(base + flat[columns - 1 - starts[row]])  # the token before each scored one
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
    )


def check_tree_model(model: PreTrainedModel, name: str = "model") -> None:
    """Raise ``ValueError`` unless ``model`` can run the tree fused head (a text causal LM on ``tree_flash``).

    How its logits are scored (scale, softcap, or a refusal) and the tree self-check are decided on the first call
    (``hf_tree.model_check.check_model_for_trees``), on the device the model then runs on."""
    config = model.config
    if config._attn_implementation != TREE_ATTENTION_NAME:
        raise ValueError(
            f"{name} uses attn_implementation={config._attn_implementation!r}, which ignores the tree mask. Load it "
            f"with attn_implementation='{TREE_ATTENTION_NAME}' (after `import hf_tree`; without kv_end it is exactly "
            f"sdpa, so generation is unchanged), e.g. model_init_kwargs={{'attn_implementation': "
            f"'{TREE_ATTENTION_NAME}'}}, or call {name}.set_attn_implementation('{TREE_ATTENTION_NAME}')."
        )
    if config.get_text_config() is not config:
        raise ValueError(
            f"{name} is a {type(model).__name__} with a separate text config (a vision-language model); tree "
            "log-probs support text-only causal LMs. Set tree_logprobs=False."
        )


def _backbone_hidden_states(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[R * N, D]`` last hidden states of packed tree rows (what the LM head reads; ``detect_logit_head`` checked
    that the model's logits are ``LogitHead.logits`` of exactly this tensor)."""
    outputs = backbone_of(model)(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], kv_end=batch["kv_end"], use_cache=False
    )
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

    Returns:
        ``{field: [M]}`` in the order of ``layout.predictor_index`` (float32; ``is_top1`` bool).
    """
    device = model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in layout.batch.items()}
    num_rows, row_length = batch["input_ids"].shape
    rows_per_forward = num_rows if tokens_per_forward is None else max(1, tokens_per_forward // row_length)
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards the head; the kernel needs it whole (as in TRL's head)
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    if logit_head is None:
        logit_head = detect_logit_head(model)
    kernel_outputs = tuple(name for name in FUSED_OUTPUTS if name in outputs or name == "log_probs")
    # Rows [r0, r1) own the scored tokens [lo, hi) of the ascending predictor index.
    row_starts = np.arange(0, num_rows + rows_per_forward, rows_per_forward).clip(max=num_rows)
    bounds = np.searchsorted(layout.predictor_index.numpy(), row_starts * row_length).tolist()
    predictor_index = layout.predictor_index.to(weight.device)
    targets = layout.targets.to(weight.device)

    results: dict[str, list[torch.Tensor]] = defaultdict(list)
    for r0, r1, lo, hi in zip(row_starts[:-1], row_starts[1:], bounds[:-1], bounds[1:]):  # every row scores tokens
        hidden = _backbone_hidden_states(model, {k: v[r0:r1] for k, v in batch.items()}).to(weight.device)
        hidden = hidden.index_select(0, predictor_index[lo:hi] - int(r0) * row_length)
        autocast = nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            values = ChunkedLogProbFunction.apply(
                hidden,
                weight,
                bias,
                targets[lo:hi],
                temperature,
                VOCAB_CHUNK_SIZE,
                logit_head.softcap,
                logit_head.scale,
                kernel_outputs,
            )
        for name, value in zip(FUSED_OUTPUTS, values):
            if value is not None:
                results[name].append(value)
    return {name: torch.cat(chunks) for name, chunks in results.items()}


def scatter_to_rows(values: torch.Tensor, layout: ScoredLayout) -> torch.Tensor:
    """``[M]`` values -> ``[B, T - 1]`` (zeros where nothing is scored), differentiable."""
    size = layout.output_shape[0] * layout.output_shape[1]
    flat = values.new_zeros(size).index_copy(0, layout.output_index.to(values.device), values)
    return flat.view(layout.output_shape)


def _tree_fused_call(
    model: PreTrainedModel,
    settings: dict[str, Any],
    previous_forward: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    tokens_per_forward: int | None,
    other_inputs: dict[str, Any],
) -> FusedCausalLMOutput:
    unsupported = sorted(k for k, v in other_inputs.items() if v is not None and v is not False)
    if unsupported:
        raise ValueError(
            f"the tree log-prob head got model inputs {unsupported} it does not support (it handles text input_ids, "
            "attention_mask and labels; no vision inputs, position_ids, shift_labels or MoE router losses). Set "
            "tree_logprobs=False to use TRL's own forward."
        )
    if labels is None:
        raise ValueError("fused_lm_head=True needs labels (-100 where no token is scored).")
    # First call: refuse models the tree passes would get wrong; the original forward, not the model, runs the probe
    # (calling the model again inside its own forward would rerun FSDP's root hooks).
    logit_head = check_model_for_trees(model, settings["self_check"], forward=previous_forward)
    tokens_per_forward = tokens_per_forward or input_ids.numel()
    layout = layout_scored_rows(input_ids, attention_mask, labels, settings["max_packed_tokens"] or tokens_per_forward)
    if layout.num_scored == 0:  # nothing to score: TRL's forward keeps the zero output connected to the model
        model.hf_tree_layout_stats = None  # nothing packed: no (stale) ratio to log for this call
        return previous_forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    values = tree_token_log_probs(
        model,
        layout,
        settings["temperature"],
        settings["outputs"],
        tokens_per_forward,
        settings["cast_lm_head_to_fp32"],
        logit_head,
    )
    per_token = {name: scatter_to_rows(value, layout) for name, value in values.items()}
    label_mask = labels[:, 1:] != -100
    divisor = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    model.hf_tree_layout_stats = layout.stats  # the last call's packing, for the trainers' logs
    return FusedCausalLMOutput(loss=-per_token["log_probs"].sum() / divisor, label_mask=label_mask, **per_token)


def add_tree_fused_lm_head(
    model: PreTrainedModel,
    temperature: float = 1.0,
    outputs: Sequence[str] = ("log_probs",),
    max_packed_tokens: int | None = None,
    cast_lm_head_to_fp32: bool = False,
    name: str = "model",
    self_check: bool | None = None,
) -> None:
    """Replace the fused head that TRL's ``add_fused_lm_head`` installed on ``model`` by the tree one.

    ``model(..., labels=labels, fused_lm_head=True)`` then returns a ``FusedCausalLMOutput`` with the same fields
    and layout as TRL's, computed on packed trees; it also accepts ``tree_tokens_per_forward=`` (packed tokens per
    backbone call, default ``B * T``). Without ``fused_lm_head`` the previous forward runs (generation is
    unchanged). Calling it again replaces the settings.

    Args:
        model: the causal LM (the base model of a PEFT model), loaded with ``attn_implementation="tree_flash"``.
        temperature, cast_lm_head_to_fp32: as given to TRL's ``add_fused_lm_head`` for this model.
        outputs: per-token fields to compute, among ``FUSED_OUTPUTS``.
        max_packed_tokens: packed row capacity; ``None``: the call's tokens per forward.
        name: how errors refer to the model.
        self_check: run ``hf_tree.model_check``'s refusals and probe before the first tree pass (``None``: on
            unless ``HF_TREE_SELF_CHECK=0``).
    """
    check_tree_model(model, name)
    unknown = sorted(set(outputs) - set(FUSED_OUTPUTS))
    if unknown:
        raise ValueError(f"outputs={tuple(outputs)!r} holds unknown fields {unknown}; choose among {FUSED_OUTPUTS}.")
    settings = dict(
        temperature=temperature,
        outputs=tuple(outputs),
        max_packed_tokens=max_packed_tokens,
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        self_check=self_check,
    )
    previous_forward = getattr(model, "hf_tree_previous_forward", None) or model.forward

    @functools.wraps(type(model).forward)  # keep the signature: generate() validates its kwargs against it
    def forward(
        self: PreTrainedModel,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        tree_tokens_per_forward: int | None = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            for key, value in (("labels", labels), ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[key] = value
            return previous_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        for key in IGNORED_INPUTS:
            kwargs.pop(key, None)
        return _tree_fused_call(
            self,
            settings,
            previous_forward,
            input_ids,
            attention_mask,
            labels,
            num_items_in_batch,
            tree_tokens_per_forward,
            kwargs,
        )

    model.forward = types.MethodType(forward, model)
    model.hf_tree_previous_forward = previous_forward


# ---------------------------------------------------------------- shared by TreeGRPOTrainer and TreeDPOTrainer
@dataclass
class TreeLogProbArguments:
    """Tree fields of ``TreeGRPOConfig`` and ``TreeDPOConfig`` (a mixin placed before the TRL config in the bases).

    With ``tree_logprobs=True``, a model given by name is loaded with ``attn_implementation="tree_flash"`` unless
    ``model_init_kwargs`` names another (which then fails with a clear error).
    """

    tree_logprobs: bool = field(
        default=True,
        metadata={
            "help": "Compute the log-prob passes (policy and reference; old policy in GRPO) on packed prompt trees. "
            "False runs TRL's own passes unchanged (for comparison)."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Capacity of one packed row in tokens. None: the tokens of one TRL forward (rows x padded length), "
            "so no packed row holds more tokens than TRL's own forward. A larger tree is split by its completions "
            "(exact; the prompt is repeated)."
        },
    )

    tree_self_check: bool = tree_self_check_field()

    def __post_init__(self) -> None:
        super().__post_init__()  # the TRL config parses its fields first (e.g. JSON model_init_kwargs)
        if self.max_packed_tokens is not None and (
            not isinstance(self.max_packed_tokens, int) or self.max_packed_tokens < 2
        ):
            raise ValueError(f"max_packed_tokens={self.max_packed_tokens!r} must be an integer >= 2, or None.")


def prepare_trl_args(args: Any, config_class: type, model: Any, trainer_name: str) -> Any:
    """The tree trainer's arguments: ``args`` (TRL's default naming when ``None``); with ``tree_logprobs``, the
    model on ``tree_flash`` as ``TreeSFTTrainer`` does it: by name, ``model_init_kwargs["attn_implementation"]``
    becomes ``tree_flash`` (``None``/unset silently, another name with a warning); an instance is switched
    (``hf_tree.trainer.use_tree_attention``).

    Raises:
        ValueError: for a plain TRL config, which lacks the tree fields, or a model that cannot be switched.
    """
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = config_class(f"{name.split('/')[-1]}-{trainer_name}")
    if not isinstance(args, config_class):
        raise ValueError(
            f"args is a {type(args).__name__}; the tree trainer needs a {config_class.__name__} (the same fields plus "
            "the tree ones): swap the config class too."
        )
    if args.tree_logprobs and isinstance(model, str):
        args.model_init_kwargs = tree_model_init_kwargs(args.model_init_kwargs)
    elif args.tree_logprobs:
        use_tree_attention(model)
    return args


def log_tree_stats(trainer: Any, model: torch.nn.Module) -> None:
    """Append the last tree pass's dedup ratio (branch tokens / packed tokens) to a TRL trainer's metrics; nothing
    when that pass scored no token (e.g. every completion masked by ``mask_truncated_completions``) or none ran."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
    stats = getattr(base, "hf_tree_layout_stats", None)
    if stats is None:
        return
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["tree/dedup_ratio"].append(stats.dedup_ratio)
