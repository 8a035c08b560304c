"""Tiny vision-language models from configs (random weights), their image inputs, and the per-branch oracle.

The oracle: the same model, on its own attention, run on each sample as an ordinary sequence with that sample's
images passed as the processor would (``pixel_values`` and friends concatenated, ``mm_token_type_ids`` for the
mRoPE families, ``token_type_ids`` for Gemma 3), combined with token normalization.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
import transformers

from tests.helpers import HYBRIDS, TINY, own_attention, replaced

IMAGE_TOKEN = 100
VISION_START, VISION_END = 102, 103
TEXT = dict(TINY, vocab_size=120, pad_token_id=0, bos_token_id=0, eos_token_id=1)  # ids 100-103: image tokens
MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2]}
QWEN_VISION = dict(depth=2, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
QWEN_TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=101, vision_start_token_id=VISION_START)
IDEFICS3_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2
)  # 16 patches, 2x2 pixel shuffle: 4 placeholder tokens per image
CONFIGS = {
    "qwen2_vl": lambda: transformers.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters=MROPE),
        vision_config=dict(QWEN_VISION, embed_dim=16, hidden_size=32, mlp_ratio=2),
        vision_end_token_id=VISION_END,
        **QWEN_TOKENS,
    ),
    "qwen2_5_vl": lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters=MROPE),
        vision_config=dict(
            QWEN_VISION,
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=32,
            window_size=8,
            fullatt_block_indexes=[1],
        ),
        vision_end_token_id=VISION_END,
        **QWEN_TOKENS,
    ),
    "qwen3_vl": lambda: transformers.Qwen3VLConfig(
        text_config=dict(TEXT, head_dim=8, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(
            QWEN_VISION,
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        vision_end_token_id=VISION_END,
        **QWEN_TOKENS,
    ),
    "qwen3_5": lambda: transformers.Qwen3_5Config(  # GatedDeltaNet layers (hf_tree.models.mixers) + attention
        text_config=TEXT | HYBRIDS["qwen3_5_text"] | {"rope_parameters": dict(MROPE, mrope_interleaved=True)},
        vision_config=dict(
            QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, num_position_embeddings=16
        ),
        vision_end_token_id=VISION_END,
        **QWEN_TOKENS,
    ),
    "idefics3": lambda: transformers.Idefics3Config(  # SmolVLM's architecture (unsplit images: one tile each)
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(IDEFICS3_VISION),
        scale_factor=2,
        image_token_id=IMAGE_TOKEN,
    ),
    "smolvlm": lambda: transformers.SmolVLMConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(IDEFICS3_VISION),
        scale_factor=2,
        image_token_id=IMAGE_TOKEN,
    ),
    "llava": lambda: transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
    ),
    # Any-resolution tiles: 8x8 tiles of 4 patches; an image's grid is one of the pinpoints (tests/ tiny_image)
    "llava_next": lambda: transformers.LlavaNextConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
        image_grid_pinpoints=[[8, 16], [16, 8], [16, 16]],
    ),
    # Local layers with a 3-token window, shorter than an image's 4 tokens: the window cuts the image blocks (the
    # bidirectional overlay is AND(window, OR(causal, block)) there), a global layer sees whole blocks.
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(
            TEXT,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2
        ),  # 16 patches pooled 2x2: 4 placeholder tokens per image
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
    ),
}
FAMILIES = tuple(CONFIGS)


def eager_experts(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """MoE experts as a loop (the grouped_mm kernels refuse float64)."""
    config._experts_implementation = config.text_config._experts_implementation = "eager"
    return config


def shrunk(model_type: str, patches: int = 4) -> transformers.PretrainedConfig:
    """``model_type``'s default config shrunk by the zoo's generic shrink, with images of ``patches x patches``
    patches, the image placeholder moved inside the shrunk vocabulary (the zoo's probe tokens are below 100), MoE
    experts as a loop."""
    from hf_tree.vision.zoo import tiny_vision_config

    config = tiny_vision_config(model_type)
    vision, patch = config.vision_config, config.vision_config.patch_size
    vision.image_size = [patch[0] * patches, patch[1] * patches] if isinstance(patch, list) else patch * patches
    for key in ("image_token_id", "image_token_index"):
        if getattr(config, key, None) is not None:
            setattr(config, key, config.text_config.vocab_size - 1)
    if getattr(vision, "window_size", None) and getattr(vision, "spatial_merge_size", None):  # Qwen2.5-VL's windows
        vision.window_size = patch * vision.spatial_merge_size * 2  # of 2x2 merged patches (in pixels)
    if getattr(vision, "out_hidden_size", None):  # Qwen-style merger: into the text model's width
        vision.out_hidden_size = config.text_config.hidden_size
    if getattr(config, "image_grid_pinpoints", None):  # LLaVA-Next: grids of 1x2, 2x1 and 2x2 tiles
        side = vision.image_size
        config.image_grid_pinpoints = [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    if hasattr(config, "vision_aspect_ratio"):  # LLaVA-OneVision: grids over 1 tile's worth are interpolated down
        config.vision_aspect_ratio = "anyres_max_1"
    if hasattr(config, "projector_patch_to_query_dict"):  # Aria: the 16 patches pooled into 4 queries
        config.projector_patch_to_query_dict = {patches * patches: 4}
    if hasattr(config, "mm_tokens_per_image"):  # Gemma 3's pooling: 2x2 of the 4x4 patches
        config.mm_tokens_per_image = 4
    if isinstance(getattr(config, "vision_feature_layers", None), list):  # VipLLaVA: layers of the shrunk tower
        config.vision_feature_layers = [-2, -1]
    return eager_experts(config)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
GLM_VISION = dict(QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, image_size=8)
GLM_TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=101, image_start_token_id=VISION_START)
GLM_TEXT = dict(TEXT, head_dim=16, rope_parameters=dict(MROPE, partial_rotary_factor=0.5))  # 8 rotary dims


def glm_config(name: str, **text) -> transformers.PretrainedConfig:
    """GLM-4V's architecture (Qwen-style patches and mRoPE; its image run between image start/end tokens)."""
    config = getattr(transformers, name)(
        text_config=dict(GLM_TEXT, **text), vision_config=dict(GLM_VISION), image_end_token_id=VISION_END, **GLM_TOKENS
    )
    return eager_experts(config)


# The zoo's tiny configs (benchmarks/vision_zoo.py, tests/test_vision_zoo.py): the families above, and the ones tested
# by the zoo's probe only (hf_tree.vision.zoo: two trees, loss and every gradient against each sample alone).
ZOO_CONFIGS = {
    **CONFIGS,
    **{
        t: functools.partial(shrunk, t)
        for t in (
            "aria",
            "aya_vision",
            "cohere2_vision",
            "deepseek_vl",
            "exaone4_5",
            "hyperclovax_vision_v2",
            "idefics2",
            "lfm3_vl",
            "minimax_m3_vl",
            "internvl",
            "llava_next_video",
            "llava_onevision",
            "qianfan_ocr",
            "shieldgemma2",
            "video_llava",
            "vipllava",
        )
    },
    "qwen3_vl_moe": lambda: eager_experts(
        transformers.Qwen3VLMoeConfig(
            text_config=dict(CONFIGS["qwen3_vl"]().text_config.to_dict(), **MOE, decoder_sparse_step=1),
            vision_config=CONFIGS["qwen3_vl"]().vision_config.to_dict(),
            vision_end_token_id=VISION_END,
            **QWEN_TOKENS,
        )
    ),
    "qwen3_5_moe": lambda: eager_experts(
        transformers.Qwen3_5MoeConfig(
            text_config=TEXT
            | HYBRIDS["qwen3_5_text"]
            | MOE
            | {"shared_expert_intermediate_size": 16, "rope_parameters": dict(MROPE, mrope_interleaved=True)},
            vision_config=dict(
                QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, num_position_embeddings=16
            ),
            vision_end_token_id=VISION_END,
            **QWEN_TOKENS,
        )
    ),
    "glm4v": functools.partial(glm_config, "Glm4vConfig"),
    "glm46v": functools.partial(glm_config, "Glm46VConfig", model_type="glm4v_text"),
    "glmga": functools.partial(glm_config, "GlmgaConfig"),
    "glm_ocr": functools.partial(glm_config, "GlmOcrConfig"),
    "glm4v_moe": functools.partial(
        glm_config,
        "Glm4vMoeConfig",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=0,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    ),
}
# Families whose own float32 internals (GatedDeltaNet's decay parameters) bound the float64 comparison.
FLOAT32_INTERNALS = ("qwen3_5",)


@contextlib.contextmanager
def float64_vision_rotary() -> Iterator[None]:
    """The Qwen vision towers apply their rotary embedding in float32 even in a float64 model, which rounds the vision
    gradients of a tree (an image encoded once, its feature gradients summed over showings) differently from per
    branch (~1e-8); keep float64 in both for 1e-9 tests (what ``float64_norms`` does for RMSNorm)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import rotate_half

    def apply(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    modules = [importlib.import_module(f"transformers.models.{n}.modeling_{n}") for n in FAMILIES if is_mrope(n)]
    with replaced(modules, "apply_rotary_pos_emb_vision", apply):
        yield


def tiny_vlm(family: str, dtype: torch.dtype = torch.float64, attn: str = "tree_flash", seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(CONFIGS[family](), dtype=dtype)
    model.set_attn_implementation(attn)
    if family == "gemma3":  # its projector starts at zero (every image feature 0): give the images some weight
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    return model


def is_mrope(family: str) -> bool:
    return family.startswith("qwen")


def tiny_image(family: str, seed: int, height: int = 4, width: int = 4) -> dict[str, torch.Tensor]:
    """One image's processor tensors (random pixels). Qwen: a ``height x width`` patch grid (``height * width / 4``
    placeholder tokens after the 2x2 merge); LLaVA: an 8x8 image (4 tokens); Idefics3/SmolVLM: one 8x8 tile;
    LLaVA-Next: 8x8 tiles of an 8x8 image for a square grid, of a 10x16 image otherwise (``image_sizes``)."""
    generator = torch.Generator().manual_seed(seed)
    if family == "llava_next":  # a square grid: 8x8 (3 tiles, 10 tokens after unpadding), else 10x16 (5 tiles, 14)
        image_sizes, tiles = ([8, 8], 3) if height == width else ([10, 16], 5)
        pixels = torch.randn(1, tiles, 3, 8, 8, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "image_sizes": torch.tensor([image_sizes])}
    if family in ("idefics3", "smolvlm"):
        pixels = torch.randn(1, 1, 3, 8, 8, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)}
    if not is_mrope(family):
        return {"pixel_values": torch.randn(1, 3, 8, 8, generator=generator, dtype=torch.float64)}
    pixels = torch.randn(height * width, 3 * 2 * 2 * 2, generator=generator, dtype=torch.float64)
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, height, width]])}


def has_bidirectional_images(family: str) -> bool:
    """Gemma 3: image tokens attend to each other both ways when the model gets ``token_type_ids``."""
    return family == "gemma3"


def placeholders(family: str, image: dict[str, torch.Tensor]) -> list[int]:
    """The tokens a processor writes for ``image`` (Qwen: wrapped in vision start/end tokens; Gemma 3: in its
    begin/end-of-image tokens)."""
    if has_bidirectional_images(family):
        return [VISION_START] + [IMAGE_TOKEN] * 4 + [VISION_END]
    if family == "llava_next":  # its processor's count: base tile + unpadded grid + one newline per grid row
        return [IMAGE_TOKEN] * {(10, 16): 14, (8, 8): 10}[tuple(image["image_sizes"][0].tolist())]
    if not is_mrope(family):
        return [IMAGE_TOKEN] * 4
    count = int(image["image_grid_thw"].prod()) // 4
    return [VISION_START] + [IMAGE_TOKEN] * count + [VISION_END]


def per_branch_vlm_loss(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    images: Sequence[Sequence[dict[str, torch.Tensor]]],
    loss_masks: Sequence[Sequence[int]] | None = None,
    drop_image_blocks: bool = False,
) -> torch.Tensor:
    """Token-normalized CE of every sample run alone (its own attention, its images encoded for it alone; Gemma 3:
    with the processor's ``token_type_ids``, its bidirectional image blocks, unless ``drop_image_blocks``)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(own_attention(model))
    total, divisor = 0.0, 0.0
    try:
        for b, (seq, sample_images) in enumerate(zip(sequences, images)):
            ids = torch.tensor([list(seq)])
            inputs = processor_batch(sample_images)
            if is_mrope(model.config.model_type):
                inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
            if has_bidirectional_images(model.config.model_type) and not drop_image_blocks:
                inputs["token_type_ids"] = (ids == IMAGE_TOKEN).int()  # as Gemma3Processor writes them
            mask = torch.tensor(loss_masks[b] if loss_masks else [1] * len(seq), dtype=torch.float64)[1:]
            logits = model(input_ids=ids, **inputs).logits[0, :-1]
            total = total + (F.cross_entropy(logits.double(), ids[0, 1:], reduction="none") * mask).sum()
            divisor += float(mask.sum())
    finally:
        model.set_attn_implementation(previous)
    return total / divisor


def processor_batch(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One sample's images as its processor batches them: tensors concatenated along dim 0, LLaVA-Next's tiles
    ``[1, tiles, C, H, W]`` zero-padded to the sample's most tiles first."""
    if not images:
        return {}
    if "image_sizes" in images[0]:
        most = max(image["pixel_values"].shape[1] for image in images)
        images = [
            {
                **image,
                "pixel_values": F.pad(
                    image["pixel_values"], (0, 0, 0, 0, 0, 0, 0, most - image["pixel_values"].shape[1])
                ),
            }
            for image in images
        ]
    return {k: torch.cat([image[k] for image in images]) for k in images[0]}


def word_level_tokenizer(special: dict[int, tuple[str, str]]) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (``w{i}`` -> id ``i``) with ``special``: ``{id: (attribute,
    token)}``, e.g. ``{IMAGE_TOKEN: ("image_token", "<image>")}``, registered as extra special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, TEXT["vocab_size"])}}
    for token_id, (_, token) in special.items():
        del vocab[f"w{token_id}"]
        vocab[token] = token_id
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="[PAD]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        extra_special_tokens=dict(special.values()),
    )


