"""Dataset-scale conversion of TRL-format rows into tree rows (``Tree.to_dict()`` columns).

Three passes: ``datasets.map`` tokenizes every row in full (progress bar, ``num_proc``); the rows are
grouped in the main process (a key column, identical prompt tokens, or one tree per row); a second
``datasets.map`` merges each group's branches by token ids. Every input row ends in exactly one tree or
is counted as dropped with its reason (``TreeBuildStats``), and the summary is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from hf_tree.builders.chat import (
    MESSAGES_BRANCHES,
    TRAIN_ON,
    MessagesBranches,
    TrainOn,
    conversation_branch,
    conversation_branches,
    render_ids,
)
from hf_tree.builders.completions import (
    completions_to_branches,
    is_empty_completion,
)
from hf_tree.tree import Tree, dedup_ratio, mask_to_spans, spans_to_mask

logger = logging.getLogger("hf_tree")

GROUP_BY_PROMPT_TOKENS = "<prompt tokens>"
"""``group_by`` value: merge rows whose prompt tokens are identical (``messages`` rows: the rendering
before the first assistant message, with the generation prompt)."""
GROUP_BY_ROW = "<row>"
"""``group_by`` value: one tree per input row."""
NOTHING_TRAINED = "nothing trained"
"""Drop reason of a row whose branches train no token (``TreeBuildStats.untrained_rows``)."""
FORMATS = ("messages", "prompt/completion", "prompt/completions", "text")
TEXT_FIELD = "text"
"""The column of TRL's language-modeling rows (``SFTConfig.dataset_text_field``'s default)."""
# ``Tree.to_dict()`` columns as Arrow types.
TREE_FEATURES = {
    "node_tokens": datasets.List(datasets.List(datasets.Value("int64"))),
    "node_parents": datasets.List(datasets.Value("int64")),
    "branch_end_nodes": datasets.List(datasets.Value("int64")),
    "branch_loss_spans": datasets.List(datasets.List(datasets.Value("int64"))),
    "branch_num_trained": datasets.List(datasets.Value("int64")),
    "node_token_weights": datasets.List(datasets.List(datasets.Value("int64"))),
    "node_sequence_weights": datasets.List(datasets.List(datasets.Value("float64"))),
}
# Columns the builders read; other columns are only kept when named in ``branch_fields``.
_INPUT_COLUMNS = ("messages", "prompt", "completion", "completions", "tools", "chat_template_kwargs", TEXT_FIELD)


@dataclass
class TreeBuildStats:
    """What ``build_tree_dataset`` did: every input row is in one tree or counted in ``num_dropped_rows``."""

    num_rows: int = 0
    """Input rows."""
    num_trees: int = 0
    """Output rows (trees)."""
    num_branches: int = 0
    """Branches over all trees (per-turn samples or completions)."""
    num_dropped_rows: dict[str, int] = field(default_factory=dict)
    """Input rows left out, by reason (e.g. ``"no assistant message"``, ``"empty completion"``)."""
    dropped_rows: list[int] = field(default_factory=list)
    """Indices of the input rows left out (any reason): with one tree per row, the k-th tree is the k-th other row."""
    untrained_rows: list[int] = field(default_factory=list)
    """Indices of the input rows left out because they train no token (``"nothing trained"``, e.g. a text row of one
    token: ``""`` is TRL's ``[EOS]``), which TRL's ``SFTTrainer`` keeps in its batches (``TreeSFTTrainer`` too)."""
    num_dropped_completions: dict[str, int] = field(default_factory=dict)
    """``prompt/completions`` rows: single completions left out of a kept row, by reason."""
    num_boundary_merges: int = 0
    """Completions (or assistant turns) whose tokens merged across the prompt/completion boundary: their
    branch is the full tokenization and its trained span starts where it leaves the prompt tokens."""
    num_tree_tokens: int = 0
    """Tokens of all trees (deduplicated)."""
    num_branch_tokens: int = 0
    """Tokens per-branch training would process."""

    @property
    def dedup_ratio(self) -> float:
        return dedup_ratio(self.num_branch_tokens, self.num_tree_tokens)

    def summary(self) -> str:
        def counts(by_reason: dict[str, int]) -> str:
            return f"{sum(by_reason.values())}" + (f" {by_reason}" if by_reason else "")

        return (
            f"{self.num_rows} rows -> {self.num_trees} trees of {self.num_branches} branches "
            f"(dedup ratio {self.dedup_ratio:.2f}); rows dropped: {counts(self.num_dropped_rows)}; "
            f"completions dropped from kept rows: {counts(self.num_dropped_completions)}; "
            f"prompt/completion token merges: {self.num_boundary_merges}"
        )


def detect_format(column_names: Sequence[str], text_field: str = TEXT_FIELD) -> str:
    """``"messages"``, ``"prompt/completion"``, ``"prompt/completions"`` or ``"text"`` (a ``text_field`` column,
    TRL's language-modeling rows) from the dataset's columns, in TRL's order (prompt rows before text rows)."""
    if "messages" in column_names:
        return "messages"
    if "prompt" in column_names and "completion" in column_names:
        return "prompt/completion"
    if "prompt" in column_names and "completions" in column_names:
        return "prompt/completions"
    if text_field in column_names:
        return "text"
    raise ValueError(
        f"dataset columns {list(column_names)} match no supported format {FORMATS}: expected a 'messages' "
        f"column, 'prompt' with 'completion' (one per row) or 'completions' (a list per row), or {text_field!r} "
        "(plain text, every token trained). Convert other "
        "formats first (e.g. trl.data_utils.maybe_convert_to_chatml for 'conversations')."
    )


def check_messages_options(messages_branches: str, train_on: str | None, assistant_only_loss: bool) -> None:
    """Raise ``ValueError`` for a ``messages_branches`` value, or a ``train_on``/``assistant_only_loss`` that does not
    apply to it (each belongs to one kind of branch)."""
    if messages_branches not in MESSAGES_BRANCHES:
        raise ValueError(f"messages_branches={messages_branches!r} must be one of {MESSAGES_BRANCHES}.")
    if train_on is not None and train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r} must be one of {TRAIN_ON}.")
    if messages_branches == "conversation" and train_on is not None:
        raise ValueError(
            f"train_on={train_on!r} applies to messages_branches='per_turn' only: with 'conversation' each row is "
            "one branch trained as TRL trains it (assistant_only_loss decides which tokens). Unset train_on, or set "
            "messages_branches='per_turn'."
        )
    if messages_branches == "per_turn" and assistant_only_loss:
        raise ValueError(
            "assistant_only_loss=True applies to messages_branches='conversation' only: per-turn branches always "
            "train assistant tokens (train_on decides which turns). Leave assistant_only_loss=False here."
        )


def _row_tools(example: Mapping[str, Any]) -> Any:
    tools = example.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools  # TRL stores tools as JSON text too


def _hash_tokens(tokens: Sequence[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


def _is_list_feature(feature: Any) -> bool:
    return isinstance(feature, datasets.List | datasets.LargeList)


def _field_feature(feature: Any, data_format: str) -> Any:
    """Arrow type of a per-branch field column: in ``prompt/completions`` rows a list column holds one value
    per completion; any other column's row value is repeated for each of the row's branches."""
    if data_format == "prompt/completions" and _is_list_feature(feature):
        return feature
    return datasets.List(feature)


def _tokenized_features(dataset: datasets.Dataset, data_format: str, branch_fields: Sequence[str]) -> datasets.Features:
    """Output schema of the tokenizing pass (given, so that batches of dropped rows cannot mis-type a column)."""
    features = {
        "_sequences": datasets.List(datasets.List(datasets.Value("int64"))),
        "_spans": datasets.List(datasets.List(datasets.Value("int64"))),
        "_prompt_hash": datasets.Value("string"),
        "_drop": datasets.Value("string"),
        "_merges": datasets.Value("int64"),
        "_dropped_completions": datasets.Value("int64"),
    }
    for name in branch_fields:
        features[f"_field_{name}"] = _field_feature(dataset.features[name], data_format)
    return datasets.Features(features)


def _tree_features(dataset: datasets.Dataset, data_format: str, branch_fields: Sequence[str]) -> datasets.Features:
    """Output schema of the merging pass: ``Tree.to_dict()`` columns (+ ``branch_fields``) and token counts."""
    features = dict(TREE_FEATURES, _num_tokens=datasets.Value("int64"), _num_branch_tokens=datasets.Value("int64"))
    if branch_fields:
        features["branch_fields"] = {n: _field_feature(dataset.features[n], data_format) for n in branch_fields}
    return datasets.Features(features)


def _tokenize_row(
    example: dict[str, Any],
    index: int,
    *,
    tokenizer: PreTrainedTokenizerBase,
    data_format: str,
    branch_fields: Sequence[str],
    per_completion_fields: Sequence[str],
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    train_on: TrainOn,
    messages_branches: MessagesBranches,
    assistant_only_loss: bool,
    add_eos: bool,
    text_field: str,
) -> dict[str, Any]:
    """One input row -> its branches (tokens and loss spans), prompt hash, drop reason and fields."""
    kwargs = {**(chat_template_kwargs or {}), **(example.get("chat_template_kwargs") or {})}
    render = dict(tools=_row_tools(example), chat_template=chat_template, chat_template_kwargs=kwargs)
    out: dict[str, Any] = {
        "_sequences": [],
        "_spans": [],
        "_prompt_hash": "",
        "_drop": "",
        "_merges": 0,
        "_dropped_completions": 0,
    }
    out.update({f"_field_{name}": [] for name in branch_fields})
    if data_format == "messages":
        messages = example["messages"] or []
        try:
            if messages_branches == "conversation":  # TRL's rows: one rendering, one branch
                sequences, masks = [], []
                if messages:
                    sequence, mask = conversation_branch(
                        messages, tokenizer, assistant_only_loss=assistant_only_loss, where=f"row {index}", **render
                    )
                    sequences, masks = [sequence], [mask]
            else:
                sequences, masks, out["_merges"] = conversation_branches(
                    messages, tokenizer, train_on=train_on, where=f"row {index}", **render
                )
        except ValueError as error:
            raise ValueError(f"row {index}: {error}") from error
        if not sequences:
            out["_drop"] = "no assistant message" if messages_branches == "per_turn" else "empty conversation"
            return out
        # the grouping key: the rendering before the first assistant message (the whole row when there is none)
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        prompt_ids = (
            sequences[0]
            if first is None
            else render_ids(tokenizer, messages[:first], add_generation_prompt=True, where=f"row {index}", **render)
        )
    elif data_format == "text":
        text = example[text_field]
        if not isinstance(text, str):
            out["_drop"] = "missing text"
            return out
        sequences = [text_branch(text, tokenizer, add_eos)]
        masks, prompt_ids = [[1] * len(sequences[0])], sequences[0]
    else:
        prompt = example["prompt"]
        completions = [example["completion"]] if data_format == "prompt/completion" else example["completions"] or []
        for name in per_completion_fields:
            if example[name] is None or len(example[name]) != len(completions):
                raise ValueError(
                    f"row {index}: branch field {name!r} is a list column, so it must hold one value per completion, "
                    f"but it has {example[name] if example[name] is None else len(example[name])} for "
                    f"{len(completions)} completions."
                )
        if prompt is None:
            out["_drop"] = "missing prompt"
            return out
        keep = [not is_empty_completion(c) for c in completions]
        if not any(keep):
            out["_drop"] = "empty completion" if data_format == "prompt/completion" else "no non-empty completion"
            return out
        try:
            branches = completions_to_branches(
                prompt, [c for c, k in zip(completions, keep) if k], tokenizer, add_eos=add_eos, **render
            )
        except ValueError as error:
            raise ValueError(f"row {index}: {error}") from error
        sequences, masks, prompt_ids = branches.sequences, branches.loss_masks, branches.prompt_ids
        out["_merges"] = branches.num_boundary_merges
        out["_dropped_completions"] = keep.count(False)
    spans = [mask_to_spans(m) for m in masks]
    if not any(spans):
        out["_drop"] = NOTHING_TRAINED
        return out
    out.update(_sequences=sequences, _spans=spans, _prompt_hash=_hash_tokens(prompt_ids))
    for name in branch_fields:
        if name in per_completion_fields:
            out[f"_field_{name}"] = [v for v, k in zip(example[name], keep) if k]
        else:
            out[f"_field_{name}"] = [example[name]] * len(sequences)
    return out


def text_branch(text: str, tokenizer: PreTrainedTokenizerBase, add_eos: bool = True) -> list[int]:
    """TRL's language-modeling row: ``text`` plus ``tokenizer.eos_token`` when it does not end with it (``add_eos``),
    tokenized by the tokenizer's own call (special tokens as it adds them); every token after the first is trained."""
    eos = tokenizer.eos_token if add_eos and tokenizer.eos_token else ""
    return list(tokenizer(text=text if text.endswith(eos) else text + eos)["input_ids"])


def _merge_group(group: dict[str, Any], *, tokenized: datasets.Dataset, branch_fields: Sequence[str]) -> dict[str, Any]:
    """One group of tokenized rows -> one ``Tree.to_dict()`` row (plus its token counts)."""
    rows = tokenized[group["_rows"]]
    sequences = [s for row in rows["_sequences"] for s in row]
    masks = [
        spans_to_mask(sp, len(s))
        for row_seq, row_sp in zip(rows["_sequences"], rows["_spans"])
        for s, sp in zip(row_seq, row_sp)
    ]
    fields = {name: [v for row in rows[f"_field_{name}"] for v in row] for name in branch_fields}
    tree = Tree.from_sequences(sequences, masks, fields)
    out = tree.to_dict()
    out["_num_tokens"], out["_num_branch_tokens"] = tree.num_tokens, tree.num_branch_tokens
    return out


def _group_rows(
    tokenized: datasets.Dataset, dataset: datasets.Dataset, group_by: str | None, data_format: str
) -> list[list[int]]:
    """Kept row indices per group, groups in order of first appearance."""
    drops = tokenized["_drop"][:]
    kept = [i for i, reason in enumerate(drops) if not reason]
    if group_by is None:
        group_by = GROUP_BY_ROW if data_format in ("messages", "text") else GROUP_BY_PROMPT_TOKENS
    if group_by == GROUP_BY_ROW:
        return [[i] for i in kept]
    if group_by == GROUP_BY_PROMPT_TOKENS:
        keys = tokenized["_prompt_hash"][:]
    else:
        keys = dataset[group_by][:]
    groups: dict[Any, list[int]] = {}
    for i in kept:
        key = keys[i]
        if not isinstance(key, str | int | float | bool):
            raise ValueError(
                f"row {i}: group_by column {group_by!r} holds {key!r} ({type(key).__name__}); group keys must be "
                "strings or numbers (fill missing keys, or use group_by=None to group by prompt tokens)."
            )
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def build_tree_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    group_by: str | None = None,
    num_proc: int | None = None,
    branch_fields: Sequence[str] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    train_on: TrainOn | None = None,
    messages_branches: MessagesBranches = "per_turn",
    assistant_only_loss: bool = False,
    add_eos: bool = True,
    text_field: str = TEXT_FIELD,
) -> datasets.Dataset:
    """Convert TRL-format rows into tree rows (``Tree.to_dict()`` columns, ``branch_fields`` if any).

    Formats (by columns): ``messages`` (a conversation per row -> per-turn branches, see
    ``conversation_to_branches``, or with ``messages_branches="conversation"`` TRL's single branch, see
    ``conversation_branch``); ``prompt`` + ``completion`` (one completion per row); ``prompt`` +
    ``completions`` (a list per row); a ``text_field`` column (TRL's language modeling: one branch per row, every
    token trained, see ``text_branch``). Prompts/completions are text or messages, as in TRL. Optional
    per-row ``tools`` (list or JSON text) and ``chat_template_kwargs`` columns are used for rendering. The counts of
    what was built and dropped are logged; ``build_tree_dataset_with_stats`` also returns them.

    Args:
        dataset: the input ``datasets.Dataset``.
        tokenizer: tokenizer with the chat template for conversational rows.
        group_by: which rows merge into one tree: a column name (equal values merge),
            ``GROUP_BY_PROMPT_TOKENS`` (identical prompt tokens merge; a text row's prompt is its whole text),
            ``GROUP_BY_ROW`` (no merging), or ``None``: by prompt tokens for prompt rows, one tree per row for
            ``messages`` and text rows. (``TreeSFTTrainer`` builds one tree per row unless asked: a trainer deals a
            tree to one micro-batch whole, so grouping changes which rows share a batch.)
        num_proc: worker processes for both ``datasets.map`` passes.
        branch_fields: columns kept per branch under ``branch_fields`` (e.g. ``["reward", "advantage"]``):
            a row's value goes to each of its branches; in ``prompt/completions`` rows a list as long as
            ``completions`` gives one value per completion.
        chat_template, chat_template_kwargs: see ``conversation_to_branches``.
        train_on: ``messages_branches="per_turn"`` only: see ``conversation_to_branches`` (``None``:
            ``"last_assistant"``).
        messages_branches: ``messages`` rows: ``"per_turn"`` (default here; one branch per assistant turn, in
            the context the template renders at that turn, assistant tokens trained) or ``"conversation"``
            (TRL's SFT rows: the conversation rendered once, one branch; what ``TreeSFTTrainer`` uses by default).
        assistant_only_loss: ``messages_branches="conversation"`` only: train the template's assistant tokens
            (``{% generation %}``) instead of every token, as TRL's ``assistant_only_loss``.
        add_eos: plain-text completions and text rows end with ``tokenizer.eos_token`` (see
            ``completions_to_branches``, ``text_branch``).
        text_field: the column of text rows (TRL's ``dataset_text_field``).

    Raises:
        ValueError: on an unknown format, ``group_by``/``branch_fields`` column or ``train_on``, and (naming
            the row) on a chat template that cannot be split into prompt and assistant tokens.
    """
    trees, _ = build_tree_dataset_with_stats(
        dataset,
        tokenizer,
        group_by=group_by,
        num_proc=num_proc,
        branch_fields=branch_fields,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        train_on=train_on,
        messages_branches=messages_branches,
        assistant_only_loss=assistant_only_loss,
        add_eos=add_eos,
        text_field=text_field,
    )
    return trees


def build_tree_dataset_with_stats(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    group_by: str | None = None,
    num_proc: int | None = None,
    branch_fields: Sequence[str] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    train_on: TrainOn | None = None,
    messages_branches: MessagesBranches = "per_turn",
    assistant_only_loss: bool = False,
    add_eos: bool = True,
    text_field: str = TEXT_FIELD,
) -> tuple[datasets.Dataset, TreeBuildStats]:
    """``build_tree_dataset`` (the same arguments and errors), also returning its ``TreeBuildStats``."""
    data_format = detect_format(dataset.column_names, text_field)
    branch_fields = list(branch_fields or [])
    _check_columns(dataset, branch_fields, group_by, text_field)
    check_messages_options(messages_branches, train_on, assistant_only_loss)
    tokenized = _tokenize_rows(
        dataset,
        data_format,
        branch_fields,
        num_proc,
        tokenizer=tokenizer,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        train_on=train_on or "last_assistant",
        messages_branches=messages_branches,
        assistant_only_loss=assistant_only_loss,
        add_eos=add_eos,
        text_field=text_field,
    )
    trees = _merge_groups(tokenized, dataset, group_by, data_format, branch_fields, num_proc)
    stats = _build_stats(dataset, tokenized, trees)
    log = logger.warning if stats.num_dropped_rows or stats.num_dropped_completions else logger.info
    log("build_tree_dataset: %s", stats.summary())
    return trees.remove_columns(["_num_tokens", "_num_branch_tokens"]), stats


def _check_columns(
    dataset: datasets.Dataset, branch_fields: Sequence[str], group_by: str | None, text_field: str
) -> None:
    """Raise ``ValueError`` for a ``branch_fields`` or ``group_by`` column the dataset lacks; log the columns that are
    not carried into tree rows."""
    for name in branch_fields:
        if name not in dataset.column_names:
            raise ValueError(f"branch_fields names {name!r}, which is not a column of {dataset.column_names}.")
    if group_by not in (None, GROUP_BY_PROMPT_TOKENS, GROUP_BY_ROW) and group_by not in dataset.column_names:
        raise ValueError(
            f"group_by={group_by!r} is not a column of {dataset.column_names}; pass a column name, "
            f"GROUP_BY_PROMPT_TOKENS={GROUP_BY_PROMPT_TOKENS!r}, GROUP_BY_ROW={GROUP_BY_ROW!r} or None."
        )
    ignored = [c for c in dataset.column_names if c not in (*_INPUT_COLUMNS, text_field, *branch_fields, group_by)]
    if ignored:
        logger.info(
            "build_tree_dataset: columns %s are not carried into tree rows; pass branch_fields=%s to "
            "keep them per branch.",
            ignored,
            ignored,
        )


def _tokenize_rows(
    dataset: datasets.Dataset,
    data_format: str,
    branch_fields: Sequence[str],
    num_proc: int | None,
    **row_options: Any,
) -> datasets.Dataset:
    """The first pass: every row tokenized in full (``_tokenize_row`` with ``row_options``), one output row each."""
    per_completion = [
        n for n in branch_fields if data_format == "prompt/completions" and _is_list_feature(dataset.features[n])
    ]
    return dataset.map(
        _tokenize_row,
        with_indices=True,
        fn_kwargs=dict(
            data_format=data_format,
            branch_fields=branch_fields,
            per_completion_fields=per_completion,
            **row_options,
        ),
        remove_columns=dataset.column_names,
        features=_tokenized_features(dataset, data_format, branch_fields),
        num_proc=num_proc,
        desc=f"Tokenizing {data_format} rows",
    )


def _merge_groups(
    tokenized: datasets.Dataset,
    dataset: datasets.Dataset,
    group_by: str | None,
    data_format: str,
    branch_fields: Sequence[str],
    num_proc: int | None,
) -> datasets.Dataset:
    """The second and third passes: the kept rows grouped (``_group_rows``), each group's branches merged into one
    tree row (``_merge_group``, with its token counts ``_num_tokens`` and ``_num_branch_tokens``)."""
    groups = _group_rows(tokenized, dataset, group_by, data_format)
    features = _tree_features(dataset, data_format, branch_fields)
    if not groups:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    return datasets.Dataset.from_dict({"_rows": groups}).map(
        _merge_group,
        fn_kwargs=dict(tokenized=tokenized, branch_fields=branch_fields),
        remove_columns=["_rows"],
        features=features,
        num_proc=num_proc if num_proc and len(groups) >= num_proc else None,
        desc="Merging branches into trees",
    )


def _build_stats(dataset: datasets.Dataset, tokenized: datasets.Dataset, trees: datasets.Dataset) -> TreeBuildStats:
    """What the passes did: rows, trees, branches and tokens, and every dropped row or completion by reason."""
    stats = TreeBuildStats(
        num_rows=len(dataset),
        num_trees=len(trees),
        num_branches=sum(len(ends) for ends in trees["branch_end_nodes"][:]),
        num_boundary_merges=sum(tokenized["_merges"][:]),
        num_tree_tokens=sum(trees["_num_tokens"][:]),
        num_branch_tokens=sum(trees["_num_branch_tokens"][:]),
    )
    for index, (reason, dropped) in enumerate(zip(tokenized["_drop"][:], tokenized["_dropped_completions"][:])):
        if reason:
            stats.num_dropped_rows[reason] = stats.num_dropped_rows.get(reason, 0) + 1
            stats.dropped_rows.append(index)
        if reason == NOTHING_TRAINED:
            stats.untrained_rows.append(index)
        if dropped:
            stats.num_dropped_completions["empty completion"] = (
                stats.num_dropped_completions.get("empty completion", 0) + dropped
            )
    return stats
