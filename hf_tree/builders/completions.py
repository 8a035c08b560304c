"""A prompt with N completions (GRPO-style groups, TRL prompt/completion rows) as branches of one tree.

Each branch is the full tokenization of prompt + completion, never prompt tokens glued to completion
tokens: a tokenizer may merge text across the boundary (``"is" + "n't"`` -> ``"isn" "'t"``), and gluing
would train on token sequences the model never sees. As in TRL's SFT, the completion (trained span)
starts where the full tokenization stops agreeing with the prompt tokenized alone; when that is before the
end of the prompt tokens the boundary merged, which is counted (``num_boundary_merges``). Merging into a
tree happens on these full token ids, so such branches just fork a token earlier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from hf_tree.builders.chat import Message, completion_start, render_ids
from hf_tree.tree import Tree, common_prefix_length

Prompt = str | Sequence[Message]
Completion = str | Message | Sequence[Message]


def is_conversational(prompt: Any) -> bool:
    """True for a list of message dicts (TRL's conversational format), False for plain text."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str)


def completion_messages(completion: Completion, where: str) -> list[Message]:
    """A conversational completion as a message list (a plain string becomes one assistant message)."""
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    if isinstance(completion, Mapping):
        return [completion]
    if isinstance(completion, Sequence):
        return list(completion)
    raise ValueError(
        f"{where}: completion is a {type(completion).__name__}; expected a string, an assistant message dict or a "
        "list of messages."
    )


def is_empty_completion(completion: Completion | None) -> bool:
    """True for ``None``, ``""``, ``[]`` or messages with no content, reasoning or tool calls."""
    if completion is None or isinstance(completion, str):
        return not completion
    messages = [completion] if isinstance(completion, Mapping) else list(completion)
    return not any(m.get("content") or m.get("reasoning_content") or m.get("tool_calls") for m in messages)


@dataclass
class CompletionBranches:
    """Branches of one prompt's completions, in input order."""

    prompt_ids: list[int]
    """The prompt tokenized alone (conversational: with the generation prompt); the grouping key."""
    sequences: list[list[int]]
    """Per completion: the full tokenization of prompt + completion."""
    loss_masks: list[list[int]]
    """Per completion: 1 on the completion tokens (from where ``sequences`` leaves ``prompt_ids``)."""
    num_boundary_merges: int
    """Completions whose full tokenization does not start with all of ``prompt_ids``."""


def tokenize_prompt(
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt alone: the chat template with the generation prompt, or ``tokenizer(text)`` (as TRL)."""
    if is_conversational(prompt):
        return render_ids(
            tokenizer,
            prompt,
            add_generation_prompt=True,
            tools=tools,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            where="prompt",
        )
    return list(tokenizer(prompt)["input_ids"])


def completions_to_branches(
    prompt: Prompt,
    completions: Sequence[Completion],
    tokenizer: PreTrainedTokenizerBase,
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_eos: bool = True,
) -> CompletionBranches:
    """Tokenize each prompt + completion in full and mask everything after the shared prompt tokens.

    Args:
        prompt: plain text, or a list of messages (rendered with the chat template).
        completions: per branch, text, or (with a conversational prompt) an assistant message dict, a list
            of messages, or text (taken as the assistant's content).
        tokenizer: the tokenizer (with a chat template for conversational prompts).
        tools, chat_template, chat_template_kwargs: passed to ``apply_chat_template``.
        add_eos: plain text only: append ``tokenizer.eos_token`` to a completion not ending with it (as TRL
            does), so the model learns to stop. Chat templates close the turn themselves.

    Raises:
        ValueError: on an empty completion, a conversational completion under a plain-text prompt, or a chat
            template whose rendering of the prompt is not a prefix of its rendering with the completion.
    """
    conversational = is_conversational(prompt)
    render_kwargs = dict(tools=tools, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    prompt_ids = tokenize_prompt(prompt, tokenizer, **render_kwargs)
    sequences, masks, merges = [], [], 0
    for c, completion in enumerate(completions):
        where = f"completion {c}"
        if is_empty_completion(completion):
            raise ValueError(f"{where} is empty ({completion!r}); drop it before building the tree.")
        if conversational:
            messages = [*prompt, *completion_messages(completion, where)]
            full = render_ids(tokenizer, messages, where=where, **render_kwargs)
            start, merged = completion_start(
                tokenizer, prompt_ids, full, prompt, messages, where=where, **render_kwargs
            )
        elif isinstance(completion, str):
            eos = tokenizer.eos_token if add_eos and tokenizer.eos_token else ""
            text = prompt + completion + ("" if completion.endswith(eos) else eos)
            full = list(tokenizer(text)["input_ids"])
            start = common_prefix_length(prompt_ids, full)  # the prompt text is a prefix by construction
            merged = start < len(prompt_ids)
        else:
            raise ValueError(f"{where} is a {type(completion).__name__} but the prompt is plain text; pass text.")
        merges += merged
        sequences.append(full)
        masks.append([0] * start + [1] * (len(full) - start))
    return CompletionBranches(prompt_ids, sequences, masks, merges)


def tree_from_completions(
    prompt: Prompt,
    completions: Sequence[Completion],
    tokenizer: PreTrainedTokenizerBase,
    branch_fields: Mapping[str, Sequence[Any]] | None = None,
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_eos: bool = True,
) -> Tree:
    """One tree of a prompt and its completions, loss on completion tokens only.

    Args:
        prompt, completions, tokenizer, tools, chat_template, chat_template_kwargs, add_eos: see
            ``completions_to_branches``.
        branch_fields: per-completion values (e.g. ``{"reward": [...], "advantage": [...]}``), one entry per
            completion; they stay attached to their branch (``Tree.branch_fields``), also through splitting.

    Raises:
        ValueError: as ``completions_to_branches`` and ``Tree.from_sequences`` (e.g. a field list whose
            length differs from the number of completions).
    """
    if len(completions) == 0:
        raise ValueError("completions is empty: a group needs at least one completion.")
    branches = completions_to_branches(
        prompt,
        completions,
        tokenizer,
        tools=tools,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        add_eos=add_eos,
    )
    return Tree.from_sequences(branches.sequences, branches.loss_masks, branch_fields)