def chat_template(image_part: str) -> str:
    """A one-line chat template: each content part in order, an image part written as ``image_part``."""
    return (
        f"{{% for m in messages %}}{{% for c in m['content'] %}}{{% if c['type'] == 'image' %}}{image_part} "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
    )


def role_chat_template(image_part: str) -> str:
    """A chat template with roles (``w90`` user/system, ``w91`` assistant, ``w92`` end of turn), a generation prompt
    and ``{% generation %}`` markers around each assistant message and its end of turn; it never rewrites history."""
    parts = (
        f"{{% for c in m['content'] %}}{{% if c['type'] == 'image' %}}{image_part} "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}"
    )
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}w91 {% generation %}"
        f"{parts}w92 {{% endgeneration %}}{{% else %}}w90 {parts}w92 {{% endif %}}{{% endfor %}}"
        "{% if add_generation_prompt %}w91 {% endif %}"
    )


def llava_processor(template: str | None = None) -> transformers.LlavaProcessor:
    """A real ``LlavaProcessor`` for the tiny LLaVA: a word-level tokenizer (``w{i}`` -> id ``i``, ``<image>`` ->
    ``IMAGE_TOKEN``), CLIP's PIL image processor at 8x8 (4 placeholder tokens per image), a one-line chat template
    (or ``template``)."""
    return transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}),
        tokenizer=word_level_tokenizer({IMAGE_TOKEN: ("image_token", "<image>")}),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template or chat_template("<image>"),
    )


