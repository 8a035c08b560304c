"""The exact packed forward of a vision-language model on ``MediaTreeCollator`` batches.

Each distinct image of the batch goes through the model's own ``get_image_features`` once; its features are
handed to the model's own forward as ``mm_encoder_outputs`` (one entry per placeholder run of the packed rows, in
row order, so the model's own placeholder merge puts them in place), and the language model runs with ``kv_end``.
Positions are what each branch alone gets: the Qwen-VL and GLM-4V families' 3-D mRoPE positions from the model's own
``get_rope_index`` run on each root-to-leaf path of the packed rows (equal on shared prefixes, since a token's
position depends on its ancestors only), depths for 1-D models. Gemma 3's image tokens attend to each other
bidirectionally (its ``token_type_ids`` overlay, one block per contiguous run of image tokens): the language model
then also gets ``bidirectional_block``, each packed run's block id (``image_blocks``), which the tree attention adds
to the tree mask. Models not listed in ``SUPPORTED`` are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from hf_tree.batch_inputs import register_batch_inputs
from hf_tree.loss import tree_causal_lm_loss
from hf_tree.models.introspection import causal_lm_of
from hf_tree.vision.collator import image_batch


@dataclass(frozen=True)
class VisionFamily:
    """How a model family's packed forward is assembled.

    Attributes:
        mrope: positions are 3-D, from the model's ``get_rope_index`` per branch (else 1-D depths).
        image_inputs: the processor tensors ``get_image_features`` takes (others are refused).
        bidirectional_images: each image's placeholder tokens attend to each other both ways (Gemma 3's
            ``token_type_ids`` mask overlay), passed to the tree attention as ``bidirectional_block``.
        crops: an image may be several crops (``pixel_values`` ``[crops, C, H, W]``) written as one placeholder run
            (InternVL); its features are its crops' in order (``image_features``).
        one_image_per_branch: an image's features depend on how many images its sample shows (LLaVA-OneVision:
            the processor's ``batch_num_images``; a multi-image sample's images lose their anyres tiles), so a branch
            showing several images is refused (``images_per_branch``) and each image is encoded as a sample's only one.
    """

    mrope: bool
    image_inputs: tuple[str, ...]
    bidirectional_images: bool = False
    crops: bool = False
    one_image_per_branch: bool = False


# Families whose packed forward is tested equal to per-branch training (tests/test_vision_forward.py, and the zoo's
# probe for every entry: tests/test_vision_zoo.py::test_supported_families_are_exact).
SUPPORTED = {
    "qwen2_vl": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "qwen2_5_vl": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "qwen3_vl": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "qwen3_5": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "qwen3_vl_moe": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "qwen3_5_moe": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    # GLM-4V's architecture: Qwen-style patches and get_rope_index (an image run between image start/end tokens)
    "glm4v": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "glm4v_moe": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "glm46v": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "glmga": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "glm_ocr": VisionFamily(mrope=True, image_inputs=("image_grid_thw", "pixel_values")),
    "llava": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
    # Unsplit images only (one tile each, do_image_splitting=False): a split image's tiles are separate placeholder
    # runs between tile-position tokens, which MediaTree and the packed forward refuse (runs != images).
    "idefics3": VisionFamily(mrope=False, image_inputs=("pixel_attention_mask", "pixel_values")),
    "smolvlm": VisionFamily(mrope=False, image_inputs=("pixel_attention_mask", "pixel_values")),
    # Image tokens attend bidirectionally within their image (causal + token_type_ids block overlay; sliding layers:
    # AND(window, OR(causal, block))): the tree mask plus the same overlay (image_blocks), exact as each block lies
    # inside one tree node.
    "gemma3": VisionFamily(mrope=False, image_inputs=("pixel_values",), bidirectional_images=True),
    # Any-resolution tiles: pixel_values [images, tiles, C, H, W] (zero-padded to the batch's most tiles; the model
    # keeps each image's own count, from image_sizes) and image_sizes [images, 2]; each image's features are its
    # base tile, then its unpadded tile grid with an image_newline per row: a different length per image.
    "llava_next": VisionFamily(mrope=False, image_inputs=("image_sizes", "pixel_values")),
    "llava_next_video": VisionFamily(mrope=False, image_inputs=("image_sizes", "pixel_values")),  # its images
    # LLaVA-Next's tiles, unpadding reduced to at most anyres_max_N tiles' worth; only one-image branches
    "llava_onevision": VisionFamily(
        mrope=False, image_inputs=("image_sizes", "pixel_values"), one_image_per_branch=True
    ),
    # Qwen-style patch grids with 1-D positions
    "exaone4_5": VisionFamily(mrope=False, image_inputs=("image_grid_thw", "pixel_values")),
    "hyperclovax_vision_v2": VisionFamily(mrope=False, image_inputs=("image_grid_thw", "pixel_values")),
    "lfm3_vl": VisionFamily(mrope=False, image_inputs=("image_grid_thw", "pixel_values")),
    "minimax_m3_vl": VisionFamily(mrope=False, image_inputs=("image_grid_thw", "pixel_values")),
    # Idefics3's predecessor (perceiver resampler): unsplit images, one run each
    "idefics2": VisionFamily(mrope=False, image_inputs=("pixel_attention_mask", "pixel_values")),
    # Pixels with a padding mask (Aria: its patch attention and projector queries), one run per image
    "aria": VisionFamily(mrope=False, image_inputs=("pixel_mask", "pixel_values")),
    # One feature entry per image (or per crop, written as the image's one run: InternVL), scattered in order
    "aya_vision": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
    "cohere2_vision": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
    "deepseek_vl": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
    "internvl": VisionFamily(mrope=False, image_inputs=("pixel_values",), crops=True),
    "qianfan_ocr": VisionFamily(mrope=False, image_inputs=("pixel_values",), crops=True),
    "shieldgemma2": VisionFamily(mrope=False, image_inputs=("pixel_values",), bidirectional_images=True),
    "video_llava": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
    "vipllava": VisionFamily(mrope=False, image_inputs=("pixel_values",)),
}
# Why other families are refused (a family not named here: it was not tested with tree batches).
PIXTRAL_ROWS = (
    "its processor writes an image as one placeholder run per row of patches, each ended by [IMG_BREAK] ([IMG_END] "
    "after the last): several runs per image, while MediaTree and the packed forward give each image one run"
)
REFUSED = {
    "paligemma": "its prefix (image and prompt) is attended bidirectionally, across the nodes where branches' prompts "
    "fork; the tree mask is causal apart from image blocks inside one node",
    "mistral3": PIXTRAL_ROWS,
    "lighton_ocr": PIXTRAL_ROWS,
    "mistral_large4": PIXTRAL_ROWS,
    "got_ocr2": "its SAM-style vision encoder takes no attention implementation, so the model cannot be switched to "
    "tree_flash as a whole (transformers refuses set_attn_implementation and the config stays 'eager')",
    "pp_chart2table": "GOT-OCR2's architecture: its vision encoder takes no attention implementation, so the model "
    "cannot be switched to tree_flash as a whole",
    "fuyu": "its image patches are projected inside its forward and scattered by image_patches_indices from the "
    "encoder's last_hidden_state, not passed as per-image features (pooler_output) that can be encoded once and "
    "reordered per showing",
    "ovis2": "its visual-indicator tokens (image start/grid/end) get the vision tokenizer's indicator embeddings in "
    "every forward that has an image, so a branch without images packed beside one with images would differ from "
    "that branch alone (the zoo's probe, without indicator tokens, is exact)",
}


# The transformers release whose vision-language forwards take ``mm_encoder_outputs`` (5.17 and older ignore the
# keyword in their **kwargs: the packed rows would train on the placeholder tokens' embeddings, without the images).
ENCODER_OUTPUTS_TRANSFORMERS = "5.18.0"


def vision_family(model: torch.nn.Module) -> VisionFamily:
    """The ``VisionFamily`` of ``model`` (may be PEFT-wrapped), or ``ValueError`` naming the model and why: a family
    not in ``SUPPORTED``, or a forward that takes no ``mm_encoder_outputs`` (transformers before
    ``ENCODER_OUTPUTS_TRANSFORMERS``)."""
    causal_lm = causal_lm_of(model)
    model_type = causal_lm.config.model_type
    if model_type in SUPPORTED:
        if "mm_encoder_outputs" not in inspect.signature(type(causal_lm).forward).parameters:
            raise ValueError(
                f"{type(causal_lm).__name__}.forward takes no mm_encoder_outputs in transformers "
                f"{transformers.__version__}: image trees hand each image's features to the model through it, and "
                "this version would leave the images out. Upgrade: pip install "
                f"'transformers>={ENCODER_OUTPUTS_TRANSFORMERS}', or train this model on flat sequences."
            )
        return SUPPORTED[model_type]
    reason = REFUSED.get(model_type, "this family was not tested against per-branch training")
    raise ValueError(
        f"{type(causal_lm).__name__} (model_type={model_type!r}) cannot be trained on image trees: {reason}. "
        f"Supported: {sorted(SUPPORTED)}; train it on flat sequences instead."
    )


def _placeholder_runs(media_ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(row, start, end, image)`` of each maximal run of one image's placeholders, rows in order."""
    runs = []
    for row, ids in enumerate(media_ids.cpu().numpy()):
        change = np.nonzero(np.diff(np.concatenate([[-1], ids, [-1]])))[0]
        runs.extend((row, s, e, int(ids[s])) for s, e in zip(change[:-1], change[1:]) if ids[s] >= 0)
    return runs


