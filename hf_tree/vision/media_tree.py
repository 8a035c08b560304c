"""``MediaTree``: a ``Tree`` whose branches hold images, each image's processor tensors stored once.

Branches are merged by token ids *and* image identity: inside the trie, the placeholder tokens of media item ``m``
are stored as ``MEDIA_TOKEN_BASE + m``, so two branches with the same placeholder tokens but different images
diverge at the first placeholder, and branches showing the same image share it (and its vision features). Images
are identified by content (every processor tensor's dtype, shape and bytes), so the same picture passed twice is
one media item. The ``Tree`` inside is an ordinary one: packing, splitting, weights and serialisation are its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_tree.tree import Tree
from hf_tree.validation import check_token_ids

# Placeholder ids of media item ``m`` inside the trie: far above any vocabulary, exact in int64 and Arrow.
MEDIA_TOKEN_BASE = 1 << 40
# Keys ``MediaTree.to_dict`` adds to ``Tree.to_dict``'s.
MEDIA_KEYS = ("image_token_id", "media")

ImageInputs = Mapping[str, torch.Tensor]


def media_key(image: ImageInputs) -> str:
    """Content identity of one image's processor tensors (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name in sorted(image):
        tensor = image[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class MediaStore:
    """Distinct images by content (``media_key``): ``add`` returns an image's id, ``images`` lists them by id."""

    def __init__(self) -> None:
        self.images: list[dict[str, torch.Tensor]] = []
        self._ids: dict[str, int] = {}

    def add(self, image: ImageInputs) -> int:
        key = media_key(image)
        if key not in self._ids:
            self._ids[key] = len(self.images)
            self.images.append(dict(image))
        return self._ids[key]


def placeholder_runs(tokens: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the maximal runs of ``image_token_id`` in ``tokens``."""
    is_placeholder = np.concatenate([[False], np.asarray(tokens) == image_token_id, [False]]).astype(np.int8)
    edges = np.diff(is_placeholder)
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


def split_runs(runs: Sequence[tuple[int, int, int]], lengths: Sequence[int], where: str) -> list[tuple[int, int, int]]:
    """Each image's ``(row, start, end)``: the placeholder ``runs`` (``(row, start, end)``, in order) hold the images
    in order, image ``m`` taking ``lengths[m]`` tokens; adjacent images' placeholders form one run, split here.

    Raises:
        ValueError: (starting with ``where``) when the runs are not the images' placeholders laid end to end.
    """
    pieces: list[tuple[int, int, int]] = []
    for row, start, end in runs:
        while start < end and len(pieces) < len(lengths):
            pieces.append((row, start, start + lengths[len(pieces)]))
            start += lengths[len(pieces) - 1]
        if start != end:
            raise ValueError(
                f"{where}: the placeholder run ending at token {end} of row {row} does not hold whole images "
                f"(placeholder tokens per image: {list(lengths)}): the placeholders do not match the images."
            )
    if len(pieces) != len(lengths):
        raise ValueError(f"{where}: the placeholders hold {len(pieces)} of the {len(lengths)} images.")
    return pieces


def decode_media_tokens(ids: torch.Tensor, image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trie ids -> (model token ids, media item of each token or ``-1``), both shaped like ``ids``."""
    is_media = ids >= MEDIA_TOKEN_BASE
    return ids.masked_fill(is_media, image_token_id), torch.where(is_media, ids - MEDIA_TOKEN_BASE, -1)


@dataclass(frozen=True, eq=False)
class MediaTree:
    """A tree of image-and-text branches.

    Attributes:
        tree: the trie; placeholder tokens of media item ``m`` are stored as ``MEDIA_TOKEN_BASE + m``.
        image_token_id: the model's image placeholder token (``config.image_token_id``).
        media: per media item, the processor's tensors for that image alone, e.g. Qwen2-VL's ``pixel_values``
            ``[patches, C * T * P * P]`` and ``image_grid_thw`` ``[1, 3]``, LLaVA's ``pixel_values`` ``[1, C, H, W]``
            (tensors of several images are concatenated along dim 0 to encode them together).
    """

    tree: Tree
    image_token_id: int
    media: list[dict[str, torch.Tensor]]

    @classmethod
    def from_samples(
        cls,
        sequences: Sequence[Sequence[int]],
        images: Sequence[Sequence[ImageInputs]],
        image_token_id: int,
        loss_masks: Sequence[Sequence[int]] | None = None,
        branch_fields: dict[str, Sequence[Any]] | None = None,
        image_lengths: Sequence[Sequence[int]] | None = None,
    ) -> MediaTree:
        """Merge image-and-text samples into a tree.

        Args:
            sequences: token ids per sample, each image expanded to its placeholder run (as the processor writes it).
            images: per sample, one dict of processor tensors per image, in order (see ``media``).
            image_token_id: the placeholder token.
            loss_masks, branch_fields: as ``Tree.from_sequences``.
            image_lengths: per sample, the placeholder tokens of each of its images: a run holding several adjacent
                images' placeholders (LLaVA's ``<image><image>``) is split by them (``split_runs``). ``None``: one
                run per image.

        Raises:
            ValueError: naming the sample when its placeholder runs do not hold its images (without
                ``image_lengths``: each image's placeholders must be one run, separated from the next image's by
                another token), when ``images`` and ``sequences`` differ in length, or for anything
                ``Tree.from_sequences`` refuses.
        """
        if len(images) != len(sequences):
            raise ValueError(
                f"images has {len(images)} entries but sequences has {len(sequences)}: pass one list of images per "
                "sample (an empty list for a text-only sample)."
            )
        store = MediaStore()
        run_lengths: dict[int, int] = {}
        encoded = []
        for b, (seq, sample_images) in enumerate(zip(sequences, images)):
            tokens = np.asarray(check_token_ids(seq, where=f"sequence {b}"), dtype=np.int64)
            runs = placeholder_runs(tokens, image_token_id)
            if len(runs) != len(sample_images) and image_lengths is not None:
                pieces = split_runs([(b, *run) for run in runs], image_lengths[b], f"sample {b}")
                runs = [(start, end) for _, start, end in pieces]
            if len(runs) != len(sample_images):
                raise ValueError(
                    f"sample {b} has {len(runs)} runs of image_token_id={image_token_id} but {len(sample_images)} "
                    "images: pass one image per placeholder run, in order (each image's placeholders must be one "
                    "run, separated from the next image's by another token)."
                )
            for (start, end), image in zip(runs, sample_images):
                media = store.add({k: t.detach().cpu() for k, t in image.items()})
                # One image, one run length: else a shorter run (a cut image) could share the start of a longer one.
                if run_lengths.setdefault(media, end - start) != end - start:
                    raise ValueError(
                        f"sample {b} shows image {media} with {end - start} placeholder tokens, but an earlier sample "
                        f"shows it with {run_lengths[media]}: an image's placeholder run must not be cut."
                    )
                tokens[start:end] = MEDIA_TOKEN_BASE + media
            encoded.append(tokens.tolist())
        return cls(Tree.from_sequences(encoded, loss_masks, branch_fields), image_token_id, store.images)

    # ------------------------------------------------------------------ branches back out
    @property
    def num_branches(self) -> int:
        return self.tree.num_branches

    def branch_tokens(self, branch: int) -> list[int]:
        """The branch's model token ids (placeholders as ``image_token_id``)."""
        return decode_media_tokens(torch.tensor(self.tree.branch_tokens(branch)), self.image_token_id)[0].tolist()

    def branch_media(self, branch: int) -> list[int]:
        """Media items of the branch's placeholder runs, in order (a run is one image's placeholders)."""
        tokens = np.asarray(self.tree.branch_tokens(branch))
        starts = np.nonzero(np.diff(np.concatenate([[-1], tokens])) != 0)[0]  # where a new run of equal ids begins
        return [int(tokens[i]) - MEDIA_TOKEN_BASE for i in starts if tokens[i] >= MEDIA_TOKEN_BASE]

    def renumbered(self, media_ids: Sequence[int]) -> Tree:
        """The trie with media item ``m`` renumbered ``media_ids[m]`` (to pack several trees' media together)."""
        remap = np.asarray(media_ids, dtype=np.int64) + MEDIA_TOKEN_BASE
        node_tokens = []
        for tokens in self.tree.node_tokens:
            array = np.asarray(tokens, dtype=np.int64)
            is_media = array >= MEDIA_TOKEN_BASE
            array[is_media] = remap[array[is_media] - MEDIA_TOKEN_BASE]
            node_tokens.append(array.tolist())
        tree = self.tree
        return Tree(node_tokens, tree.node_parents, tree.branch_end_nodes, tree.branch_loss_spans, tree.branch_fields)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """``Tree.to_dict()`` plus ``image_token_id`` and ``media`` (per image, per tensor: ``shape``, ``dtype`` and
        the flat ``values``), plain lists that datasets/Arrow store as columns."""
        media = [
            {
                name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "values": _flat(t)}
                for name, t in image.items()
            }
            for image in self.media
        ]
        return {**self.tree.to_dict(), "image_token_id": int(self.image_token_id), "media": media}

    @classmethod
    def from_dict(cls, data: dict[str, Any], row: int | None = None) -> MediaTree:
        """Rebuild from ``to_dict`` output, treating ``data`` as untrusted (``ValueError`` naming the row)."""
        where = f"row {row}" if row is not None else "media tree"
        tree = Tree.from_dict(data, row=row)
        missing = [k for k in MEDIA_KEYS if data.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing {missing}; expected a MediaTree.to_dict() row.")
        media = [_image_from_dict(image, f"{where}: media {m}") for m, image in enumerate(data["media"])]
        used = {t - MEDIA_TOKEN_BASE for tokens in tree.node_tokens for t in tokens if t >= MEDIA_TOKEN_BASE}
        unknown = sorted(m for m in used if m >= len(media))
        if unknown:
            raise ValueError(f"{where}: placeholders refer to media {unknown[0]} but only {len(media)} are stored.")
        return cls(tree, int(data["image_token_id"]), media)


def _flat(tensor: torch.Tensor) -> list:
    values = tensor.detach().cpu().reshape(-1)
    return (values.double() if values.is_floating_point() else values.long()).tolist()


def _image_from_dict(image: Any, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(image, dict) or not image:
        raise ValueError(f"{where}: expected a dict of tensors, got {image!r:.80}.")
    out = {}
    for name, entry in image.items():
        if entry is None:  # Arrow fills tensors that other images have with None
            continue
        dtype = getattr(torch, str(entry.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: {name} has dtype {entry.get('dtype')!r}, not a torch dtype.")
        shape, values = list(entry["shape"]), list(entry["values"])
        if int(np.prod(shape)) != len(values):
            raise ValueError(f"{where}: {name} has shape {shape} but {len(values)} values.")
        out[name] = torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point else torch.int64).to(dtype)
        out[name] = out[name].reshape(shape)
    return out