def gemma3_processor() -> transformers.Gemma3Processor:
    """A real ``Gemma3Processor`` for the tiny Gemma 3: the word-level tokenizer with its begin/end-of-image and soft
    image tokens, its PIL image processor at 8x8 (4 soft tokens per image, ``token_type_ids`` marking them), a
    one-line chat template."""
    special = {
        IMAGE_TOKEN: ("image_token", "<image_soft_token>"),
        VISION_START: ("boi_token", "<start_of_image>"),
        VISION_END: ("eoi_token", "<end_of_image>"),
    }
    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 8, "width": 8}),
        tokenizer=word_level_tokenizer(special),
        chat_template=chat_template("<start_of_image>"),
        image_seq_length=4,
    )


# The families tested through TRL's trainers with a real processor, and their processors.
PROCESSORS = {"llava": llava_processor, "gemma3": gemma3_processor}


# The Qwen VL families' processors (Qwen3.5 uses Qwen3-VL's, as transformers' AutoProcessor maps it).
QWEN_PROCESSOR_CLASSES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
}


def qwen_processor(family: str) -> transformers.ProcessorMixin:
    """The real processor of a tiny Qwen VL ``family`` for images only: its video processor needs torchvision (no
    wheel matches this CPU torch), so it is left out (the processor's class check is skipped for that one ``None``);
    Qwen2-VL's PIL image processor with the tiny tower's 2x2 patches, 2 frames and 2x2 merge (an 8x8 image: a 4x4
    grid, 4 placeholders between vision start/end), the word-level tokenizer with Qwen's special tokens, a one-line
    chat template. Images and texts go through the processor's own code (``replace_image_token``,
    ``mm_token_type_ids``), so TRL's trainers and the tree trainers get the same inputs."""
    cls = getattr(transformers, QWEN_PROCESSOR_CLASSES[family])

    def check_argument_for_proper_class(self, name: str, argument: object) -> object:
        if name == "video_processor" and argument is None:  # the one sub-processor left out
            return None
        return cls.check_argument_for_proper_class(self, name, argument)

    image_only = type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class})
    special = {
        IMAGE_TOKEN: ("image_token", "<|image_pad|>"),
        101: ("video_token", "<|video_pad|>"),
        VISION_START: ("vision_start_token", "<|vision_start|>"),
        VISION_END: ("vision_end_token", "<|vision_end|>"),
    }
    return image_only(
        image_processor=transformers.Qwen2VLImageProcessorPil(
            patch_size=2, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 16, "longest_edge": 256}
        ),
        tokenizer=word_level_tokenizer(special),
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )


