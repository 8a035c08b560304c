"""TRL's vision SFT rows (``messages`` + ``images``/``image``) -> ``MediaTree`` rows for ``TreeSFTTrainer``.

TRL skips dataset preparation for vision datasets and tokenizes in its collator
(``DataCollatorForVisionLanguageModeling``): the processor's chat template renders each conversation with its
images (``prepare_multimodal_messages``), and every token but padding is a label (placeholders included). Here each
row is rendered the same way once, up front, and becomes one branch whose tokens are all trained; rows merge into one
tree per ``group_by`` value (e.g. an image id: conversations about one picture share their image and first turns),
or one tree per row.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import datasets
from transformers import ProcessorMixin
from trl.data_utils import prepare_multimodal_messages

from hf_tree.packing import packed_fallback
from hf_tree.vision.media_tree import MediaTree
from hf_tree.vision.rows import check_token_types, split_images

IMAGE_COLUMNS = ("image", "images")
# What a processor's rendering of a row may hold: tokens, the mask (all ones, one row) and the images' tensors.
RENDERED_KEYS = {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids"}


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


def render_row(row: dict[str, Any], processor: ProcessorMixin) -> tuple[list[int], list[dict]]:
    """One ``messages`` row as TRL's vision collator renders it: token ids and one tensor dict per image."""
    images = row.get("images") if "images" in row else ([row["image"]] if row.get("image") is not None else [])
    messages = prepare_multimodal_messages(row["messages"], images=images or None)
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
            f"({sorted(RENDERED_KEYS)}); such inputs (tiles, image sizes, masks) are not supported for vision SFT."
        )
    name = f"{type(processor).__name__}'s rendering"
    check_token_types(
        output, output["input_ids"], placeholder_token_id(processor), name, "vision SFT trees support images only."
    )
    tensors = split_images(output["pixel_values"], output.get("image_grid_thw"), len(images)) if images else []
    return output["input_ids"][0].tolist(), tensors


def build_media_tree_dataset(
    dataset: datasets.Dataset, processor: ProcessorMixin, group_by: str | None, name: str = "train"
) -> datasets.Dataset:
    """``MediaTree.to_dict()`` rows of a TRL vision dataset (``messages`` plus ``images`` or ``image``).

    Args:
        dataset: the rows.
        processor: the model's processor (its chat template and image processor render the rows).
        group_by: a column whose equal values merge rows into one tree, or ``None``/``"<row>"``: one tree per row.
        name: the dataset's name in errors.

    Raises:
        ValueError: for rows other than ``messages``, a ``group_by`` that is not a column, a processor without an
            image token, or placeholders that do not match the images (naming the row).
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
        rendered = [render_row(dataset[i], processor) for i in indices]
        try:
            tree = MediaTree.from_samples([r[0] for r in rendered], [r[1] for r in rendered], image_token_id)
        except ValueError as error:  # name the dataset rows, not the samples of one tree
            raise ValueError(f"the {name} dataset's rows {indices}: {error}") from error
        rows.append(tree.to_dict())
    return datasets.Dataset.from_list(rows)


def prepare_vision_sft(
    args: Any, processing_class: Any, data_collator: Any, named_datasets: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """``TreeSFTTrainer``'s set-up for vision datasets: each dataset (``None`` kept) as ``MediaTree`` rows, and the
    ``MediaTreeCollator`` of ``args``' packing fields.

    Raises:
        ValueError: for a processing class that is not a processor, a custom ``data_collator``,
            ``chat_template_path``, ``assistant_only_loss=True``, a non-map-style dataset, or what
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
    if args.assistant_only_loss:
        raise ValueError(
            "assistant_only_loss=True is not supported for vision datasets yet (every token is trained, as TRL does "
            "with assistant_only_loss=False); set it to False."
        )
    built = {}
    for name, dataset in named_datasets.items():
        if dataset is not None and not isinstance(dataset, datasets.Dataset):
            raise ValueError(f"the {name} dataset is a {type(dataset).__name__}; image trees need a datasets.Dataset.")
        built[name] = (
            None if dataset is None else build_media_tree_dataset(dataset, processing_class, args.group_by, name)
        )
    pad_token_id = processing_class.tokenizer.pad_token_id
    packing = args.packing_config()
    if packing.tree_execution == "auto":  # the default; an explicit "depth_first" is refused by MediaTreeCollator
        packing = packed_fallback(packing, "image trees: depth-first units do not carry the images' features yet")
    return built, MediaTreeCollator(packing=packing, pad_token_id=pad_token_id or 0)
