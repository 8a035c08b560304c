"""Branches of one conversation, rendered by the tokenizer's chat template: TRL's single rendering
(``conversation_branch``) or one branch per assistant turn (``conversation_branches``).

``conversation_branch`` is TRL's SFT tokenization of a ``messages`` row: the whole conversation rendered once
(``apply_chat_template(messages, tools=..., tokenize=True, return_assistant_tokens_mask=assistant_only_loss)``),
every token trained, or only the assistant tokens the template marks with ``{% generation %}``.

Per-turn branch ``k`` is the conversation up to and including its ``k``-th assistant message, tokenized exactly as
``tokenizer.apply_chat_template(messages[:i + 1], tools=..., tokenize=True)`` renders it (``i`` = index of
that message). A template that rewrites history (e.g. Qwen3 drops the reasoning of earlier turns) thus
gives each branch the context the model really sees at that turn; merged into a tree, the turns share the
stripped history and fork into ``reasoning -> answer`` (trained) and ``answer -> next turn`` (context).

The assistant tokens of turn ``i`` are located by rendering ``messages[:i]`` with the generation prompt and
checking it is a prefix of the branch: the tokens after it (the rendered assistant message, up to and
including what the template closes the turn with, e.g. ``<|im_end|>\\n``) are the trained span. This is
TRL's completion-mask rule (training starts where the prompt tokens and the full tokens diverge), applied
per turn.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from hf_tree.tree import Tree, common_prefix_length

logger = logging.getLogger("hf_tree")

TrainOn = Literal["last_assistant", "all_assistant"]
TRAIN_ON = ("last_assistant", "all_assistant")
MessagesBranches = Literal["conversation", "per_turn"]
MESSAGES_BRANCHES = ("conversation", "per_turn")
Message = Mapping[str, Any]


def _apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tokenize: bool,
    add_generation_prompt: bool,
    tools: Sequence[Any] | None,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    where: str,
    return_assistant_tokens_mask: bool = False,
) -> Any:
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=tokenize,
            **({"return_assistant_tokens_mask": True} if return_assistant_tokens_mask else {}),
            **dict(chat_template_kwargs or {}),
        )
    except (TemplateError, TypeError, ValueError) as error:  # a template raising, None + str, no messages
        raise ValueError(
            f"{where}: the chat template failed to render {len(messages)} messages "
            f"(add_generation_prompt={add_generation_prompt}): {type(error).__name__}: {error}"
        ) from error


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    where: str = "conversation",
) -> list[int]:
    """Token ids of ``messages`` as ``tokenizer.apply_chat_template(..., tokenize=True)`` renders them.

    Raises:
        ValueError: (starting with ``where``) when the template fails, e.g. on a ``None`` content it
            concatenates, or a role it rejects.
    """
    encoded = _apply_chat_template(
        tokenizer,
        messages,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        where=where,
    )
    return list(encoded["input_ids"])


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    where: str = "conversation",
) -> str:
    """The text ``render_ids`` tokenizes."""
    return _apply_chat_template(
        tokenizer,
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        where=where,
    )


def describe_divergence(tokenizer: PreTrainedTokenizerBase, prefix: Sequence[int], full: Sequence[int]) -> str:
    """A short human-readable account of where ``prefix`` stops being a prefix of ``full``."""
    at = common_prefix_length(prefix, full)
    return (
        f"they diverge at token {at}: the prefix continues with {tokenizer.decode(list(prefix[at : at + 12]))!r} "
        f"but the full rendering has {tokenizer.decode(list(full[at : at + 12]))!r}"
    )


def completion_start(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    full_ids: Sequence[int],
    prompt_messages: Sequence[Message],
    messages: Sequence[Message],
    *,
    where: str,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[int, bool]:
    """Where the assistant tokens start in ``full_ids`` (``messages`` rendered) after ``prompt_ids``
    (``prompt_messages`` rendered with the generation prompt), and whether the boundary tokens merged.

    Normally ``prompt_ids`` is a token prefix and the start is its length. Otherwise the rendered texts
    decide: if the prompt text is still a prefix, the tokenizer merged text across the boundary (e.g.
    ``"\\n"`` + ``"\\nHi"`` -> ``"\\n\\n"``) and training starts at the first differing token, as in TRL's
    SFT; if not, the template renders the prompt differently and the assistant tokens cannot be located.

    Raises:
        ValueError: (starting with ``where``) when the template breaks the prefix property.
    """
    start = common_prefix_length(prompt_ids, full_ids)
    if start == len(prompt_ids):
        return start, False
    render_kwargs = dict(tools=tools, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    full_text = render_text(tokenizer, messages, where=where, **render_kwargs)
    prompt_text = render_text(tokenizer, prompt_messages, add_generation_prompt=True, where=where, **render_kwargs)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            f"{where}: the chat template's rendering of the {len(prompt_messages)} messages before it with "
            f"add_generation_prompt=True is not a prefix of its rendering with the assistant message "
            f"({describe_divergence(tokenizer, prompt_ids, full_ids)}), so the assistant tokens cannot be located. "
            "Use a template that renders the generation prompt the way it renders the assistant turn "
            "(see TRL's *_training.jinja templates)."
        )
    return start, True


def conversation_branch(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    assistant_only_loss: bool = False,
    chat_template: str | None = None,
    where: str = "conversation",
) -> tuple[list[int], list[int]]:
    """TRL's SFT branch of a ``messages`` row: ``(tokens, loss_mask)`` of the conversation rendered once.

    Mirrors ``trl.SFTTrainer``'s tokenization of conversational language-modeling rows (TRL 1.16,
    ``_prepare_dataset``): ``apply_chat_template(messages, tools=..., chat_template=..., tokenize=True,
    return_assistant_tokens_mask=assistant_only_loss, **chat_template_kwargs)``. The mask is all ones
    (``assistant_only_loss=False``, TRL's default: every token after the first is trained) or the template's
    assistant mask (its ``{% generation %}`` blocks).

    Raises:
        ValueError: (starting with ``where``) when the template fails to render, or, with
            ``assistant_only_loss=True``, marks no assistant token (TRL raises there too: the template lacks
            ``{% generation %}`` markers, or the conversation has no assistant message).
    """
    for i in range(len(messages)):
        _check_message(messages, i, where)
    encoded = _apply_chat_template(
        tokenizer,
        messages,
        tokenize=True,
        add_generation_prompt=False,
        tools=tools,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        where=where,
        return_assistant_tokens_mask=assistant_only_loss,
    )
    tokens = list(encoded["input_ids"])
    if not assistant_only_loss:
        return tokens, [1] * len(tokens)
    mask = [int(bit) for bit in encoded["assistant_masks"]]
    if 1 not in mask:
        raise ValueError(
            f"{where}: assistant_only_loss=True, but the chat template marks no assistant token in this conversation "
            f"(roles: {[m['role'] for m in messages]}). The template needs {{% generation %}}...{{% endgeneration %}} "
            "around the assistant output (see TRL's *_training.jinja templates), and the conversation an assistant "
            "message; or set assistant_only_loss=False to train every token."
        )
    return tokens, mask


def _check_message(messages: Sequence[Message], i: int, where: str = "conversation") -> None:
    """Raise for a message without a role; warn (naming ``where``, e.g. the row) for an assistant message with
    nothing in it: no content, tool call or reasoning. Such a message is trained as TRL trains it (the template's
    tokens around an empty answer), which is rarely what the data means."""
    message = messages[i]
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"messages[{i}] is {message!r}; every message must be a dict with a 'role' key.")
    if message["role"] == "assistant" and not any(
        _has_content(message.get(key)) for key in ("content", "tool_calls", "reasoning_content")
    ):
        logger.warning(
            "%s: assistant message %d has empty content; it is trained as TRL trains it (the chat template's tokens "
            "around an empty answer). Fill it, or drop the row if that is not meant.",
            where,
            i,
        )


def _has_content(value: Any) -> bool:
    """Whether a message field holds anything: non-blank text, or a non-empty list (content parts, tool calls)
    with a part that is not blank text."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, Sequence):
        return any(not isinstance(p, Mapping) or p.get("type") != "text" or _has_content(p.get("text")) for p in value)
    return value is not None


def conversation_to_branches(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    train_on: TrainOn = "last_assistant",
    chat_template: str | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """One branch per assistant message: ``(sequences, loss_masks)``, masks one 0/1 per token.

    Args:
        messages: a conversation (``role``/``content`` dicts; assistant messages may carry
            ``reasoning_content`` and ``tool_calls``, and ``tool`` messages answer them, when the template
            renders those). Messages after the last assistant message are not part of any branch.
        tokenizer: a tokenizer with a chat template (or pass ``chat_template``).
        tools: tool schemas given to the template (``apply_chat_template(tools=...)``).
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": True}``).
        train_on: ``"last_assistant"`` (default): each branch trains only its own final assistant message.
            Earlier assistant messages are trained by their own branch, in the context the template gives
            them at their turn (with their reasoning, when a template strips it from later turns), so every
            assistant message is trained exactly once. ``"all_assistant"``: each branch trains every
            assistant message it contains (TRL's ``assistant_only_loss`` applied to each per-turn sample),
            so turn ``j`` of ``T`` is trained ``T - j`` times; it needs a template that renders earlier
            turns identically in later turns and raises ``ValueError`` for one that rewrites them.
        chat_template: a Jinja template used instead of the tokenizer's own.

    Returns:
        ``(sequences, loss_masks)``: empty lists when there is no assistant message.

    Raises:
        ValueError: on a bad ``train_on`` or message, a template that fails to render a turn, or a template
            whose rendering of the history with the generation prompt is not a prefix of its rendering with
            the assistant message (the assistant tokens could not be located), naming the turn. When only the
            tokens disagree (the tokenizer merged text across that boundary), the branch is the full
            tokenization and training starts at the merged token (see ``conversation_branches``).
    """
    sequences, masks, _ = conversation_branches(
        messages, tokenizer, tools, chat_template_kwargs, train_on=train_on, chat_template=chat_template
    )
    return sequences, masks


def conversation_branches(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    train_on: TrainOn = "last_assistant",
    chat_template: str | None = None,
    where: str = "conversation",
) -> tuple[list[list[int]], list[list[int]], int]:
    """``conversation_to_branches`` plus the number of turns whose tokens merged across the boundary
    between the generation prompt and the assistant message (see ``completion_start``); ``where`` names the
    conversation in warnings."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r} must be one of {TRAIN_ON}.")
    render_kwargs = dict(tools=tools, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    sequences: list[list[int]] = []
    masks: list[list[int]] = []
    spans: list[tuple[int, int]] = []  # (start, end) of each branch's own assistant tokens
    merges = 0
    for i in range(len(messages)):
        _check_message(messages, i, where)
        if messages[i]["role"] != "assistant":
            continue
        turn = f"assistant message {i} (turn {len(sequences)})"
        full = render_ids(tokenizer, messages[: i + 1], where=turn, **render_kwargs)
        prompt = render_ids(tokenizer, messages[:i], add_generation_prompt=True, where=turn, **render_kwargs)
        start, merged = completion_start(
            tokenizer, prompt, full, messages[:i], messages[: i + 1], where=turn, **render_kwargs
        )
        merges += merged
        mask = [0] * start + [1] * (len(full) - start)
        if train_on == "all_assistant":
            for j, (span_start, span_end) in enumerate(spans):
                if full[:span_end] != sequences[j]:
                    raise ValueError(
                        f"{turn}: train_on='all_assistant' needs earlier turns rendered identically in later ones, "
                        f"but turn {j} renders differently here "
                        f"({describe_divergence(tokenizer, sequences[j], full)}), e.g. because the template strips "
                        "earlier reasoning. Use train_on='last_assistant', which trains every turn once in the "
                        "context it was generated in."
                    )
                mask[span_start:span_end] = [1] * (span_end - span_start)
        spans.append((start, len(full)))
        sequences.append(full)
        masks.append(mask)
    return sequences, masks, merges


def tree_from_conversation(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    train_on: TrainOn = "last_assistant",
    chat_template: str | None = None,
) -> Tree:
    """The tree of a conversation's per-turn branches (see ``conversation_to_branches``).

    Raises:
        ValueError: as ``conversation_to_branches``, or when the conversation has no assistant message or no
            trained token.
    """
    sequences, masks = conversation_to_branches(
        messages, tokenizer, tools, chat_template_kwargs, train_on=train_on, chat_template=chat_template
    )
    if not sequences:
        raise ValueError(
            f"the conversation has no assistant message (roles: {[m['role'] for m in messages]}); "
            "there is nothing to train."
        )
    return Tree.from_sequences(sequences, masks)
