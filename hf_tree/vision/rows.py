"""Images of padded ``[B, T]`` rows (TRL's GRPO batches) for the tree log-prob passes.

TRL hands the policy, reference and old-policy passes a padded batch with the processor's tensors of every row's
images concatenated (``pixel_values``, ``image_grid_thw``, ``num_images`` per row): a group of G completions carries
G copies of its prompt's images. ``RowMedia.from_rows`` splits them per image, keeps each distinct image once
(``MediaStore``) and writes each placeholder run as its image's trie id, so ``layout_scored_rows`` merges rows by
tokens *and* images; ``RowMedia.model_inputs`` turns packed rows back into the model's inputs (each image encoded
once per backbone call, ``hf_tree.vision.forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_tree.models.introspection import causal_lm_of
from hf_tree.vision.collator import attach_media
from hf_tree.vision.forward import image_feature_lengths, vision_family, vision_model_inputs
from hf_tree.vision.media_tree import MEDIA_TOKEN_BASE, MediaStore, placeholder_runs, split_runs

# Row inputs TRL's GRPO passes for the supported families; ``from_rows`` consumes them. ``token_type_ids`` is Gemma 3's
# name for ``mm_token_type_ids`` (its processor renames them); the packed forward rebuilds its image blocks from the
# placeholders (``hf_tree.vision.forward.image_blocks``).
ROW_IMAGE_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "num_images",
    "mm_token_type_ids",
    "token_type_ids",
)
TOKEN_TYPE_INPUTS = ("mm_token_type_ids", "token_type_ids")
# Families whose TRL row inputs are exactly those (tests/test_vision_trl.py compares them with TRL's GRPO passes);
# Idefics3/SmolVLM also pass pixel_attention_mask and are refused by the tree log-prob head.
ROW_FAMILIES = ("gemma3", "llava", "llava_next", "qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_vl")


def check_token_types(
    inputs: dict[str, Any], input_ids: torch.Tensor, image_token_id: int, name: str, fix: str
) -> None:
    """Raise ``ValueError`` (``name``, then ``fix``) unless each of ``inputs``' ``TOKEN_TYPE_INPUTS`` (``[B, T]``;
    absent or ``None`` is fine) marks exactly the image placeholders of ``input_ids [B, T]``: the trees rebuild them,
    and Gemma 3's image blocks, from the placeholders."""
    for key in TOKEN_TYPE_INPUTS:
        types = inputs.get(key)
        if types is not None and not torch.equal(types.cpu() != 0, input_ids.cpu() == image_token_id):
            raise ValueError(f"{name}: {key} marks other tokens than the image placeholders (videos?); {fix}")