def occurrences(media_ids: torch.Tensor, feature_lengths: list[int]) -> tuple[list[int], torch.Tensor]:
    """Where each image is shown in the packed rows.

    Args:
        media_ids: ``[B, N]`` image of each placeholder token, ``-1`` elsewhere.
        feature_lengths: placeholder tokens of one showing of each image (its feature rows).

    Returns:
        The image of each showing in row-major order (a run of ``k`` times an image's length is ``k`` showings), and
        ``[B, N]`` int64: the showing each placeholder token belongs to, ``-1`` elsewhere.

    Raises:
        ValueError: when a run is not a whole number of showings of its image.
    """
    shown: list[int] = []
    showing = torch.full(media_ids.shape, -1, dtype=torch.int64)
    for row, start, end, image in _placeholder_runs(media_ids):
        length = feature_lengths[image]
        if (end - start) % length:
            raise ValueError(
                f"packed row {row} holds {end - start} placeholder tokens of image {image} (tokens {start}..{end - 1}) "
                f"but the model encodes that image into {length} features: the placeholders do not match the image "
                "(wrong processor settings for this model, or a truncated branch)."
            )
        count = (end - start) // length
        showing[row, start:end] = torch.arange(len(shown), len(shown) + count).repeat_interleave(length)
        shown.extend([image] * count)
    return shown, showing


