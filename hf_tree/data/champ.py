"""CHAMP (``champ-dataset==1.0.0``, MIT): competition math problems answered by four models with identical prompts.

The package ships ``dataset_files/v0.json``: 270 problems, each with 72 conversations = 18 prompt types
(``0-Shot``, ``5-Shot``, partial solutions, concept/hint variants, ...) x 4 models (GPT-3.5, GPT-4, GPT-4
Turbo, PaLM 2 Medium). The four models of one (problem, prompt type) saw the same prompt messages, so their
first answers are a natural group of completions: one tree per group, like a GRPO group with 4 samples.

Conversion (one row per conversation, TRL ``prompt``/``completion`` format, conversational):

- ``prompt``: the messages before the model's first answer. ``System``/``User`` become ``system``/``user``;
  ``Imputation`` messages (the worked examples of few-shot prompts, written by the authors and shown to
  the model as its own earlier turns) become ``assistant`` messages of the prompt, so they are context and
  never trained.
- ``completion``: the model's first answer as an assistant message.
- ``model``, ``problem_id``, ``prompt_type``: kept as columns (``model`` is useful as a branch field).

Left out: the follow-up turn every conversation has ("Now, summarize the answer above in one sentence")
and its one-line answer, which adds no shared prefix beyond the answer itself; and, unless
``include_truncated``, answers the source marks as cut at the generation length limit (counted).

The JSON file is read directly (the package's own loader needs ``natsort`` and is not used).
``build_tree_dataset(rows, tokenizer)`` then merges rows with identical prompt tokens into trees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import datasets

from hf_tree.data.packages import ConversionStats, package_file

CHAMP_PACKAGE = "champ_dataset"
CHAMP_REQUIREMENT = "champ-dataset==1.0.0"
CHAMP_FILE = ("dataset_files", "v0.json")
ROLES = {"System": "system", "User": "user", "Imputation": "assistant"}
TRUNCATED = "LENGTH_CURRENT"  # the source's mark of an answer cut at the generation length limit


def champ_json_path():
    """``dataset_files/v0.json`` inside the installed ``champ-dataset`` package (see ``package_file``)."""
    return package_file(CHAMP_PACKAGE, CHAMP_REQUIREMENT, *CHAMP_FILE)


def _prompt_and_answer(messages: list[dict[str, Any]], where: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(prompt messages in chat format, the first model message) of one source conversation."""
    first = next((i for i, m in enumerate(messages) if m["role"].startswith("Model.")), None)
    if first is None:
        raise ValueError(f"{where}: the conversation has no 'Model.*' message; the source file is not CHAMP v0.")
    prompt = []
    for m in messages[:first]:
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: unknown role {m['role']!r} before the first answer; expected {sorted(ROLES)}.")
        prompt.append({"role": ROLES[m["role"]], "content": m["text"]})
    return prompt, messages[first]


def champ_dataset(
    prompt_types: Sequence[str] | None = None,
    models: Sequence[str] | None = None,
    num_problems: int | None = None,
    include_truncated: bool = False,
) -> tuple[datasets.Dataset, ConversionStats]:
    """CHAMP conversations as ``prompt``/``completion`` rows (see the module docstring).

    Args:
        prompt_types: keep only these prompt types (e.g. ``["0-Shot"]``: short prompts, dedup ratio ~1.1 with
            SmolLM2's tokenizer; ``["5-Shot"]``: long few-shot prompts, ~2.6); ``None`` keeps all 18.
        models: keep only these models (``"GPT-3.5"``, ``"GPT-4"``, ``"GPT-4 Turbo"``, ``"PaLM 2 Medium"``).
        num_problems: the first ``num_problems`` problems in file order; ``None`` = all 270.
        include_truncated: keep answers cut at the source's generation length limit.

    Returns:
        ``(rows, stats)``: columns ``prompt`` (messages), ``completion`` (assistant message), ``model``,
        ``problem_id``, ``prompt_type``, in file order; ``stats`` counts conversations read and skipped.

    Raises:
        FileNotFoundError: when ``champ-dataset`` is not installed (the message gives the pip command).
        ValueError: on a prompt type or model that the file does not contain, or an unexpected file layout.
    """
    if num_problems is not None and (not isinstance(num_problems, int) or num_problems < 1):
        raise ValueError(f"num_problems={num_problems!r} must be a positive integer or None.")
    with open(champ_json_path(), encoding="utf-8") as f:
        problems = list(json.load(f)["problems"].values())
    keys = [key.split("|", 1) for key in problems[0]["conversations"]]
    for name, wanted, available in (
        ("prompt_types", prompt_types, {t for _, t in keys}),
        ("models", models, {m for m, _ in keys}),
    ):
        unknown = sorted(set(wanted or ()) - available)
        if unknown:
            raise ValueError(f"{name} holds {unknown}, which CHAMP does not have; choose from {sorted(available)}.")

    rows: list[dict[str, Any]] = []
    stats = ConversionStats()
    for problem in problems[:num_problems]:
        for key, conversation in problem["conversations"].items():
            model, prompt_type = key.split("|", 1)
            if (prompt_types and prompt_type not in prompt_types) or (models and model not in models):
                continue
            stats.num_source_items += 1
            prompt, answer = _prompt_and_answer(conversation["messages"], f"{problem['identifier']} {key}")
            if answer.get("error") == TRUNCATED and not include_truncated:
                stats.skip("answer truncated at the source's length limit")
                continue
            rows.append(
                {
                    "prompt": prompt,
                    "completion": {"role": "assistant", "content": answer["text"]},
                    "model": model,
                    "problem_id": problem["identifier"],
                    "prompt_type": prompt_type,
                }
            )
    stats.num_rows = len(rows)
    return datasets.Dataset.from_list(rows), stats
