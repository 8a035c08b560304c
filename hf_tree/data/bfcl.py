"""BFCL multi-turn tool-use tasks (``bfcl-eval``, Apache-2.0) replayed through their simulators into trajectories.

``bfcl-eval`` ships, for each multi-turn category, the tasks (``data/BFCL_v4_multi_turn_<category>.json``:
user turns, the initial state of the simulated APIs, which API classes are involved), their ground truth
(``data/possible_answer/...``: per user turn, the function calls that solve it, as Python call strings),
the tool documentation (``data/multi_turn_func_doc/*.json``) and the simulators themselves (a file system,
a trading bot, a travel-booking API, ...; plain Python classes under ``eval_checker/multi_turn_eval``).

A trajectory is built the way BFCL's function-calling inference loop builds one, with the ground truth in
the model's place: the simulators are loaded with the task's initial state; for each user turn, each
ground-truth call becomes an assistant message with one OpenAI-style ``tool_calls`` entry, is executed on
the simulators, and its result (converted to text as BFCL does, errors included) follows as a ``tool``
message. Calls run one per assistant message, in order, because later calls depend on earlier ones (``cd``
then ``ls``). Tool schemas are BFCL's docs converted as BFCL does for OpenAI-style function calling (types
mapped to JSON Schema), minus the task's ``excluded_function``s.

What is not there, and why: BFCL ships no assistant *text*, so a turn ends after its last tool result
(nothing is invented; BFCL's loop would end the turn on a text answer). Call strings are parsed with
``ast`` (literal arguments only, which all shipped ground truth uses) and dispatched to the simulator
methods, rather than ``eval``-ed as BFCL's own executor does. Categories whose tools or turns change
mid-conversation (``miss_func`` adds a tool at a later turn, ``miss_param`` has turns whose expected
answer is a clarifying question BFCL does not ship) are not converted; ``base`` and ``long_context``
(the same tasks with much larger simulator states) are.

The simulators import only the standard library and ``mpmath`` (the math API); ``bfcl-eval``'s declared
dependencies are not needed: install with ``pip install --no-deps bfcl-eval``.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
from collections.abc import Sequence
from typing import Any

import datasets

from hf_tree.data.packages import ConversionStats, package_file

BFCL_PACKAGE = "bfcl_eval"
BFCL_REQUIREMENT = "bfcl-eval==2026.3.23"
CATEGORIES = ("base", "long_context")


class _BfclTables:
    """BFCL's own tables (from modules that import nothing heavy): API class -> simulator module, API class ->
    tool-doc file, the stateless classes, and the Gorilla -> JSON Schema type map."""

    def __init__(self) -> None:
        package_file(BFCL_PACKAGE, BFCL_REQUIREMENT, "constants", "executable_backend_config.py")  # clear error
        from bfcl_eval.constants import executable_backend_config as backend
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

        self.modules: dict[str, str] = backend.CLASS_FILE_PATH_MAPPING
        self.doc_files: dict[str, str] = backend.MULTI_TURN_FUNC_DOC_FILE_MAPPING
        self.stateless: list[str] = backend.STATELESS_CLASSES
        self.types: dict[str, str] = GORILLA_TO_OPENAPI


def _read_jsonl(*parts: str) -> list[dict[str, Any]]:
    with open(package_file(BFCL_PACKAGE, BFCL_REQUIREMENT, "data", *parts), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _cast_schema(schema: dict[str, Any], types: dict[str, str]) -> None:
    """BFCL's OpenAI conversion of a parameter schema, in place: Gorilla types -> JSON Schema types
    (unknown or missing -> ``"string"``; ``float`` -> ``number`` with ``format: float`` and a note)."""
    for value in schema.get("properties", {}).values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
            value["description"] = value.get("description", "") + " This is a float type value."
        value["type"] = types.get(kind, "string")
        _cast_schema(value, types)
    if "items" in schema:
        schema["items"]["type"] = types.get(schema["items"].get("type"), "string")
        _cast_schema(schema["items"], types)


def _tool_schemas(
    involved_classes: Sequence[str], excluded: Sequence[str], doc_files: dict[str, str], types: dict[str, str]
) -> list[dict[str, Any]]:
    """OpenAI-style tool schemas of the involved API classes (BFCL's docs, types converted as BFCL does)."""
    tools = []
    for class_name in involved_classes:
        for doc in _read_jsonl("multi_turn_func_doc", doc_files[class_name]):
            if doc["name"] in excluded:
                continue
            doc = copy.deepcopy(doc)
            doc["parameters"]["type"] = "object"
            _cast_schema(doc["parameters"], types)
            tools.append({"type": "function", "function": doc})
    return tools


def parse_call(call: str, where: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``"mv(source='a', destination='b')"`` -> ``("mv", [], {"source": "a", "destination": "b"})``.

    Raises:
        ValueError: when ``call`` is not a single function call with literal arguments.
    """
    try:
        node = ast.parse(call.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call of a plain function name")
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"{where}: cannot parse ground-truth call {call!r} ({error}).") from error
    return node.func.id, args, kwargs


def _result_text(result: Any) -> str:
    """A call's result as BFCL puts it in the conversation: strings as they are, dicts as JSON, else ``str``."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except TypeError:
            return str(result)
    return str(result)


class _Simulators:
    """The task's API instances, loaded with its initial state; ``call`` runs one ground-truth call."""

    def __init__(self, task: dict[str, Any], long_context: bool, tables: _BfclTables) -> None:
        self.methods: dict[str, Any] = {}
        for class_name in task["involved_classes"]:
            instance = getattr(importlib.import_module(tables.modules[class_name]), class_name)()
            if class_name not in tables.stateless:
                config = copy.deepcopy(task["initial_config"].get(class_name, {}))
                instance._load_scenario(config, long_context=long_context)
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
        """(the call's arguments by parameter name, its result text). Simulator errors become the result text,
        as in BFCL (``"Error during execution: ..."``)."""
        if name not in self.methods:
            raise ValueError(f"{where}: ground truth calls {name!r}, which no involved API class provides.")
        method = self.methods[name]
        try:
            arguments = dict(inspect.signature(method).bind(*args, **kwargs).arguments)
        except TypeError as error:
            raise ValueError(f"{where}: {name}{tuple(args)} {kwargs} does not match the simulator: {error}") from error
        try:
            return arguments, _result_text(method(**arguments))
        except Exception as error:  # noqa: BLE001  (a failing call is part of the trajectory, as in BFCL)
            return arguments, f"Error during execution: {error}"


def _message(role: str, content: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    # One schema for every message (Arrow needs it), as hf_tree.data.synthetic_agent writes them.
    return {"role": role, "content": content, "reasoning_content": None, "tool_calls": tool_calls}


def replay_task(task: dict[str, Any], ground_truth: list[list[str]], long_context: bool) -> list[dict[str, Any]]:
    """The messages of one task with its ground truth executed on freshly loaded simulators."""
    where = task["id"]
    if len(ground_truth) != len(task["question"]):
        raise ValueError(f"{where}: {len(ground_truth)} ground-truth turns for {len(task['question'])} user turns.")
    simulators = _Simulators(task, long_context, _BfclTables())
    messages: list[dict[str, Any]] = []
    for turn, (user_messages, calls) in enumerate(zip(task["question"], ground_truth)):
        messages.extend(_message(m["role"], m["content"]) for m in user_messages)
        for step, call in enumerate(calls):
            name, args, kwargs = parse_call(call, f"{where} turn {turn} call {step}")
            arguments, result = simulators.call(name, args, kwargs, f"{where} turn {turn} call {step}")
            tool_call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            messages.append(_message("assistant", "", [tool_call]))
            messages.append(_message("tool", result))
    return messages


def bfcl_multi_turn_dataset(
    category: str = "base", num_tasks: int | None = None
) -> tuple[datasets.Dataset, ConversionStats]:
    """BFCL multi-turn tasks as agent trajectories: ``messages``, ``tools`` (JSON text) and ``id`` columns.

    Args:
        category: ``"base"`` or ``"long_context"`` (see the module docstring for the others).
        num_tasks: the first ``num_tasks`` tasks in file order; ``None`` = all (200 per category).

    Returns:
        ``(rows, stats)``. Render with a chat template that shows ``tool_calls`` and ``tool`` messages (e.g.
        TRL's ``qwen3.jinja``); SmolLM2's own template drops them.

    Raises:
        FileNotFoundError: when ``bfcl-eval`` is not installed (the message gives the pip command).
        ValueError: on an unsupported category or a ground-truth call the simulators cannot take.
    """
    if category not in CATEGORIES:
        raise ValueError(
            f"category={category!r} is not supported; choose one of {CATEGORIES} (miss_func and miss_param change "
            "the tools or expect unshipped clarifying answers mid-conversation)."
        )
    if num_tasks is not None and (not isinstance(num_tasks, int) or num_tasks < 1):
        raise ValueError(f"num_tasks={num_tasks!r} must be a positive integer or None.")
    tables = _BfclTables()
    tasks = _read_jsonl(f"BFCL_v4_multi_turn_{category}.json")[:num_tasks]
    answers = {
        a["id"]: a["ground_truth"] for a in _read_jsonl("possible_answer", f"BFCL_v4_multi_turn_{category}.json")
    }
    stats = ConversionStats(num_source_items=len(tasks))
    rows = []
    for task in tasks:
        if task["id"] not in answers:
            stats.skip("no ground truth shipped")
            continue
        messages = replay_task(task, answers[task["id"]], long_context=category == "long_context")
        if not any(m["role"] == "assistant" for m in messages):
            stats.skip("no ground-truth call in any turn")
            continue
        tools = _tool_schemas(
            task["involved_classes"], task.get("excluded_function", []), tables.doc_files, tables.types
        )
        rows.append({"messages": messages, "tools": json.dumps(tools), "id": task["id"]})
    stats.num_rows = len(rows)
    return datasets.Dataset.from_list(rows), stats