def image_encoder(causal_lm: PreTrainedModel) -> Any:
    """The model's own ``get_image_features`` (DeepSeek-VL, Janus: its base model's)."""
    return getattr(causal_lm, "get_image_features", None) or causal_lm.model.get_image_features


def image_features(
    pooler_output: torch.Tensor | Sequence[torch.Tensor], batch: dict[str, Any], name: str = "model"
) -> list[torch.Tensor]:
    """Each image's features ``[tokens, D]`` from ``get_image_features``' ``pooler_output``, whose entries follow the
    rows of the images' ``pixel_values`` (``batch["image_rows"]``: rows per image): one per image for grids
    (``image_grid_thw``: its rows are patches, Qwen) and for tiles (5-D ``pixel_values``: LLaVA-Next, Idefics3), one
    per crop for 4-D ``pixel_values`` (InternVL's crops of one image: its features are its crops' in order, as the
    model scatters them into the image's one placeholder run).

    Raises:
        ValueError: when the entries do not add up to the images' rows.
    """
    image_inputs = batch["image_inputs"]
    if "image_grid_thw" in image_inputs:
        counts = [1] * len(image_inputs["image_grid_thw"])
    else:
        counts = [int(c) for c in batch.get("image_rows", [1] * len(image_inputs["pixel_values"]))]
    if len(pooler_output) != sum(counts):
        raise ValueError(
            f"{name}.get_image_features returned {len(pooler_output)} feature entries for images with {sum(counts)} "
            "crops/images: hf_tree cannot tell which features belong to which image."
        )
    return [torch.cat(list(pooler_output[i - c : i])) for i, c in zip(np.cumsum(counts).tolist(), counts)]