def split_images(
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    num_images: int,
    name: str = "model",
    image_sizes: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """A processor's concatenated image tensors -> one dict per image (``MediaTree.media``'s form).

    Args:
        pixel_values: Qwen: ``[patches, D]`` (``image_grid_thw.prod(-1)`` rows per image); LLaVA: ``[images, C, H, W]``;
            LLaVA-Next: ``[images, tiles, C, H, W]`` (tiles zero-padded to the batch's most; each image keeps them).
        image_grid_thw: ``[images, 3]`` or ``None``.
        num_images: how many images the tensors hold.
        name: how errors refer to the model.
        image_sizes: LLaVA-Next: ``[images, 2]``, each image's own ``[1, 2]``; or ``None``.
    """
    sizes = image_grid_thw.prod(-1).tolist() if image_grid_thw is not None else [1] * num_images
    if len(sizes) != num_images or sum(sizes) != pixel_values.shape[0]:
        raise ValueError(
            f"{name}: pixel_values has {pixel_values.shape[0]} rows but the {num_images} images need {sum(sizes)}; "
            "pass the processor's pixel_values (and image_grid_thw) of these rows."
        )
    if image_sizes is not None and len(image_sizes) != num_images:
        raise ValueError(f"{name}: image_sizes has {len(image_sizes)} rows for {num_images} images.")
    images = [{"pixel_values": pixels} for pixels in torch.split(pixel_values, sizes)]
    for m, image in enumerate(images):
        if image_grid_thw is not None:
            image["image_grid_thw"] = image_grid_thw[m : m + 1]
        if image_sizes is not None:
            image["image_sizes"] = image_sizes[m : m + 1]
    return images


@dataclass
class RowMedia:
    """A batch's distinct images and its rows with placeholders written as trie media ids.

    Attributes:
        model: the vision-language model (may be PEFT-wrapped).
        input_ids: ``[B, T]`` the rows, each image's placeholder run as ``MEDIA_TOKEN_BASE + image``.
        images: per distinct image, its processor tensors.
        image_token_id: the model's placeholder token.
    """

    model: torch.nn.Module
    input_ids: torch.Tensor
    images: list[dict[str, torch.Tensor]]
    image_token_id: int

    @classmethod
    def from_rows(
        cls, model: torch.nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any], name: str = "model"
    ) -> RowMedia | None:
        """Take the image inputs (``ROW_IMAGE_INPUTS``) out of ``inputs``; ``None`` when there are no images.

        Adjacent images' placeholders (LLaVA's ``<image><image>``) form one run, split by each image's placeholder
        count: its feature rows, from the model's own encoder run once more without gradients (only for such rows).

        Args:
            model: the vision-language model.
            input_ids: ``[B, T]`` padded rows.
            inputs: the other forward inputs; ``pixel_values`` (Qwen: ``[patches, D]`` with ``image_grid_thw``
                ``[images, 3]``; LLaVA, Gemma 3: ``[images, C, H, W]``; LLaVA-Next: ``[images, tiles, C, H, W]`` with
                ``image_sizes`` ``[images, 2]``), ``num_images`` (list, per row) and ``mm_token_type_ids`` (Gemma 3:
                ``token_type_ids``) ``[B, T]`` are removed from it.
            name: how errors refer to the model.

        Raises:
            ValueError: for a model ``hf_tree.vision`` does not support, rows whose placeholder runs do not match
                ``num_images`` or the images, or (mm_)``token_type_ids`` marking other tokens than the image
                placeholders (videos).
        """
        # token_type_ids mark image tokens only in the vision families; a text model's (GPT-2 adds their embeddings)
        # stay in ``inputs``, where the tree head refuses them
        vision_rows = causal_lm_of(model).config.model_type in ROW_FAMILIES
        given = {k: inputs.pop(k, None) if vision_rows or k != "token_type_ids" else None for k in ROW_IMAGE_INPUTS}
        pixel_values, grid = given["pixel_values"], given["image_grid_thw"]
        if pixel_values is None:
            return None
        try:
            vision_family(model)
        except ValueError as error:
            raise ValueError(f"{name} got pixel_values: {error}") from error
        image_token_id = int(causal_lm_of(model).config.image_token_id)
        rows = input_ids.cpu()
        runs = [(row, *run) for row, ids in enumerate(rows) for run in placeholder_runs(ids, image_token_id)]
        count = len(grid) if grid is not None else len(pixel_values)
        images = split_images(pixel_values, grid, count, name, image_sizes=given["image_sizes"])
        check_token_types(
            given, rows, image_token_id, name, "hf_tree's tree log-probs support images only. Set tree_forward=False."
        )
        store = MediaStore()
        media = [store.add(image) for image in images]
        if len(runs) == len(media):
            pieces = runs
        else:  # adjacent images' placeholders form one run: split it by each image's placeholder count
            lengths = image_feature_lengths(model, store.images)
            pieces = split_runs(runs, [lengths[m] for m in media], name)
        shown = np.bincount([row for row, _, _ in pieces], minlength=len(rows)).tolist()
        if given["num_images"] is not None and shown != list(given["num_images"]):
            raise ValueError(
                f"{name}: the rows' placeholders hold {shown} images but num_images={list(given['num_images'])}: each "
                "row's placeholders must be its images' ones, in order."
            )
        encoded = rows.clone()
        for (row, start, end), m in zip(pieces, media):
            encoded[row, start:end] = MEDIA_TOKEN_BASE + m
        return cls(model, encoded.to(input_ids.device), store.images, image_token_id)

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Forward inputs of packed rows of ``self.input_ids`` (``input_ids`` holding trie ids, ``position_ids``,
        ``kv_end``): placeholders, positions and the features of the images they show (``vision_model_inputs``)."""
        media = attach_media(dict(batch), self.images, self.image_token_id)
        return {**vision_model_inputs(self.model, media), "kv_end": batch["kv_end"]}
