"""TRL's vision SFT rows (``messages`` + ``images``/``image``) -> ``MediaTree`` rows for ``TreeSFTTrainer``.

TRL skips dataset preparation for vision datasets and tokenizes in its collator
(``DataCollatorForVisionLanguageModeling``): the processor's chat template renders each conversation with its
images (``prepare_multimodal_messages``), and every token but padding is a label (placeholders included) or, with
``assistant_only_loss``, the template's assistant tokens (``return_assistant_tokens_mask``). Here each row is rendered
the same way once, up front, and becomes one branch (or, with ``messages_branches="per_turn"``, one branch per
assistant turn, rendered as the text rows' per-turn branches are, ``hf_tree.builders.chat``, each showing the images of
its history); rows merge into one tree per ``group_by`` value (e.g. an image id: conversations about one picture share
their image and first turns), or one tree per row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import datasets
from transformers import ProcessorMixin

from hf_tree.builders.chat import conversation_branch, conversation_branches
from hf_tree.packing import packed_fallback
from hf_tree.vision.media_tree import MediaTree, placeholder_runs
from hf_tree.vision.rows import check_token_types, split_images

IMAGE_COLUMNS = ("image", "images")
# What a processor's rendering of a row may hold: tokens, the mask (all ones, one row) and the images' tensors
# (LLaVA-Next: tiles ``[images, tiles, C, H, W]`` with ``image_sizes``).
RENDERED_KEYS = {
    "input_ids",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "mm_token_type_ids",
    "token_type_ids",
}


def placeholder_token_id(processor: ProcessorMixin) -> int | None:
    """The token each image's features replace: the tokenizer's image token where it names one (Gemma 3's processor
    calls its begin-of-image token ``image_token_id``), else the processor's ``image_token_id``."""
    tokenizer = getattr(processor, "tokenizer", None)
    token = getattr(tokenizer, "image_token", None)
    return tokenizer.convert_tokens_to_ids(token) if token else getattr(processor, "image_token_id", None)


def is_vision_dataset(dataset: Any) -> bool:
    """TRL's test: an ``image`` or ``images`` column (of any dataset of a dict of datasets)."""
    if isinstance(dataset, dict):
        return any(is_vision_dataset(d) for d in dataset.values())
    return bool(set(IMAGE_COLUMNS) & set(getattr(dataset, "column_names", None) or ()))


class ProcessorTemplate:
    """A processor as the tokenizer ``hf_tree.builders.chat`` renders with: its chat template applied to
    ``messages`` whose image parts hold the images (``prepare_multimodal_messages``), tokenized as TRL's vision
    collator does (no added special tokens); token ids (and ``assistant_masks``) of the one conversation as lists."""

    def __init__(self, processor: ProcessorMixin) -> None:
        self.processor = processor

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool, **options: Any) -> Any:
        if not tokenize:
            return self.processor.apply_chat_template(messages, tokenize=False, **options)
        output = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            return_tensors="pt",
            processor_kwargs={"add_special_tokens": False},  # TRL's collator: the template holds the special tokens
            **options,
        )
        return {key: output[key][0].tolist() for key in ("input_ids", "assistant_masks") if key in output}

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids)


def row_messages(row: dict[str, Any]) -> list[dict]:
    """The row's messages with its images in their image parts (TRL's ``prepare_multimodal_messages``)."""
    from trl.data_utils import prepare_multimodal_messages  # here: is_vision_dataset and the core need no TRL

    images = row.get("images") if "images" in row else ([row["image"]] if row.get("image") is not None else [])
    return prepare_multimodal_messages(row["messages"], images=images or None)


def images_shown(messages: list[dict]) -> int:
    """Image parts of ``messages`` (the images a rendering of them shows)."""
    return sum(
        part.get("type") == "image"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def render_images(messages: list[dict], processor: ProcessorMixin) -> tuple[list[int], list[dict]]:
    """``messages`` as TRL's vision collator renders them: token ids and one tensor dict per image."""
    output = processor.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"add_special_tokens": False},  # TRL's collator: the template holds the special tokens
    )
    other = sorted(set(output) - RENDERED_KEYS)
    if other:
        raise ValueError(
            f"{type(processor).__name__} returns {other} besides the image tensors hf_tree.vision's SFT rows keep "
            f"({sorted(RENDERED_KEYS)}); such inputs (pixel masks, split-image tiles) are not supported for vision "
            "SFT: build hf_tree.vision.MediaTree rows and train them with TreeTrainer and MediaTreeCollator instead."
        )
    name = f"{type(processor).__name__}'s rendering"
    check_token_types(
        output, output["input_ids"], placeholder_token_id(processor), name, "vision SFT trees support images only."
    )
    count = images_shown(messages)
    grid, sizes = output.get("image_grid_thw"), output.get("image_sizes")
    tensors = split_images(output["pixel_values"], grid, count, image_sizes=sizes) if count else []
    return output["input_ids"][0].tolist(), tensors


