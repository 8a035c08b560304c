"""Sequence-classification scores of many rows that share prefixes, each shared prefix computed once.

A transformers ``*ForSequenceClassification`` model (``GenericForSequenceClassification``: Llama, Qwen, Mistral,
Gemma, ...) runs its backbone on a padded ``[B, T]`` batch, applies its ``score`` head to every position and keeps
each row's *pooled* position: the rightmost token that is not ``pad_token_id`` (``T - 1`` without a pad token). TRL's
``RewardTrainer`` reads those ``[B, num_labels]`` logits. A reward batch repeats each prompt (chosen, rejected;
several pairs per prompt in most datasets), so that forward recomputes every prompt once per row.

``add_tree_reward_forward`` replaces the model's forward by one with the same contract that instead

1. cuts each row at its pooled token (a causal model's state there does not depend on later tokens), strips its
   padding and merges the rows into tries (``hf_tree.trl.logprobs.pack_rows``: rows are grouped by their tokens),
2. packs the tries into rows and runs the backbone once on them with the tree mask (``kv_end``) and depth positions,
3. gathers the hidden state at each row's pooled token and applies the model's own ``score`` head to those states.

Values equal the model's own up to rounding, and gradients flow through the gather. Positions are depths, as each row
alone without padding (right-padded rows, TRL's collator, get the same positions in the model's own forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.models.check import probe_tree_exactness, refuse_known_unsupported, self_check_enabled
from hf_tree.models.check_guard import CheckedModel
from hf_tree.models.length_rope import longest_exact_branch
from hf_tree.packing import PackingStats, check_max_packed_tokens
from hf_tree.trl.logprobs import backbone_hidden_states, pack_rows
from hf_tree.trl.tree_forward import TreeForward

# Inputs of a call that do not change the pooled scores: TRL's RewardTrainer passes ``use_cache=False`` and its
# collator's ``margin`` column (which the model's own forward ignores as well); ``None`` values are ignored too.
IGNORED_INPUTS = ("use_cache", "return_dict", "margin")


@dataclass
class PooledLayout:
    """Where each row's pooled token of a padded ``[B, T]`` batch is computed in the packed tree rows.

    Attributes:
        batch: ``input_ids``, ``position_ids`` ``[R, N]`` int64 and ``kv_end`` ``[R, N]`` int32.
        pooled_index: ``[B]`` int64, flat index into ``R * N`` of each row's pooled token.
        stats: packing statistics; ``stats.dedup_ratio`` = row tokens up to the pooled ones / packed tokens.
    """

    batch: dict[str, torch.Tensor]
    pooled_index: torch.Tensor
    stats: PackingStats


def pooled_columns(input_ids: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """``[B]`` the column ``GenericForSequenceClassification`` pools per row of ``input_ids`` ``[B, T]``: the rightmost
    token that is not ``pad_token_id`` (column 0 when a row is all padding), ``T - 1`` without a pad token."""
    batch_size, width = input_ids.shape
    if pad_token_id is None:
        if batch_size != 1:  # the model's own error
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        return np.full(batch_size, width - 1)
    return (np.arange(width) * (input_ids != pad_token_id)).argmax(-1)


def layout_pooled_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pad_token_id: int | None,
    max_packed_tokens: int,
    merge: bool = True,
) -> PooledLayout:
    """Merge the rows of a padded batch, each up to its pooled token, into trees and pack them.

    Args:
        input_ids: ``[B, T]`` token ids, padded on either side.
        attention_mask: ``[B, T]``, 1 on real tokens (one contiguous run per row), or ``None`` for no padding.
        pad_token_id: the model config's ``pad_token_id`` (what its pooling skips).
        max_packed_tokens: capacity of a packed row; a tree larger than this is split by its branches (exact).

    Raises:
        ValueError: when a row's real tokens are not one contiguous run, its pooled token is padding (its score
            would depend on the padding), or it is longer than ``max_packed_tokens`` up to its pooled token.
    """
    ids = input_ids.detach().cpu().numpy()
    real = np.ones(ids.shape, dtype=bool) if attention_mask is None else attention_mask.detach().cpu().numpy() != 0
    pooled = pooled_columns(ids, pad_token_id)
    sequences: dict[int, list[int]] = {}
    for row in range(ids.shape[0]):
        run = np.nonzero(real[row])[0]
        start, end = (int(run[0]), int(run[-1]) + 1) if run.size else (0, 0)
        if run.size != end - start:
            raise ValueError(
                f"row {row}: attention_mask is not one contiguous run of real tokens; hf_tree's tree reward forward "
                "supports rows padded on either side (set tree_forward=False otherwise)."
            )
        if not start <= pooled[row] < end:
            raise ValueError(
                f"row {row}: the model scores the rightmost token that is not pad_token_id={pad_token_id}, column "
                f"{int(pooled[row])}, which is padding (real tokens: [{start}, {end})): the score would depend on the "
                "padding. Pad with pad_token_id (as TRL's collator does)."
            )
        if pooled[row] + 1 - start > max_packed_tokens:
            raise ValueError(
                f"row {row} has {int(pooled[row] + 1 - start)} tokens up to its pooled one, more than "
                f"max_packed_tokens={max_packed_tokens}: a row must fit in one packed row. Raise max_packed_tokens."
            )
        sequences[row] = ids[row, start : pooled[row] + 1].tolist()
    batch, stats, token_index = pack_rows(sequences, max_packed_tokens, merge)
    pooled_index = np.array([token_index[row][-1] for row in range(ids.shape[0])], dtype=np.int64)
    return PooledLayout(
        batch={k: batch[k] for k in ("input_ids", "position_ids", "kv_end")},
        pooled_index=torch.from_numpy(pooled_index),
        stats=stats,
    )


def check_reward_model(model: PreTrainedModel) -> None:
    """Raise ``ValueError`` unless ``model`` can run the tree reward forward: a ``GenericForSequenceClassification``
    (whose pooling ``pooled_columns`` reproduces) on ``tree_flash``."""
    if not isinstance(model, GenericForSequenceClassification):
        raise ValueError(
            f"model is a {type(model).__name__}; the tree reward forward supports transformers' generic sequence "
            "classification models (GenericForSequenceClassification: LlamaForSequenceClassification, Qwen2/3, "
            "Mistral, Gemma, ...), whose score it reproduces. Set tree_forward=False for this model."
        )
    if model.config._attn_implementation != TREE_ATTENTION_NAME:
        raise ValueError(
            f"model uses attn_implementation={model.config._attn_implementation!r}, which ignores the tree mask; "
            f"call model.set_attn_implementation('{TREE_ATTENTION_NAME}') (after `import hf_tree`)."
        )


class TreeRewardForward(TreeForward):
    """The tree reward forward of one model (``add_tree_reward_forward``): its settings, the forward it replaced, the
    first-use check's record and the packing of its last call (``TreeForward``)."""

    def __init__(self, max_packed_tokens: int | None, self_check: bool | None, merge_in_batch: bool) -> None:
        self.max_packed_tokens = max_packed_tokens
        self.self_check = self_check
        self.merge_in_batch = merge_in_batch
        self.checked: CheckedModel | None = None  # set by the first call

    def __call__(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutputWithPast:
        given = {k: v for k, v in kwargs.items() if k not in IGNORED_INPUTS}
        unsupported = sorted(k for k, v in given.items() if v is not None and v is not False)
        if input_ids is None or unsupported:
            raise ValueError(
                f"the tree reward forward got model inputs {unsupported or ['inputs_embeds without input_ids']} it "
                "does not support (it handles input_ids and attention_mask; no labels, position_ids, embeddings, "
                "cache or extra outputs). Set tree_forward=False to use the model's own forward."
            )
        enabled = self_check_enabled(self.self_check)
        if self.checked is None:
            if enabled:  # the original forward runs the probe (see hf_tree.trl.glue)
                refuse_known_unsupported(model)
                probe_tree_exactness(model, self.previous_forward, length_limit=longest_exact_branch(model.config))
            self.checked = CheckedModel.of(model)
        elif enabled:
            self.checked.refuse_changes(model)
        pad_token_id = model.config.get_text_config().pad_token_id
        capacity = self.max_packed_tokens or input_ids.numel()
        layout = layout_pooled_rows(input_ids, attention_mask, pad_token_id, capacity, self.merge_in_batch)
        device = model.get_input_embeddings().weight.device
        hidden = backbone_hidden_states(model, {k: v.to(device) for k, v in layout.batch.items()})
        logits = model.score(hidden.index_select(0, layout.pooled_index.to(hidden.device)))
        self.layout_stats = layout.stats  # the last call's packing, for the trainer's logs
        return SequenceClassifierOutputWithPast(logits=logits)


def add_tree_reward_forward(
    model: PreTrainedModel,
    max_packed_tokens: int | None = None,
    self_check: bool | None = None,
    merge_in_batch: bool = True,
) -> TreeRewardForward:
    """Replace ``model``'s forward by the tree one (see the module docstring).

    ``model(input_ids, attention_mask)`` then returns a ``SequenceClassifierOutputWithPast`` whose ``logits``
    ``[B, num_labels]`` equal the model's own pooled logits, computed on packed trees; no ``loss`` (TRL's trainer
    computes its own), no cache, hidden states or attentions.

    Args:
        model: a ``GenericForSequenceClassification`` (the base model of a PEFT model) on ``tree_flash``.
        max_packed_tokens: packed row capacity; ``None``: the call's ``B * T`` tokens (no packed row holds more
            tokens than the model's own forward).
        self_check: run ``hf_tree.models.check``'s refusals and probe before the first tree pass, and its guard
            (``hf_tree.models.check_guard``) on every later one (``None``: on unless ``HF_TREE_SELF_CHECK=0``).
        merge_in_batch: merge the call's rows into tries by their tokens; ``False``: each row a tree of its own.

    Returns:
        The installed forward: its ``layout_stats`` is the packing of the last call (what the trainer logs).
    """
    check_reward_model(model)
    check_max_packed_tokens(max_packed_tokens, none_allowed=True)
    forward = TreeRewardForward(max_packed_tokens, self_check, merge_in_batch)
    forward.install(model)
    return forward
