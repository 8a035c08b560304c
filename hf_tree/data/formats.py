"""Common user formats (JSONL, JSON or Parquet records) -> rows ``hf_tree.builders.build_tree_dataset`` reads.

Recognised records (by their keys; every record of a file must have the same format):

- ``messages``: an OpenAI-style conversation. Assistant messages may carry ``reasoning_content`` and
  ``tool_calls`` (``{"type": "function", "function": {"name", "arguments"}}``, ``id`` optional); ``tool``
  messages answer them. A ``tools`` key holds the tool schemas. -> ``messages`` rows (one tree per row:
  its per-turn samples).
- ``prompt`` + ``completions`` (a list): a prompt with several completions (e.g. a GRPO group; per-completion
  lists such as ``rewards`` may sit beside it). -> ``prompt``/``completions`` rows (one tree per prompt).
- ``prompt`` + ``completion``: one completion per record. -> ``prompt``/``completion`` rows (records with
  identical prompt tokens merge into one tree).
- ``text``: plain text (TRL's language modeling), every token trained. -> ``text`` rows (one tree per row).
- ``chosen`` + ``rejected`` (``prompt`` optional, TRL's implicit-prompt preference format otherwise):
  -> ``prompt``/``completions`` rows with ``completions = [chosen, rejected]`` and a per-completion
  ``preference`` column ``["chosen", "rejected"]`` (pass ``branch_fields=["preference"]`` to keep it).

Why messages are normalised: Arrow stores a list of dicts with one schema, so differently shaped tool-call
arguments would be merged into one struct with ``None`` for every missing key, and a chat template would
render those ``None``s. Tool-call ``arguments`` therefore become JSON text (what OpenAI's API returns and
what templates accept), every message gets the same keys, and ``tools`` is stored as JSON text (as TRL
does); ``build_tree_dataset`` parses it back.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import datasets

from hf_tree.builders.dataset import detect_format

USER_FORMATS = ("messages", "prompt/completions", "prompt/completion", "text", "preference")
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls")
OPTIONAL_MESSAGE_KEYS = ("tool_call_id", "name")


def read_records(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Records of a ``.jsonl`` file (one JSON object per line), a ``.json`` file (a list of objects, or JSON
    lines) or a ``.parquet`` file.

    Raises:
        ValueError: on another suffix or a line/file that does not hold JSON objects (naming the line).
    """
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path)).to_list()
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type {suffix!r}; pass a .jsonl, .json or .parquet file.")
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg}).") from error
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{path}: record {i} is a {type(record).__name__}; every record must be a JSON object.")
    return records


def detect_user_format(record: Mapping[str, Any]) -> str:
    """One of ``USER_FORMATS`` from a record's keys: the builders' detector (``detect_format``, the one that
    ``TreeSFTTrainer`` applies to columns) plus the preference format, which ``to_builder_rows`` converts."""
    if "messages" not in record and "chosen" in record and "rejected" in record:
        return "preference"
    try:
        return detect_format(list(record))
    except ValueError:
        raise ValueError(
            f"a record with keys {sorted(record)} matches no supported format: expected 'messages', 'prompt' with "
            "'completions' or 'completion', 'text', or 'chosen' and 'rejected' (optionally with 'prompt')."
        ) from None


def _tool_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function", call)  # also accept the flat {"name", "arguments"} form
    if not isinstance(function, Mapping) or "name" not in function:
        raise ValueError(f"{where}: a tool call needs a function name, got {call!r}.")
    arguments = function.get("arguments", {})
    out: dict[str, Any] = {
        "type": call.get("type", "function"),
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
    if "id" in call:
        out["id"] = call["id"]
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    """Messages with the same keys (``MESSAGE_KEYS``, plus ``tool_call_id``/``name`` where given) and tool-call
    arguments as JSON text (see the module docstring)."""
    if isinstance(messages, str) or not isinstance(messages, Sequence):
        raise ValueError(f"{where}: 'messages' must be a list of message objects, got {type(messages).__name__}.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"{where}: message {i} is {message!r}; every message needs a 'role'.")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(
                f"{where}: message {i} has content of type {type(content).__name__}; only text content is supported."
            )
        calls = message.get("tool_calls") or None
        normalized = {
            "role": message["role"],
            "content": "" if content is None and calls else content,  # templates concatenate content
            "reasoning_content": message.get("reasoning_content"),
            "tool_calls": [_tool_call(c, f"{where}: message {i}") for c in calls] if calls else None,
        }
        normalized.update({k: message[k] for k in OPTIONAL_MESSAGE_KEYS if k in message})
        out.append(normalized)
    return out


def _completion(value: Any, where: str) -> Any:
    """Text stays text; a message or list of messages is normalised."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, Mapping):
        return normalize_messages([value], where)[0]
    return normalize_messages(value, where)


def _prompt(value: Any, where: str) -> Any:
    return value if isinstance(value, str) or value is None else normalize_messages(value, where)


def to_builder_rows(records: Sequence[Mapping[str, Any]], where: str = "records") -> tuple[datasets.Dataset, str]:
    """``(rows, user_format)``: records of one user format as a ``datasets.Dataset`` in a builder format.

    Keys other than the format's own are kept as columns (e.g. ``rewards`` beside ``completions``).

    Raises:
        ValueError: on an empty input, records of different formats, or malformed messages (naming the record).
    """
    if not records:
        raise ValueError(f"{where}: no records.")
    user_format = detect_user_format(records[0])
    rows = []
    for i, record in enumerate(records):
        at = f"{where}: record {i}"
        if detect_user_format(record) != user_format:
            raise ValueError(f"{at} is in format {detect_user_format(record)!r} but record 0 is {user_format!r}.")
        row = dict(record)
        if user_format == "messages":
            row["messages"] = normalize_messages(record["messages"], at)
            if row.get("tools") is not None and not isinstance(row["tools"], str):
                row["tools"] = json.dumps(row["tools"])
        elif user_format == "preference":
            if "prompt" not in record:
                from trl.data_utils import extract_prompt  # TRL's split of an implicit prompt (the trl extra)

                row.update(extract_prompt({"chosen": record["chosen"], "rejected": record["rejected"]}))
            row["prompt"] = _prompt(row["prompt"], at)
            row["completions"] = [_completion(row.pop("chosen"), at), _completion(row.pop("rejected"), at)]
            row["preference"] = ["chosen", "rejected"]
        elif user_format == "text":
            if not isinstance(record["text"], str):
                raise ValueError(f"{at}: 'text' must be a string, got {type(record['text']).__name__}.")
        else:
            row["prompt"] = _prompt(record["prompt"], at)
            key = "completions" if user_format == "prompt/completions" else "completion"
            if key == "completions":
                if isinstance(record[key], str) or not isinstance(record[key], Sequence):
                    raise ValueError(f"{at}: 'completions' must be a list, got {type(record[key]).__name__}.")
                row[key] = [_completion(c, at) for c in record[key]]
            else:
                row[key] = _completion(record[key], at)
        rows.append(row)
    return datasets.Dataset.from_list(rows), user_format