@dataclass(frozen=True)
class VisionBranches:
    """Which branches a vision ``messages`` row becomes: ``TreeSFTConfig``'s objective fields, as the text rows
    read them (``hf_tree.builders.chat``).

    Attributes:
        messages_branches: ``"conversation"``: the row rendered once, every token trained or, with
            ``assistant_only_loss``, the template's assistant tokens (TRL's vision collator); ``"per_turn"``: one
            branch per assistant turn showing the images of its history, its assistant tokens trained (``train_on``).
        train_on: ``"last_assistant"`` or ``"all_assistant"`` (``per_turn`` only).
        assistant_only_loss: TRL's option (``conversation`` only).
        chat_template: the template to render with (TRL's training template where ``assistant_only_loss`` needs one),
            ``None`` for the processor's own.
    """

    messages_branches: str = "conversation"
    train_on: str | None = None
    assistant_only_loss: bool = False
    chat_template: str | None = None

    def of_row(
        self, row: dict[str, Any], processor: ProcessorMixin
    ) -> tuple[list[list[int]], list[list[int]], list[list[dict]], list[list[int]]]:
        """``(sequences, loss_masks, images, image_lengths)`` of one row's branches (``MediaTree.from_samples``'
        arguments)."""
        messages = row_messages(row)
        ids, images = render_images(messages, processor)  # the images' tensors (and the rendering TRL trains)
        lengths = image_lengths(messages, processor, ids, len(images))
        chat, template = ProcessorTemplate(processor), self.chat_template
        if self.messages_branches == "per_turn":
            sequences, masks, _ = conversation_branches(
                messages, chat, train_on=self.train_on or "last_assistant", chat_template=template
            )
            if not sequences:
                raise ValueError(
                    f"messages_branches='per_turn' but the conversation has no assistant message (roles: "
                    f"{[m['role'] for m in messages]}): there is nothing to train."
                )
            shown = [images_shown(messages[: i + 1]) for i, m in enumerate(messages) if m["role"] == "assistant"]
            return sequences, masks, [images[:n] for n in shown], [lengths[:n] for n in shown]
        if self.assistant_only_loss:
            tokens, mask = conversation_branch(messages, chat, assistant_only_loss=True, chat_template=template)
            return [tokens], [mask], [images], [lengths]
        return [ids], [[1] * len(ids)], [images], [lengths]


def image_lengths(messages: list[dict], processor: ProcessorMixin, ids: list[int], count: int) -> list[int]:
    """The placeholder tokens of each of the ``count`` images of ``messages`` (rendered as ``ids``): each image's
    placeholders when the processor renders it alone, where adjacent images share a run of placeholders (LLaVA's
    ``<image><image>``); else each run's length."""
    image_token_id = placeholder_token_id(processor)
    runs = placeholder_runs(ids, image_token_id)
    if len(runs) == count:
        return [end - start for start, end in runs]
    parts = [part for message in messages for part in message.get("content") or () if part.get("type") == "image"]
    return [render_images([{"role": "user", "content": [part]}], processor)[0].count(image_token_id) for part in parts]


