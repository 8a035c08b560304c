"""``MediaTreeCollator``: ``MediaTree`` rows -> one packed batch whose images are each stored (and encoded) once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_tree.collator import TreeDataCollator
from hf_tree.vision.media_tree import MediaStore, MediaTree, decode_media_tokens


class MediaTreeCollator:
    """Packs ``MediaTree`` rows (or their ``to_dict()``) as ``TreeDataCollator`` does, and gathers their images.

    Takes ``TreeDataCollator``'s arguments. Output: ``TreeDataCollator``'s keys, with ``input_ids`` and
    ``loss_targets`` holding the model's placeholder token, plus

    - ``media_ids`` ``[B, N]`` int64: the image each placeholder token shows (index into the batch's images), ``-1``
      for text and padding;
    - ``image_inputs``: the processor tensors of the batch's distinct images (dropped trees' images left out),
      concatenated along dim 0 in image order (e.g. ``pixel_values``, ``image_grid_thw``; LLaVA-Next's tiles
      ``[1, tiles, C, H, W]`` zero-padded to the batch's most tiles, as its processor pads them); empty without images;
    - ``image_rows`` ``[images]`` int64: the rows of each image's ``pixel_values`` (crops, patches or 1).

    An image shared by several branches or trees of the batch is stored once. ``overlong="truncate"`` is refused: a
    cut could split an image's placeholder run. So is depth-first execution (``tree_execution`` other than
    ``"packed"``): its units would run without the images' features.
    """

    def __init__(self, *args: Any, **options: Any) -> None:
        self.collator = TreeDataCollator(*args, **options)
        if self.collator.overlong == "truncate":
            raise ValueError(
                "MediaTreeCollator: overlong='truncate' could cut an image's placeholder run (the model then refuses "
                "the batch); use overlong='drop' or 'error', or a larger max_branch_tokens."
            )
        if self.collator.packing.tree_execution != "packed":
            raise ValueError(
                f"MediaTreeCollator: tree_execution={self.collator.packing.tree_execution!r} is not supported for "
                "image trees (depth-first units do not carry the images' features yet); set tree_execution='packed' "
                "(image trees larger than max_packed_tokens are split by their branches)."
            )

    def __call__(self, features: Sequence[dict[str, Any] | MediaTree]) -> dict[str, Any]:
        trees = [f if isinstance(f, MediaTree) else MediaTree.from_dict(f, row=row) for row, f in enumerate(features)]
        placeholder_ids = {t.image_token_id for t in trees}
        if len(placeholder_ids) != 1:
            raise ValueError(f"the batch mixes image_token_id values {sorted(placeholder_ids)}; use one model's rows.")
        image_token_id = placeholder_ids.pop()
        store = MediaStore()  # an image shown by several trees is stored once
        renumbered = [tree.renumbered([store.add(image) for image in tree.media]) for tree in trees]
        return attach_media(self.collator(renumbered), store.images, image_token_id)


def attach_media(batch: dict[str, Any], images: list[dict[str, torch.Tensor]], image_token_id: int) -> dict[str, Any]:
    """Turn a packed batch of trie ids into model inputs, in place: placeholders back to ``image_token_id`` in
    ``input_ids`` (and ``loss_targets`` when present), plus ``media_ids`` and ``image_inputs`` of the images the rows
    show (``MediaTreeCollator``'s keys). ``images[m]`` are the tensors of trie media id ``m``."""
    batch["input_ids"], media_ids = decode_media_tokens(batch["input_ids"], image_token_id)
    if "loss_targets" in batch:
        batch["loss_targets"] = decode_media_tokens(batch["loss_targets"], image_token_id)[0]
    # Keep the images the packed rows show (packing may drop trees), renumbered in order.
    used = torch.unique(media_ids[media_ids >= 0]).tolist()
    renumber = torch.full((len(images) + 1,), -1, dtype=torch.int64, device=media_ids.device)
    renumber[used] = torch.arange(len(used), device=media_ids.device)
    batch["media_ids"] = renumber[media_ids]  # -1 maps through the last entry
    batch.update(image_batch([images[m] for m in used]))
    return batch


def image_batch(images: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``image_inputs`` (the images' processor tensors concatenated along dim 0) and ``image_rows`` (``[images]``
    int64: the rows of each image's ``pixel_values``, InternVL: its crops, to give each image its entries of the
    encoder's output) of ``images``, in order."""
    rows = torch.tensor([len(image["pixel_values"]) for image in images], dtype=torch.int64)
    return {"image_inputs": _concatenate(images), "image_rows": rows}


def _concatenate(images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not images:
        return {}
    names = set(images[0])
    for m, image in enumerate(images):
        if set(image) != names:
            raise ValueError(
                f"image {m} of the batch has processor tensors {sorted(image)} but image 0 has {sorted(names)}: all "
                "images of a batch must come from the same processor."
            )
    images = _pad_tiles(images) if "image_sizes" in names else images
    for name in names:
        shapes = {tuple(image[name].shape[1:]) for image in images}
        if len(shapes) > 1:
            raise ValueError(
                f"the batch's images have {name} of different shapes beyond dim 0 ({sorted(shapes)}): they cannot be "
                "encoded together (one processor, one image size; tiles only for models taking image_sizes)."
            )
    return {name: torch.cat([image[name] for image in images]) for name in sorted(names)}


def _pad_tiles(images: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Any-resolution tiles (LLaVA-Next: ``pixel_values`` ``[1, tiles, C, H, W]`` with ``image_sizes``): zero-pad
    every image to the batch's most tiles, as the processor pads a batch; the model keeps each image's own tiles
    (their count follows from ``image_sizes``), so the padding is never encoded."""
    pixels = [image["pixel_values"] for image in images]
    if any(p.dim() != 5 for p in pixels):
        return images
    most = max(p.shape[1] for p in pixels)
    return [
        {**image, "pixel_values": torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1]))}
        for image, p in zip(images, pixels)
    ]
