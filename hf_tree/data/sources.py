"""Resolve a data argument (a saved tree dataset, a user file, or a built-in source) into tree rows.

``load_tree_rows`` is what ``hf-tree stats``/``hf-tree show`` call. Built-in sources read real data from
installed packages (``builtin:champ``, ``builtin:bfcl``) or generate it (``builtin:synthetic-agent``).
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from hf_tree.builders import TREE_FEATURES, TreeBuildStats, build_tree_dataset, render_ids
from hf_tree.data.packages import ConversionStats

logger = logging.getLogger("hf_tree")

BUILTIN_PREFIX = "builtin:"
BUILTIN_SOURCES = ("champ", "bfcl", "synthetic-agent")
# Built-in agent data needs a template that renders tool calls; SmolLM2's own ChatML template drops them.
AGENT_TEMPLATE = "qwen3"


@dataclass
class LoadedTrees:
    """Tree rows and what building them did (``None`` where nothing was converted or built)."""

    trees: datasets.Dataset
    """``Tree.to_dict()`` rows."""
    build_stats: TreeBuildStats | None = None
    """Tokenizing and merging (rows dropped by reason), when the input was not already trees."""
    conversion_stats: ConversionStats | None = None
    """Built-in sources: source items read and skipped by reason."""


def chat_template_text(value: str | None) -> str | None:
    """A Jinja chat template from a file path, or by name from TRL's ``trl/chat_templates/<name>.jinja``
    (e.g. ``"qwen3"``); ``None`` keeps the tokenizer's own.

    Raises:
        ValueError: when ``value`` is neither an existing file nor a template TRL ships (listing those).
    """
    if value is None:
        return None
    path = pathlib.Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    folder = importlib.resources.files("trl") / "chat_templates"
    candidate = folder / f"{value}.jinja"
    if candidate.is_file():
        return candidate.read_text(encoding="utf-8")
    names = sorted(p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja"))
    raise ValueError(f"chat template {value!r} is neither a file nor one of TRL's templates: {names}.")


def is_tree_dataset(dataset: datasets.Dataset) -> bool:
    return all(name in dataset.column_names for name in ("node_tokens", "node_parents", "branch_end_nodes"))


def warn_if_template_drops_tool_calls(
    rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, chat_template: str | None
) -> None:
    """Warn when the data has tool calls but the chat template renders none of them (e.g. SmolLM2's ChatML):
    the trees would silently train on empty assistant turns."""
    if "messages" not in rows.column_names:
        return
    for row in rows:
        index = next((i for i, m in enumerate(row["messages"]) if m.get("tool_calls")), None)
        if index is None:
            continue
        name = row["messages"][index]["tool_calls"][0]["function"]["name"]
        tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
        render = dict(tools=tools, chat_template=chat_template)
        prompt = render_ids(tokenizer, row["messages"][:index], add_generation_prompt=True, **render)
        full = render_ids(tokenizer, row["messages"][: index + 1], **render)
        if name not in tokenizer.decode(full[len(prompt) :]):  # the tool's name is in the schemas, not the turn
            logger.warning(
                "the chat template does not render tool calls (tool %r is missing from the rendered assistant turn): "
                "turns that only call tools would train on empty messages. Pass a template that renders them, e.g. "
                "--chat-template %s.",
                name,
                AGENT_TEMPLATE,
            )
        return


def builtin_rows(name: str, subset: str | None, limit: int | None) -> tuple[datasets.Dataset, ConversionStats]:
    """Rows of a built-in source. ``subset``: CHAMP prompt type (e.g. ``"0-Shot"``) or BFCL category;
    ``limit``: CHAMP problems, BFCL tasks or synthetic conversations."""
    if name == "champ":
        from hf_tree.data.champ import champ_dataset

        return champ_dataset(prompt_types=[subset] if subset else None, num_problems=limit)
    if name == "bfcl":
        from hf_tree.data.bfcl import bfcl_multi_turn_dataset

        return bfcl_multi_turn_dataset(subset or "base", num_tasks=limit)
    if name == "synthetic-agent":
        from hf_tree.data.synthetic_agent import synthetic_agent_dataset

        if subset is not None:
            raise ValueError("builtin:synthetic-agent has no subsets; leave subset unset.")
        rows = synthetic_agent_dataset(limit or 64)
        return rows, ConversionStats(num_source_items=len(rows), num_rows=len(rows))
    raise ValueError(f"unknown built-in source {name!r}; choose one of {BUILTIN_SOURCES}.")


def load_tree_rows(
    source: str,
    tokenizer: PreTrainedTokenizerBase | Callable[[], PreTrainedTokenizerBase] | None = None,
    *,
    chat_template: str | None = None,
    group_by: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
    num_proc: int | None = None,
) -> LoadedTrees:
    """Tree rows from ``source``:

    - a folder written by ``datasets.Dataset.save_to_disk`` holding ``Tree.to_dict()`` columns (used as is);
    - a ``.parquet`` file holding such columns (used as is);
    - a ``.jsonl``/``.json``/``.parquet`` file in a user format (``hf_tree.data.formats``), converted and built
      with ``tokenizer``;
    - ``builtin:champ``, ``builtin:bfcl`` or ``builtin:synthetic-agent`` (``subset``/``limit`` as in
      ``builtin_rows``), built with ``tokenizer``; agent sources default to TRL's ``qwen3`` template.

    Args:
        tokenizer: the tokenizer, or a function returning it (called only when the data needs tokenizing).
        chat_template: a template file or TRL template name (see ``chat_template_text``).
        group_by, num_proc: passed to ``build_tree_dataset``.

    Raises:
        ValueError: on a missing path, an unknown source, or when a tokenizer is needed but not given.
    """
    conversion = None
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        rows, conversion = builtin_rows(name, subset, limit)
        if chat_template is None and name in ("bfcl", "synthetic-agent"):
            chat_template = AGENT_TEMPLATE
    else:
        path = pathlib.Path(source)
        if not path.exists():
            raise ValueError(
                f"data {source!r} does not exist; pass a saved tree dataset folder, a .jsonl/.json/.parquet "
                f"file, or one of {[BUILTIN_PREFIX + s for s in BUILTIN_SOURCES]}."
            )
        if path.is_dir():
            trees = datasets.load_from_disk(str(path))
            if isinstance(trees, datasets.DatasetDict):
                raise ValueError(f"{source} holds a DatasetDict with splits {list(trees)}; pass one split's folder.")
            if not is_tree_dataset(trees):
                raise ValueError(
                    f"{source} holds columns {trees.column_names}, not Tree.to_dict() rows ({sorted(TREE_FEATURES)})."
                )
            return LoadedTrees(trees)
        if path.suffix.lower() == ".parquet":
            table = datasets.Dataset.from_parquet(str(path))
            if is_tree_dataset(table):
                return LoadedTrees(table)
        from hf_tree.data.formats import read_records, to_builder_rows

        rows, _ = to_builder_rows(read_records(path), where=str(path))
    if tokenizer is None:
        raise ValueError(f"{source} needs tokenizing: pass a tokenizer (hf-tree: --tokenizer).")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = tokenizer()
    template = chat_template_text(chat_template)
    warn_if_template_drops_tool_calls(rows, tokenizer, template)
    trees, build_stats = build_tree_dataset(
        rows, tokenizer, chat_template=template, group_by=group_by, num_proc=num_proc, return_stats=True
    )
    return LoadedTrees(trees, build_stats, conversion)


def tree_rows_summary(loaded: LoadedTrees) -> dict[str, Any]:
    """Drop counts by reason from conversion and building, for reports."""
    out: dict[str, Any] = {}
    if loaded.conversion_stats is not None:
        out["source items skipped"] = dict(loaded.conversion_stats.num_skipped)
    if loaded.build_stats is not None:
        out["rows dropped"] = dict(loaded.build_stats.num_dropped_rows)
        out["completions dropped"] = dict(loaded.build_stats.num_dropped_completions)
    return out
