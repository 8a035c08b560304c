"""Vision-language model zoo: every image-text-to-text architecture of the installed transformers ends in one state.

For each ``model_type`` of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, ``check_vision_architecture`` builds the
model tiny in float64 (from a given config factory, e.g. ``tests/vision_models.py``'s, else the default config
shrunk generically like ``hf_tree.zoo.tiny_config``) and puts it in exactly one state:

- ``exact``: a family of ``hf_tree.vision.SUPPORTED``: two packed image trees (a shared image prompt with several
  completions, one a prefix of another; a second image behind the same text; a text-only sample) give the loss and
  every gradient (vision tower included) of training each sample alone with its own attention, within
  ``hf_tree.zoo.TOLERANCE`` (float64 models keep float32 norms and rotary internals);
- ``refused``: ``tree_vision_lm_loss`` on an image batch raised hf_tree's ``ValueError`` before any forward;
- ``not buildable`` (the reason), ``error`` (any other exception);
- ``MISMATCH``: a silent difference, or an unsupported model that ran on images without being refused. The bar is 0.

Used by ``benchmarks/vision_zoo.py`` and ``tests/test_vision_zoo.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from hf_tree.models.introspection import causal_lm_of, own_attention, raised_by_hf_tree
from hf_tree.testing import FLOAT32_GRAD_FLOOR, grads_of, max_grad_error, relative_error
from hf_tree.vision.collator import MediaTreeCollator
from hf_tree.vision.forward import SUPPORTED, image_encoder, tree_vision_lm_loss
from hf_tree.vision.media_tree import MediaTree
from hf_tree.zoo import (
    TOLERANCE,
    NotBuildable,
    classified,
    error_cell,
    first_line,
    shrink_config,
    state_counts,
)

# Families with float32 internals even in a float64 model: Qwen3.5's GatedDeltaNet decay gates (docs/hybrids.md's
# 1e-4 floor, ~3e-6 measured here); a branch or image leak moves the loss and gradients by far more.
FLOAT32_INTERNALS = {"qwen3_5": 1e-4, "qwen3_5_moe": 1e-4}
ConfigFactory = Callable[[], transformers.PretrainedConfig]
# The causal-LM zoo's states less "unrunnable" (a type that fails to build here is "not buildable" with the reason)
VISION_STATES = ("exact", "refused", "not buildable", "error", "MISMATCH")


@dataclass
class VisionZooResult:
    """One architecture's state and relative errors (``None`` where not measured)."""

    model_type: str
    model_class: str = ""
    state: str = "not buildable"
    detail: str = ""
    loss_error: float | None = None
    grad_error: float | None = None
    seconds: float = 0.0


def vision_model_types() -> list[str]:
    """Every image-text-to-text ``model_type`` of the installed transformers."""
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def tiny_vision_config(model_type: str) -> transformers.PretrainedConfig:
    """``model_type``'s default config with every size shrunk (``hf_tree.zoo``'s generic shrink, nested vision and
    text configs included), rebuilt so derived fields follow."""
    values = shrink_config(transformers.AutoConfig.for_model(model_type).to_dict())
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        values.pop(key, None)
    return transformers.AutoConfig.for_model(model_type, **values)


def build_tiny_vlm(model_type: str, factory: ConfigFactory | None = None) -> torch.nn.Module:
    """The tiny float64 model on ``tree_flash`` (deterministic init, eval mode); ``NotBuildable`` with the reason."""
    try:
        config = factory() if factory is not None else tiny_vision_config(model_type)
    except Exception as error:  # noqa: BLE001 - any failure means: cannot be built tiny
        raise NotBuildable(f"config: {type(error).__name__}: {first_line(error)}") from error
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForImageTextToText.from_config(copy.deepcopy(config), dtype=torch.float64)
        model.set_attn_implementation("tree_flash")
    except Exception as error:  # noqa: BLE001
        raise NotBuildable(f"build: {type(error).__name__}: {first_line(error)}") from error
    return model.eval()


