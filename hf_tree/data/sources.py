"""The one data resolver: a data argument (a saved dataset, a user file, a built-in source or a hub id) -> rows,
and rows -> tree rows. ``hf-tree stats``/``show``, ``launch/train.py``, ``TreeSFTTrainer`` and the examples all
use it, so that every entry point reads the same file into the same rows (and, with the same tokenizer and
template, the same trees).

What lives here and nowhere else:

- ``is_tree_dataset``: whether rows are already ``Tree.to_dict()`` rows (``hf_tree.tree.TREE_KEYS``);
- input-format detection: ``read_rows`` reads files through ``hf_tree.data.formats`` (``to_builder_rows``:
  detection, and ``normalize_messages`` for one Arrow schema), whose detector extends the builders' own
  (``hf_tree.builders.dataset.detect_format``) by the preference format only;
- the built-in dataset names: ``builtin:champ``, ``builtin:bfcl``, ``builtin:synthetic-agent``
  (``synthetic:agent``, the launcher's spelling before, is kept as an alias of ``builtin:synthetic-agent``) and
  ``builtin:shapes`` (image questions in TRL's vision SFT format, ``hf_tree.data.shapes_vlm``: their trees are built
  by ``TreeSFTTrainer`` with the model's processor, not by the text builders);
- the chat-template lookup (``chat_template_file``/``chat_template_text``; agent sources default to
  ``AGENT_TEMPLATE``).
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from hf_tree.builders import TREE_FEATURES, TreeBuildStats, build_tree_dataset_with_stats, render_ids
from hf_tree.data.names import AGENT_TEMPLATE, BUILTIN_DATASETS, BUILTIN_PREFIX, BUILTIN_SOURCES
from hf_tree.data.packages import ConversionStats
from hf_tree.data.synthetic_agent import MAIN_JOB_CONVERSATIONS, MAIN_JOB_OPTIONS
from hf_tree.tree import TREE_KEYS

logger = logging.getLogger("hf_tree")

# Older spellings that stay accepted (launch configs may hold them) -> the built-in name they mean.
BUILTIN_ALIASES = {"synthetic:agent": "builtin:synthetic-agent"}
_AGENT_SOURCES = ("bfcl", "synthetic-agent")
SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json")
"""A folder holding one of these was written by ``save_to_disk`` (else it is read as a hub-style folder)."""


@dataclass
class LoadedTrees:
    """Tree rows and what building them did (``None`` where nothing was converted or built)."""

    trees: datasets.Dataset
    """``Tree.to_dict()`` rows."""
    build_stats: TreeBuildStats | None = None
    """Tokenizing and merging (rows dropped by reason), when the input was not already trees."""
    conversion_stats: ConversionStats | None = None
    """Built-in sources: source items read and skipped by reason."""


def chat_template_file(value: str) -> str:
    """The path of a Jinja chat template: ``value`` itself when it is a file, else TRL's
    ``trl/chat_templates/<value>.jinja`` (e.g. ``"qwen3"``). A path is what ``SFTConfig.chat_template_path`` takes.

    Raises:
        ValueError: when ``value`` is neither an existing file nor a template TRL ships (listing those).
    """
    if pathlib.Path(value).is_file():
        return value
    folder = importlib.resources.files("trl") / "chat_templates"
    candidate = folder / f"{value}.jinja"
    if candidate.is_file():
        return str(candidate)
    names = sorted(p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja"))
    raise ValueError(f"chat template {value!r} is neither a file nor one of TRL's templates: {names}.")


def chat_template_text(value: str | None) -> str | None:
    """The text of ``chat_template_file(value)``; ``None`` keeps the tokenizer's own."""
    if value is None:
        return None
    return pathlib.Path(chat_template_file(value)).read_text(encoding="utf-8")


def is_tree_dataset(dataset: datasets.Dataset | datasets.IterableDataset) -> bool:
    """Whether the rows are already ``Tree.to_dict()`` rows (every key of ``TREE_KEYS`` is a column)."""
    return set(TREE_KEYS) <= set(dataset.column_names or ())