def llava_next_processor() -> transformers.LlavaNextProcessor:
    """A real ``LlavaNextProcessor`` for the tiny LLaVA-Next (no torchvision needed): the word-level tokenizer with
    ``<image>``, its PIL image processor with 8x8 tiles on the tiny config's pinpoints (an 8x8 image: 10 placeholders,
    a 16x10 (w x h) image: 14, as ``placeholders`` counts them), a one-line chat template."""
    return transformers.LlavaNextProcessor(
        image_processor=transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": 8},
            crop_size={"height": 8, "width": 8},
            image_grid_pinpoints=CONFIGS["llava_next"]().image_grid_pinpoints,
        ),
        tokenizer=word_level_tokenizer({IMAGE_TOKEN: ("image_token", "<image>")}),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chat_template("<image>"),
    )


def idefics3_processor() -> transformers.Idefics3Processor:
    """A real ``Idefics3Processor`` for the tiny Idefics3/SmolVLM: the word-level tokenizer with ``<image>`` and its
    image wrappers, its PIL image processor on unsplit 8x8 images (4 placeholders each, and a
    ``pixel_attention_mask``), a one-line chat template."""
    special = {
        IMAGE_TOKEN: ("image_token", "<image>"),
        101: ("fake_image_token", "<fake_token_around_image>"),
        VISION_START: ("global_image_token", "<global-img>"),
    }
    return transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": 8}, max_image_size={"longest_edge": 8}
        ),
        tokenizer=word_level_tokenizer(special),
        image_seq_len=4,
        chat_template=chat_template("<image>"),
    )