def tiny_image(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """One image's processor tensors for a ``SUPPORTED`` family, sized from its vision config. Qwen (mRoPE): a
    ``2m x 2m`` patch grid (``m`` the spatial merge), ``pixel_values`` ``[4m^2, C*T*P*P]`` and ``image_grid_thw``;
    Idefics3/SmolVLM: one unsplit tile ``[1, 1, 3, S, S]`` and its pixel mask; LLaVA-Next: the tiles
    ``[1, tiles, 3, S, S]`` of an image a bit shorter than one of its grid pinpoints, and ``image_sizes``; others
    (LLaVA): ``[1, 3, S, S]``, two crops ``[2, 3, S, S]`` for an odd seed where an image may be several crops."""
    config = causal_lm_of(model).config
    family, vision = SUPPORTED[config.model_type], config.vision_config
    generator = torch.Generator().manual_seed(seed)
    if "image_grid_thw" in family.image_inputs:  # patches of a grid (Qwen)
        merge = _first(vision, "spatial_merge_size", "merge_size", "merge_kernel_size", default=1)
        merge = merge[0] if isinstance(merge, (list, tuple)) else merge
        temporal = _first(vision, "temporal_patch_size", "patch_temporal", default=1)
        channels = _first(vision, "in_channels", "num_channels", default=3)
        side, width = 2 * merge, channels * temporal * vision.patch_size**2
        pixels = torch.randn(side * side, width, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}
    size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]  # square images
    if "image_sizes" in family.image_inputs:  # any-resolution tiles: the base tile plus the grid of a pinpoint
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        pinpoints = config.image_grid_pinpoints
        height, width = pinpoints[seed % len(pinpoints)]
        image_sizes = [height - size // 4, width]  # not a pinpoint's shape: unpadding cuts its feature rows
        tiles = image_size_to_num_patches(image_sizes, pinpoints, size)
        pixels = torch.randn(1, tiles, 3, size, size, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "image_sizes": torch.tensor([image_sizes])}
    if "pixel_attention_mask" in family.image_inputs:
        pixels = torch.randn(1, 1, 3, size, size, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, 1, size, size, dtype=torch.bool)}
    if "pixel_mask" in family.image_inputs:  # Aria: the even seeds' right quarter is padding
        mask = torch.ones(1, size, size, dtype=torch.bool)
        mask[:, :, size - size // 4 :] = seed % 2 == 1
        pixels = torch.randn(1, 3, size, size, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "pixel_mask": mask}
    crops = 1 + seed % 2 if family.crops else 1  # InternVL: one image as two crops, written as one run
    return {"pixel_values": torch.randn(crops, 3, size, size, generator=generator, dtype=torch.float64)}


def _first(config: transformers.PretrainedConfig, *names: str, default: int) -> int:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def placeholder_tokens(model: torch.nn.Module, image: dict[str, torch.Tensor]) -> list[int]:
    """The tokens a processor writes for ``image``: one image token per feature the model's own encoder returns
    (Qwen: wrapped in the vision start/end tokens)."""
    causal_lm = causal_lm_of(model)
    config = causal_lm.config
    with torch.no_grad():  # every entry of the encoder's output (InternVL: one per crop)
        count = sum(len(f) for f in image_encoder(causal_lm)(**image, return_dict=True).pooler_output)
    run = [int(config.image_token_id)] * count
    if SUPPORTED[config.model_type].mrope:  # GLM-4V names them image_start/end
        start = getattr(config, "vision_start_token_id", None) or config.image_start_token_id
        return [start, *run, getattr(config, "vision_end_token_id", None) or config.image_end_token_id]
    return run


def probe_samples(model: torch.nn.Module) -> tuple[list[list[int]], list[list[dict]], list[list[int]]]:
    """Samples of two trees (tokens below 100, clear of the tiny configs' image tokens), their images and masks."""
    first, second = tiny_image(model, 1), tiny_image(model, 2)
    a, b = placeholder_tokens(model, first), placeholder_tokens(model, second)
    sequences = [[1, 2, *a, 5, 6, 7, 8], [1, 2, *a, 5, 9], [1, 2, *a, 5], [1, 2, *b, 5, 6, 7], [3, 4, 5, 6]]
    images = [[first], [first], [first], [second], []]
    masks = [[0] * (len(s) - 3) + [1] * 3 for s in sequences]
    return sequences, images, masks


def per_branch_vlm_loss(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    images: Sequence[Sequence[dict[str, torch.Tensor]]],
    masks: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Token-normalized CE of every sample run alone: its own attention, its images passed as the processor passes
    them (tensors concatenated; ``mm_token_type_ids`` for the mRoPE families, ``token_type_ids`` for Gemma 3's
    bidirectional image blocks)."""
    config = causal_lm_of(model).config
    total, count = 0.0, 0.0
    with own_attention(causal_lm_of(model)):
        for seq, sample_images, mask in zip(sequences, images, masks):
            ids = torch.tensor([list(seq)])
            inputs = {k: torch.cat([im[k] for im in sample_images]) for k in sample_images[0]} if sample_images else {}
            if SUPPORTED[config.model_type].mrope:
                inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
            if SUPPORTED[config.model_type].bidirectional_images:  # Gemma 3: as its processor writes them
                inputs["token_type_ids"] = (ids == config.image_token_id).int()
            trained = torch.tensor(mask[1:], dtype=torch.float64)
            logits = model(input_ids=ids, **inputs, use_cache=False).logits[0, :-1]
            ce = F.cross_entropy(logits.double(), ids[0, 1:], reduction="none")
            total, count = total + (ce * trained).sum(), count + trained.sum()
    return total / count


def _check_exact(result: VisionZooResult, model: torch.nn.Module) -> None:
    with torch.no_grad():  # projector weights that start at zero (Gemma 3) would blank every image: give them values
        for name, parameter in model.named_parameters():
            if name.endswith("projection_weight") and not parameter.any():
                parameter.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    sequences, images, masks = probe_samples(model)
    trees = [
        MediaTree.from_samples(sequences[:3], images[:3], model.config.image_token_id, masks[:3]),
        MediaTree.from_samples(sequences[3:], images[3:], model.config.image_token_id, masks[3:]),
    ]
    batch = MediaTreeCollator(max_packed_tokens=256)(trees)
    model.zero_grad()
    loss = tree_vision_lm_loss(model, batch)
    loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    reference = per_branch_vlm_loss(model, sequences, images, masks)
    reference.backward()
    result.loss_error = relative_error(loss, reference)
    result.grad_error = max_grad_error(tree_grads, grads_of(model), floor=FLOAT32_GRAD_FLOOR)
    tolerance = FLOAT32_INTERNALS.get(model.config.model_type, TOLERANCE[torch.float64])
    if max(result.loss_error, result.grad_error) <= tolerance:
        result.state = "exact"
    else:
        result.state, result.detail = "MISMATCH", f"tree differs from per-branch training (tolerance {tolerance:g})"


def _check_refused(result: VisionZooResult, model: torch.nn.Module) -> None:
    """An unsupported family must refuse an image batch (any image: the refusal comes before the encoder)."""
    ids = (getattr(model.config, key, None) for key in ("image_token_id", "image_token_index"))
    image_token = next((i for i in ids if isinstance(i, int)), 3)
    tree = MediaTree.from_samples(
        [[1, 2, image_token, image_token, 5, 6]], [[{"pixel_values": torch.zeros(1, 4)}]], image_token
    )
    batch = MediaTreeCollator(max_packed_tokens=64)([tree])
    try:
        tree_vision_lm_loss(model, batch)
    except ValueError as error:
        if raised_by_hf_tree(error):
            result.state, result.detail = "refused", first_line(error, 400).split(" Supported:")[0]
            return
        raise
    result.state, result.detail = "MISMATCH", "an unsupported family ran on an image batch without being refused"


def check_vision_architecture(
    model_type: str, configs: Mapping[str, ConfigFactory] | None = None, time_limit: int = 300
) -> VisionZooResult:
    """Build ``model_type`` tiny (``configs[model_type]`` where given) and put it in exactly one state."""
    result = VisionZooResult(model_type)

    def check() -> None:
        model = build_tiny_vlm(model_type, (configs or {}).get(model_type))
        result.model_class = type(model).__name__
        if model.config.model_type in SUPPORTED:
            _check_exact(result, model)
        else:
            _check_refused(result, model)

    return classified(result, check, time_limit)


def markdown_table(results: Sequence[VisionZooResult]) -> str:
    """The docs table: one row per architecture, then the count per state."""

    lines = ["| model_type | class | state | loss err | grad err | detail |", "|---|---|---|---|---|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r.model_type} | {r.model_class} | {r.state} | {error_cell(r.loss_error)} | "
            f"{error_cell(r.grad_error)} | {detail} |"
        )
    return "\n".join(lines + ["", state_counts(results, VISION_STATES)])