def builtin_name(source: str) -> str | None:
    """The built-in source ``source`` names (``"champ"``, ``"bfcl"``, ``"synthetic-agent"``; aliases resolved),
    or ``None`` when it names none.

    Raises:
        ValueError: on ``builtin:<unknown>``, listing the built-in names.
    """
    source = BUILTIN_ALIASES.get(source, source)
    if not source.startswith(BUILTIN_PREFIX):
        return None
    name = source[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_SOURCES:
        raise ValueError(f"unknown built-in dataset {source!r}; choose one of {list(BUILTIN_DATASETS)}.")
    return name


def default_chat_template(source: str) -> str | None:
    """``AGENT_TEMPLATE`` for built-in agent sources (their tool calls need it), else ``None``."""
    return AGENT_TEMPLATE if builtin_name(source) in _AGENT_SOURCES else None


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


def builtin_rows(
    name: str,
    subset: str | None = None,
    limit: int | None = None,
    *,
    seed: int = 0,
    synthetic_options: Mapping[str, int] | None = None,
) -> tuple[datasets.Dataset, ConversionStats]:
    """Rows of a built-in source (``name`` as ``builtin_name`` returns it).

    Args:
        subset: CHAMP prompt type (e.g. ``"0-Shot"``) or BFCL category.
        limit: CHAMP problems, BFCL tasks, synthetic conversations (default 64) or shapes images (default 16, four
            questions each).
        seed, synthetic_options: ``synthetic-agent`` only: its seed and ``max_user_turns``/``max_tool_steps``.
    """
    if name != "synthetic-agent" and synthetic_options:
        raise ValueError(f"synthetic_options {dict(synthetic_options)} apply to builtin:synthetic-agent only.")
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
        rows = synthetic_agent_dataset(limit or 64, seed=seed, **(synthetic_options or {}))
        return rows, ConversionStats(num_source_items=len(rows), num_rows=len(rows))
    if name == "shapes":
        from hf_tree.data.shapes_vlm import shapes_sft_dataset

        if subset is not None:
            raise ValueError("builtin:shapes has no subsets; leave subset unset.")
        rows = shapes_sft_dataset(limit or 16, seed=seed)
        return rows, ConversionStats(num_source_items=len(rows), num_rows=len(rows))
    raise ValueError(f"unknown built-in source {name!r}; choose one of {BUILTIN_SOURCES}.")


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path, so that a missing one gets a clear error at once instead of a hub
    lookup (retried for a minute offline, then "Couldn't reach ... on the Hub"): it exists, is absolute, starts with
    ``./``, ``../`` or ``~``, has more than one ``/`` (or the OS's separator), a data file suffix, or its first part is
    a local folder (``data/train`` beside a ``data`` folder). A hub id is ``name`` or ``owner/name``."""
    path = pathlib.Path(name)
    parts = path.parts
    return (
        path.exists()
        or path.is_absolute()
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or (len(parts) > 1 and pathlib.Path(parts[0]).is_dir())
        or path.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv")
    )


def check_local_dataset(name: str) -> None:
    """Raise ``ValueError`` when dataset ``name`` can only be a local path (``looks_like_local_path``) and there is
    nothing there; built-in names pass."""
    if builtin_name(name) is None and looks_like_local_path(name) and not pathlib.Path(name).expanduser().exists():
        raise ValueError(
            f"data {name!r} does not exist (no such file or folder: {os.path.abspath(os.path.expanduser(name))}); pass "
            "a saved tree dataset folder, a folder of .jsonl/.json/.parquet files, one such file, a hub id "
            f"(owner/name) or one of {list(BUILTIN_DATASETS)}."
        )


def read_rows(
    source: str,
    *,
    split: str | None = None,
    dataset_config: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    synthetic_options: Mapping[str, int] | None = None,
    allow_hub: bool = False,
) -> tuple[datasets.Dataset, ConversionStats | None]:
    """``(rows, conversion stats)`` of ``source``, untokenized: tree rows, or rows in a builder format.

    - a built-in name (``BUILTIN_DATASETS`` or an alias; ``subset``/``limit``/``seed``/``synthetic_options`` as
      in ``builtin_rows``);
    - a folder written by ``save_to_disk`` (a ``DatasetDict`` needs ``split``), used as is;
    - another folder: its data files as ``datasets.load_dataset(folder)`` reads them (``read_dataset_folder``);
    - a ``.parquet`` file of tree rows, used as is;
    - a ``.jsonl``/``.json``/``.parquet`` file in a user format, read by ``hf_tree.data.formats``
      (``to_builder_rows``: format detection and message normalisation);
    - with ``allow_hub``, anything else goes to ``datasets.load_dataset(source, dataset_config, split=split)``.

    Raises:
        ValueError: on a missing path (without ``allow_hub``), an unknown built-in name, an unsupported file type,
            a ``DatasetDict`` without ``split``, or records no format matches.
    """
    name = builtin_name(source)
    if name is not None:
        if source in BUILTIN_ALIASES:
            logger.info("hf_tree: dataset %r is read as %r.", source, BUILTIN_ALIASES[source])
        return builtin_rows(name, subset, limit, seed=seed, synthetic_options=synthetic_options)
    path = pathlib.Path(source)
    if path.is_dir() and any((path / f).exists() for f in SAVED_DATASET_FILES):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split is None or split not in loaded:
                raise ValueError(
                    f"{source} holds a DatasetDict with splits {list(loaded)}; split={split!r} is none of them: "
                    "pass one of those splits (or one split's folder)."
                )
            loaded = loaded[split]
        return loaded, None
    if path.is_dir():  # data files, e.g. a hub dataset's clone: what `--dataset_name FOLDER` reads in TRL's scripts
        return read_dataset_folder(path, split, dataset_config), None
    if path.is_file():
        if path.suffix.lower() == ".parquet":
            table = datasets.Dataset.from_parquet(str(path))
            if is_tree_dataset(table):
                return table, None
        from hf_tree.data.formats import read_records, to_builder_rows

        return to_builder_rows(read_records(path), where=str(path))[0], None
    if allow_hub and not looks_like_local_path(source):
        try:
            return datasets.load_dataset(source, dataset_config, split=split), None
        except (FileNotFoundError, ConnectionError) as error:  # datasets' errors (offline: after retries) name the Hub
            raise ValueError(
                f"data {source!r} is no local file or folder ({os.path.abspath(source)} does not exist), and the Hub "
                f"gave no dataset of that name: {' '.join(str(error).split())}"
            ) from error
    check_local_dataset(source)
    raise ValueError(
        f"data {source!r} does not exist; pass a saved tree dataset folder, a folder of .jsonl/.json/.parquet "
        f"files, one such file, or one of {list(BUILTIN_DATASETS)}."
    )


def read_dataset_folder(path: pathlib.Path, split: str | None, dataset_config: str | None = None) -> datasets.Dataset:
    """Split ``split`` (default ``"train"``) of a folder of data files (``.jsonl``/``.json``/``.parquet``, flat or
    hub-style ``data/train-*.parquet``), read by ``datasets.load_dataset(folder)`` as TRL's scripts read
    ``--dataset_name``; rows in a user format are normalised as files are (``to_builder_rows``), tree rows kept.

    Raises:
        ValueError: on a folder without data files, or without the split.
    """
    try:
        loaded = datasets.load_dataset(str(path), dataset_config)
    except FileNotFoundError as error:  # datasets' EmptyDatasetError / DataFilesNotFoundError
        raise ValueError(
            f"data {str(path)!r} is a folder with no data files datasets can read ({error}); pass a folder of "
            ".jsonl/.json/.parquet files, one such file, or a folder saved with Dataset.save_to_disk."
        ) from None
    name = split or "train"
    if name not in loaded:
        raise ValueError(f"{path} holds the splits {list(loaded)}; split={name!r} is none of them: pass one of them.")
    rows = loaded[name]
    if is_tree_dataset(rows):
        return rows
    from hf_tree.data.formats import to_builder_rows

    return to_builder_rows(rows.to_list(), where=str(path))[0]


TreeBuilder = Callable[
    [datasets.Dataset, PreTrainedTokenizerBase, str | None], tuple[datasets.Dataset, TreeBuildStats | None]
]
"""``(rows, tokenizer, chat template text or None) -> (tree rows, what building did)``."""


def load_tree_rows(
    source: str,
    tokenizer: PreTrainedTokenizerBase | Callable[[], PreTrainedTokenizerBase] | None = None,
    *,
    chat_template: str | None = None,
    group_by: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
    num_proc: int | None = None,
    split: str | None = None,
    dataset_config: str | None = None,
    build: TreeBuilder | None = None,
) -> LoadedTrees:
    """Tree rows from ``source`` (anything ``read_rows`` reads but a hub id): tree rows are used as is, other rows
    are built with ``tokenizer``; agent sources default to ``AGENT_TEMPLATE``.

    Args:
        tokenizer: the tokenizer, or a function returning it (called only when the data needs tokenizing).
        chat_template: a template file or TRL template name (see ``chat_template_file``).
        group_by, num_proc: passed to ``build_tree_dataset_with_stats``.
        subset, limit: as in ``builtin_rows``; ``builtin:synthetic-agent`` is the main job's data (its
            ``MAIN_JOB_CONVERSATIONS`` unless ``limit`` is given, and its ``MAIN_JOB_OPTIONS``).
        split, dataset_config: as in ``read_rows``.
        build: builds the trees instead of ``build_tree_dataset_with_stats`` (then ``group_by`` and ``num_proc`` are
            its own business), e.g. ``TreeSFTTrainer``'s preparation (``hf_tree.sft_stats.sft_tree_rows``).

    Raises:
        ValueError: as ``read_rows``, or when a tokenizer is needed but not given.
    """
    options = None
    if builtin_name(source) == "synthetic-agent":  # the main job's data (hf_tree.launcher), sized as it sizes it
        limit, options = limit or MAIN_JOB_CONVERSATIONS, MAIN_JOB_OPTIONS
    rows, conversion = read_rows(
        source, split=split, dataset_config=dataset_config, subset=subset, limit=limit, synthetic_options=options
    )
    if is_tree_dataset(rows):
        return LoadedTrees(rows)
    from hf_tree.vision.sft import is_vision_dataset  # here: reading tree rows never needs the vision builders

    if is_vision_dataset(rows):  # the text builders would drop the images
        raise ValueError(
            f"{source} holds image rows (columns {rows.column_names}): their trees need the model's processor; train "
            "them with TreeSFTTrainer (or launch/train.py) and a vision-language model."
        )
    if tokenizer is None:
        raise ValueError(
            f"{source} holds columns {rows.column_names}, not Tree.to_dict() rows ({sorted(TREE_FEATURES)}): "
            "building trees needs a tokenizer (hf-tree: --tokenizer)."
        )
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = tokenizer()
    template = chat_template_text(chat_template or default_chat_template(source))
    warn_if_template_drops_tool_calls(rows, tokenizer, template)
    if build is not None:
        trees, build_stats = build(rows, tokenizer, template)
    else:
        trees, build_stats = build_tree_dataset_with_stats(
            rows, tokenizer, chat_template=template, group_by=group_by, num_proc=num_proc
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