def image_feature_lengths(model: torch.nn.Module, images: list[dict[str, torch.Tensor]]) -> list[int]:
    """The placeholder tokens of each image: the rows of its features from the model's own encoder, run once on
    ``images`` (processor tensor dicts) without gradients (what the model's placeholder merge requires)."""
    causal_lm = causal_lm_of(model)
    batch = image_batch(images)
    device = next(causal_lm.parameters()).device
    with torch.no_grad():
        features = image_encoder(causal_lm)(
            **{k: v.to(device) for k, v in batch["image_inputs"].items()}, return_dict=True
        )
    return [len(f) for f in image_features(features.pooler_output, batch, type(causal_lm).__name__)]


def image_blocks(media_ids: torch.Tensor, kv_end: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` int64 bidirectional block of each placeholder token, ``-1`` elsewhere: Gemma 3's
    ``token_type_ids`` blocks (maximal runs of image tokens of a branch, numbered along each row).

    A branch's run of image tokens is one packed run when it lies inside one tree node (a chain of tokens with one
    child each: a segment of equal ``kv_end``); then every branch through it has the same block, and the tree mask
    extended with "same block: visible" is each branch's own mask. A packed run that crosses a segment boundary is
    split there (a sibling's run that happens to follow is another block of another branch).

    Raises:
        ValueError: naming the row and tokens, when an image run continues across a node boundary (a node starting
            with image tokens whose parent node ends with image tokens): its tokens would see a different block in
            each branch.
    """
    is_image = (media_ids >= 0).cpu()
    ends = kv_end.detach().to("cpu", torch.int64)
    blocks = torch.full(media_ids.shape, -1, dtype=torch.int64)
    for row in range(media_ids.shape[0]):
        image, end = is_image[row], ends[row]
        node_start = torch.ones_like(image)
        node_start[1:] = end[1:] != end[:-1]  # equal kv_end: the previous token's only child
        for s in torch.nonzero(image & node_start).flatten().tolist():
            ancestors = torch.nonzero(end[:s] > s).flatten()
            if ancestors.numel() and bool(image[ancestors[-1]]):
                parent = int(ancestors[-1])
                raise ValueError(
                    f"packed row {row}: the image tokens from token {s} on continue the image run of their parent "
                    f"node (token {parent}, image {int(media_ids[row, parent])}): an image's placeholder run is split "
                    "between tree nodes, so its bidirectional image attention would differ between branches. Build "
                    "the trees with MediaTree.from_samples (each image run is one piece of one node)."
                )
        previous = torch.zeros_like(image)
        previous[1:] = image[:-1]
        starts = image & (~previous | node_start)
        blocks[row] = torch.where(image, starts.cumsum(0) - 1, -1)
    return blocks.to(media_ids.device)


def images_per_branch(media_ids: torch.Tensor, kv_end: torch.Tensor, depths: torch.Tensor) -> tuple[int, int, int]:
    """``(images, row, leaf)``: the most placeholder runs any root-to-leaf path of the packed rows shows, and where."""
    most = (0, 0, 0)
    index = np.arange(media_ids.shape[1])
    for row in range(media_ids.shape[0]):
        ends, ids = kv_end[row].cpu().numpy(), media_ids[row].cpu().numpy()
        for leaf in np.nonzero((ends == index + 1) & (depths[row].cpu().numpy() > 0))[0]:
            path_ids = ids[np.nonzero(ends[: leaf + 1] > leaf)[0]]
            runs = int(np.count_nonzero((path_ids >= 0) & (np.diff(np.concatenate([[-1], path_ids])) != 0)))
            most = max(most, (runs, row, int(leaf)))
    return most


def mrope_positions(
    rope_model: torch.nn.Module,
    input_ids: torch.Tensor,
    showing: torch.Tensor,
    showing_grids: torch.Tensor,
    kv_end: torch.Tensor,
    depths: torch.Tensor,
) -> torch.Tensor:
    """``[3, B, N]`` positions: the model's ``get_rope_index`` run on each root-to-leaf path of the packed rows.

    Args:
        rope_model: the module with ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)``.
        input_ids, showing, kv_end, depths: ``[B, N]`` packed tokens, showing of each placeholder (``occurrences``),
            subtree ends and depths.
        showing_grids: ``[showings, 3]`` ``image_grid_thw`` of each showing.

    Padding (depth 0, no descendant) keeps position 0.
    """
    positions = torch.zeros((3, *input_ids.shape), dtype=torch.int64)
    index = np.arange(input_ids.shape[1])
    for row in range(input_ids.shape[0]):
        ends = kv_end[row].cpu().numpy()
        leaves = np.nonzero((ends == index + 1) & (depths[row].cpu().numpy() > 0))[0]
        for leaf in leaves:
            path = torch.from_numpy(np.nonzero(ends[: leaf + 1] > leaf)[0])  # the leaf's ancestors and itself
            path_showings = showing[row, path]
            shown = torch.unique_consecutive(path_showings[path_showings >= 0])
            branch, _ = rope_model.get_rope_index(
                input_ids[row, path][None].cpu(),
                mm_token_type_ids=(path_showings >= 0).int()[None],
                image_grid_thw=showing_grids[shown] if len(shown) else None,
            )
            positions[:, row, path] = branch[:, 0].cpu()
    return positions.to(input_ids.device)


def vision_model_inputs(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Forward keywords of ``model`` for a ``MediaTreeCollator`` batch: ``input_ids``, ``position_ids`` (3-D for
    mRoPE models), ``mm_encoder_outputs`` (each distinct image encoded once, one entry per showing) and, for
    bidirectional image attention (Gemma 3), ``bidirectional_block`` (``image_blocks``).

    Raises:
        ValueError: for a model not in ``SUPPORTED``, a sharded model (FSDP2), processor tensors its
            ``get_image_features`` does not take, placeholder runs that do not match the image features, or an image
            run split between tree nodes.
    """
    family = vision_family(model)
    causal_lm: PreTrainedModel = causal_lm_of(model)
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    image_inputs = batch["image_inputs"]
    if not image_inputs:
        return inputs
    if any(isinstance(p, DTensor) for p in causal_lm.parameters()):
        # The images are encoded here, before the model's forward: FSDP2 gathers the root's parameters (projector,
        # patch embeddings) only inside that forward, and reduces their gradients from its backward hooks.
        raise ValueError(
            f"{type(causal_lm).__name__} is sharded (FSDP2): image trees encode their images before the model's "
            "forward, outside FSDP's parameter gathering, which is not supported yet. Train vision-language trees "
            "without FSDP, or flat sequences under FSDP."
        )
    unknown = sorted(set(image_inputs) - set(family.image_inputs))
    if unknown:
        raise ValueError(
            f"image_inputs holds {unknown}, which the tree forward of {type(causal_lm).__name__} does not pass to "
            f"get_image_features (it takes {list(family.image_inputs)}); drop them or train on flat sequences."
        )
    required = [k for k in ("pixel_values", "image_grid_thw", "image_sizes") if k in family.image_inputs]
    missing = [k for k in required if k not in image_inputs]
    if missing:
        raise ValueError(f"image_inputs lacks {missing}, which {type(causal_lm).__name__}'s image encoder needs.")
    device = batch["input_ids"].device
    if family.one_image_per_branch:
        images, row, leaf = images_per_branch(batch["media_ids"], batch["kv_end"], batch["position_ids"])
        if images > 1:
            raise ValueError(
                f"packed row {row}: the branch ending at token {leaf} shows {images} images, but "
                f"{type(causal_lm).__name__} encodes the images of a multi-image sample differently (without their "
                "anyres tiles: the processor's batch_num_images), which the tree forward does not do: train it on "
                "samples with one image each."
            )
    if family.bidirectional_images:  # checked before the encoder runs
        inputs["bidirectional_block"] = image_blocks(batch["media_ids"], batch["kv_end"]).to(device)
    features = image_encoder(causal_lm)(**{k: v.to(device) for k, v in image_inputs.items()}, return_dict=True)
    per_image = image_features(features.pooler_output, batch, type(causal_lm).__name__)
    shown, showing = occurrences(batch["media_ids"], [len(f) for f in per_image])
    # The model scatters them in row-major order; in the container its own encoder returns (Gemma 3: one tensor)
    per_showing = [per_image[m] for m in shown]
    if not isinstance(features.pooler_output, torch.Tensor):
        features.pooler_output = tuple(per_showing)
    elif len({f.shape for f in per_showing}) == 1:
        features.pooler_output = torch.stack(per_showing)
    else:  # crops of several sizes (InternVL: crops per image): one row, scattered in order all the same
        features.pooler_output = torch.cat(per_showing)[None]
    if getattr(features, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, per image, like pooler_output
        features.deepstack_features = [tuple(layer[m] for m in shown) for layer in features.deepstack_features]
    inputs["mm_encoder_outputs"] = {"image": features}
    if family.mrope:
        inputs["position_ids"] = mrope_positions(
            causal_lm.model,
            batch["input_ids"],
            showing,
            image_inputs["image_grid_thw"][shown].cpu(),
            batch["kv_end"],
            batch["position_ids"],
        )
    return inputs


def media_batch_inputs(model: torch.nn.Module, batch: dict[str, Any], context_parallel: bool = False) -> dict:
    """``vision_model_inputs`` of a ``MediaTreeCollator`` batch (it has ``media_ids``): what the tree trainers pass to
    ``tree_causal_lm_loss`` as ``model_inputs`` (registered below, ``hf_tree.batch_inputs``).

    Raises:
        ValueError: for an image batch under context parallel (its shards would split placeholder runs).
    """
    if context_parallel:
        raise ValueError(
            "image tree batches (MediaTreeCollator) cannot be sharded by context parallel: a shard would split "
            "images' placeholder runs. Set context_parallel_size=1 for vision-language trees."
        )
    return vision_model_inputs(model, batch)


register_batch_inputs("media_ids", media_batch_inputs)  # the text trainers import no vision module


def tree_vision_lm_loss(
    model: torch.nn.Module,
    batch: dict[str, Any],
    num_items_in_batch: torch.Tensor | float | None = None,
    **options: Any,
) -> torch.Tensor:
    """``tree_causal_lm_loss`` of a ``MediaTreeCollator`` batch on a vision-language model (``vision_model_inputs``);
    ``options`` are ``tree_causal_lm_loss``'s (``chunk_size``, ``token_loss``, ``self_check``)."""
    inputs = vision_model_inputs(model, batch)
    return tree_causal_lm_loss(model, batch, num_items_in_batch, model_inputs=inputs, **options)