def training_chat_template(processor: ProcessorMixin, assistant_only_loss: bool) -> str | None:
    """TRL's ``SFTTrainer.chat_template``: its training template (``{% generation %}`` markers) when
    ``assistant_only_loss`` needs one and the processor's own template lacks them, else ``None``."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if assistant_only_loss and not has_generation_markers(processor.chat_template):
        return get_training_chat_template(processor)
    return None


def build_media_tree_dataset(
    dataset: datasets.Dataset,
    processor: ProcessorMixin,
    group_by: str | None,
    name: str = "train",
    branches: VisionBranches = VisionBranches(),
    max_branch_tokens: int | None = None,
) -> datasets.Dataset:
    """``MediaTree.to_dict()`` rows of a TRL vision dataset (``messages`` plus ``images`` or ``image``).

    Args:
        dataset: the rows.
        processor: the model's processor (its chat template and image processor render the rows).
        group_by: a column whose equal values merge rows into one tree, or ``None``/``"<row>"``: one tree per row.
        name: the dataset's name in errors.
        branches: the branches of each row and their trained tokens.
        max_branch_tokens: a branch longer than this is refused here, naming the row (``overlong="error"``; image
            branches are never truncated); ``None``: no limit checked.

    Raises:
        ValueError: for rows other than ``messages``, a ``group_by`` that is not a column, a processor without an
            image token, a branch longer than ``max_branch_tokens``, placeholders that do not match the images, or a
            row ``branches`` cannot build (naming the row).
    """
    if "messages" not in dataset.column_names:
        raise ValueError(
            f"the {name} dataset has columns {dataset.column_names}: TreeSFTTrainer builds image trees from TRL's "
            "'messages' + 'images' (or 'image') rows only; map prompt/completion rows into 'messages' first."
        )
    if group_by not in (None, "<row>") and group_by not in dataset.column_names:
        raise ValueError(
            f"group_by={group_by!r} is not a column of the {name} dataset ({dataset.column_names}); vision rows merge "
            "by a column (e.g. an image id) or not at all (None or '<row>')."
        )
    image_token_id = placeholder_token_id(processor)
    if image_token_id is None:
        raise ValueError(f"{type(processor).__name__} has no image_token_id; pass the model's processor.")
    groups: dict[Any, list[int]] = defaultdict(list)
    for index in range(len(dataset)):
        groups[index if group_by in (None, "<row>") else dataset[index][group_by]].append(index)
    rows = []
    for indices in groups.values():
        sequences, masks, images, lengths = [], [], [], []
        try:
            for i in indices:
                row_sequences, row_masks, row_images, row_lengths = branches.of_row(dataset[i], processor)
                longest = max(len(s) for s in row_sequences)
                if max_branch_tokens is not None and longest > max_branch_tokens:
                    raise ValueError(
                        f"row {i} has a branch of {longest} tokens, more than max_branch_tokens={max_branch_tokens} "
                        "(TRL's max_length, capped at max_packed_tokens with tree_execution='packed'). Image branches "
                        "are never truncated (a cut would split an image's placeholders): raise max_length (None: no "
                        "limit) and max_packed_tokens, or set overlong='drop' to leave such branches out (counted)."
                    )
                sequences += row_sequences
                masks += row_masks
                images += row_images
                lengths += row_lengths
            tree = MediaTree.from_samples(sequences, images, image_token_id, masks, image_lengths=lengths)
        except ValueError as error:  # name the dataset rows, not the samples of one tree
            raise ValueError(f"the {name} dataset's rows {indices}: {error}") from error
        rows.append(tree.to_dict())
    return datasets.Dataset.from_list(rows)


def prepare_vision_sft(
    args: Any, processing_class: Any, data_collator: Any, named_datasets: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """``TreeSFTTrainer``'s set-up for vision datasets: each dataset (``None`` kept) as ``MediaTree`` rows, and the
    ``MediaTreeCollator`` of ``args``' packing fields.

    Every ``TreeSFTConfig`` field that changes the objective is honoured as on text rows (``messages_branches``,
    ``train_on``, ``assistant_only_loss`` with TRL's training template, ``normalization``, ``loss_type``, ...) or
    refused here (tests/test_vision_sft_options.py walks them).

    Raises:
        ValueError: for a processing class that is not a processor, a custom ``data_collator``,
            ``chat_template_path``, ``completion_only_loss=True`` (TRL's vision collator refuses it on ``messages``
            rows), what ``MediaTreeCollator`` refuses
            (``overlong="truncate"``, depth-first execution), a non-map-style dataset, or what
            ``build_media_tree_dataset`` refuses.
    """
    from hf_tree.vision.collator import MediaTreeCollator

    if not isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            f"a vision dataset needs the model's processor as processing_class, not {type(processing_class).__name__}: "
            "its chat template and image processor render the rows."
        )
    if data_collator is not None:
        raise ValueError("a vision dataset is packed by hf_tree.vision.MediaTreeCollator; do not pass data_collator.")
    if getattr(args, "chat_template_path", None):
        raise ValueError(
            "chat_template_path cannot apply to vision datasets yet: rows are rendered with the processor's own chat "
            "template; set the template on the processor instead."
        )
    if args.completion_only_loss:
        raise ValueError(
            "completion_only_loss=True cannot apply to vision 'messages' rows (TRL's vision collator refuses it for "
            "language-modeling rows too): set assistant_only_loss=True to train the assistant tokens, or "
            "messages_branches='per_turn'; or leave completion_only_loss unset."
        )
    packing = args.packing_config()
    if packing.overlong == "truncate":  # TreeSFTConfig's default: a cut could split an image, so a longer branch is
        packing = replace(packing, overlong="error")  # refused here naming its row, never cut
    if packing.tree_execution == "auto":  # the default; an explicit "depth_first" is refused by MediaTreeCollator
        packing = packed_fallback(packing, "image trees: depth-first units do not carry the images' features yet")
    collator = MediaTreeCollator(packing=packing, pad_token_id=processing_class.tokenizer.pad_token_id or 0)
    branches = VisionBranches(
        messages_branches=args.messages_branches,
        train_on=args.train_on,
        assistant_only_loss=args.assistant_only_loss and args.messages_branches == "conversation",
        chat_template=training_chat_template(processing_class, args.assistant_only_loss),
    )
    limit = packing.branch_limit if packing.overlong == "error" else None  # refused here, before any step
    built = {}
    for name, dataset in named_datasets.items():
        if dataset is not None and not isinstance(dataset, datasets.Dataset):
            raise ValueError(f"the {name} dataset is a {type(dataset).__name__}; image trees need a datasets.Dataset.")
        built[name] = (
            None
            if dataset is None
            else build_media_tree_dataset(dataset, processing_class, args.group_by, name, branches, limit)
        )
    return built, collator
