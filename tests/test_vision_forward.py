"""Vision-language trees: the packed forward (each image encoded once) equals per-branch training in float64.

Loss and every gradient (vision tower, projector, language model; LoRA on both) against the same model run on each
sample alone with its own attention (tests/vision_models.py), for Qwen2-VL, Qwen2.5-VL, Qwen3-VL (mRoPE positions
from the model's ``get_rope_index`` per branch, deepstack features), Qwen3.5 (GatedDeltaNet hybrid), LLaVA,
LLaVA-Next (any-resolution tiles, per-image feature lengths) and Idefics3/SmolVLM (1-D positions) and Gemma 3 (its
image tokens attend to each other both ways: the tree mask plus the ``bidirectional_block`` overlay, also under its
sliding-window layers).
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import transformers
from packaging.version import Version

from hf_tree import Tree
from hf_tree.attention import set_attention_backend
from hf_tree.loss import tree_causal_lm_loss
from hf_tree.vision import MediaTree, MediaTreeCollator, tree_vision_lm_loss, vision_family, vision_model_inputs
from hf_tree.vision.forward import ENCODER_OUTPUTS_TRANSFORMERS
from hf_tree.vision.media_tree import MEDIA_TOKEN_BASE
from tests.helpers import (
    FLOAT32_FLOOR,
    float32_floor_grad_error,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    relative_error,
)
from tests.vision_models import (
    FAMILIES,
    FLOAT32_INTERNALS,
    IMAGE_TOKEN,
    float64_vision_rotary,
    per_branch_vlm_loss,
    placeholders,
    tiny_image,
    tiny_vlm,
)

TOLERANCE = 1e-9
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def samples(family: str) -> tuple[list[list[int]], list[list[dict]], list[list[int]]]:
    """Two trees' worth of samples: a shared image prompt with several completions (one a prefix of another), a
    second image of another size behind the same text, an image shown twice in one sample, a text-only sample."""
    first, second = tiny_image(family, 1), tiny_image(family, 2, height=4, width=8)
    a, b = placeholders(family, first), placeholders(family, second)
    sequences = [
        [1, 2, *a, 5, 6, 7, 8],
        [1, 2, *a, 5, 9],
        [1, 2, *a, 5],
        [1, 2, *b, 5, 6, 7],
        [1, 2, *a, 5, 6, *a, 11, 12],
        [3, 4, 5, 6],
    ]
    images = [[first], [first], [first], [second], [first, first], []]
    masks = [[0] * (len(s) - 3) + [1] * 3 for s in sequences]
    return sequences, images, masks


def tree_batch(family: str, max_packed_tokens: int = 128) -> tuple[dict, tuple]:
    sequences, images, masks = samples(family)
    trees = [
        MediaTree.from_samples(sequences[:4], images[:4], IMAGE_TOKEN, masks[:4]),
        MediaTree.from_samples(sequences[4:], images[4:], IMAGE_TOKEN, masks[4:]),
    ]
    # two trees of two rows: in-batch merging (tests/test_in_batch_merging.py) would make them one
    collator = MediaTreeCollator(max_packed_tokens=max_packed_tokens, merge_in_batch=False)
    return collator(trees), (sequences, images, masks)


def loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    with float64_norms(), float64_vision_rotary():
        loss = loss_fn()
        loss.backward()
    return loss.detach(), grads_of(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_equals_per_branch(family):
    model = tiny_vlm(family)
    row_tokens = 48 if family == "llava_next" else 32  # two rows (LLaVA-Next's images: 10 and 14 tokens)
    batch, (sequences, images, masks) = tree_batch(family, max_packed_tokens=row_tokens)
    assert batch["input_ids"].shape[0] == 2
    loss, grads = loss_and_grads(model, lambda: tree_vision_lm_loss(model, batch))
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert any("visual" in n or "vision" in n for n in grads), "the vision tower must get gradients"
    if family in FLOAT32_INTERNALS:  # as tests/test_hybrid_mixers.py measures the text-only hybrids
        assert relative_error(loss, ref) <= FLOAT32_FLOOR
        assert float32_floor_grad_error(grads, ref_grads) <= FLOAT32_FLOOR
    else:
        assert relative_error(loss, ref) < TOLERANCE
        assert max_grad_relative_error(grads, ref_grads) < TOLERANCE


def test_lora_on_vision_and_language_equals_per_branch():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_vlm("qwen2_vl"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "qkv"], init_lora_weights=False)
    )
    batch, (sequences, images, masks) = tree_batch("qwen2_vl")
    loss, grads = loss_and_grads(model, lambda: tree_vision_lm_loss(model, batch))
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert {n.split(".lora")[0].split(".")[-1] for n in grads} == {"q_proj", "v_proj", "qkv"}
    assert relative_error(loss, ref) < TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) < TOLERANCE


def test_each_image_encoded_once_per_batch():
    """Also when trees are split over rows (the image prompt repeated in each part): one encoder call."""
    model = tiny_vlm("qwen2_vl")
    batch, (sequences, images, masks) = tree_batch("qwen2_vl", max_packed_tokens=20)  # the first tree is split
    assert batch["input_ids"].shape[0] >= 3
    # 6 showings of the 16-patch image (sample 4 shows it twice) and one of the 32-patch one: 48 patches encoded
    assert batch["image_inputs"]["pixel_values"].shape[0] == 16 + 32
    seen = []
    hook = model.model.visual.patch_embed.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    loss, grads = loss_and_grads(model, lambda: tree_vision_lm_loss(model, batch))
    hook.remove()
    assert seen == [48]
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert relative_error(loss, ref) < TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) < TOLERANCE


def test_refused_models_and_inputs():
    paligemma = torch.nn.Module()
    paligemma.config = types.SimpleNamespace(model_type="paligemma")
    with pytest.raises(ValueError, match="model_type='paligemma'.*bidirectionally"):
        vision_family(paligemma)
    model = tiny_vlm("qwen2_vl")
    batch, _ = tree_batch("qwen2_vl")
    batch["image_inputs"]["image_sizes"] = torch.tensor([[4, 4], [4, 8]])
    with pytest.raises(ValueError, match=r"\['image_sizes'\].*get_image_features"):
        tree_vision_lm_loss(model, batch)
    with pytest.raises(ValueError, match="overlong='truncate'"):
        MediaTreeCollator(max_packed_tokens=64, max_branch_tokens=8, overlong="truncate")
    with pytest.raises(ValueError, match="tree_execution='auto' is not supported for image trees"):
        MediaTreeCollator(max_packed_tokens=64, tree_execution="auto")


def test_sharded_model_is_refused_before_encoding_images(tmp_path):
    """FSDP2 (here one gloo process, ``fully_shard``): the images would be encoded outside FSDP's gathering."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = fully_shard(tiny_vlm("qwen2_vl"))
        batch, _ = tree_batch("qwen2_vl")
        with pytest.raises(ValueError, match=r"sharded \(FSDP2\): image trees encode their images before"):
            tree_vision_lm_loss(model, batch)
    finally:
        dist.destroy_process_group()


def test_activation_checkpointing_recomputes_the_same_tree():
    """Recomputed vision and language layers in backward see the same inputs (kv_end, positions, features)."""
    model = tiny_vlm("qwen2_vl")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs in training mode only (the tiny models have no dropout)
    batch, (sequences, images, masks) = tree_batch("qwen2_vl", max_packed_tokens=32)
    loss, grads = loss_and_grads(model, lambda: tree_vision_lm_loss(model, batch))
    model.activation_checkpointing_disable()
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert relative_error(loss, ref) < TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) < TOLERANCE


def gemma3_samples() -> tuple[list[list[int]], list[list[dict]], list[list[int]]]:
    """Gemma 3 trees: a shared image prompt (begin/end-of-image wrapped) with three completions, two of which show a
    second image in their own nodes (the nodes fork at the first image token, so each starts with an image block);
    unwrapped runs at node boundaries (a branch ending on an image that another continues, a node that starts with
    an image right after the shared text, a leaf ending on an image packed right before a sibling starting with
    another: adjacent in the row, two blocks)."""
    first, second = tiny_image("gemma3", 1), tiny_image("gemma3", 2)
    a, b = placeholders("gemma3", first), placeholders("gemma3", second)
    raw = [IMAGE_TOKEN] * 4
    sequences = [
        [1, 2, *a, 5, 6, 7, 8],
        [1, 2, *a, 5, 9, *b, 10, 11],
        [1, 2, *a, 5, 9, *a, 12],
        [3, 4, *raw, 6, 7],
        [3, 4, *raw],
        [3, 4, *raw, 8],
        [3, 4, 9, *raw, 8],
        [7, *raw],
        [7, *raw, 8],
    ]
    images = [[first], [first, second], [first, first], [first], [first], [second], [second], [first], [second]]
    masks = [[0] + [1] * (len(s) - 1) for s in sequences]
    return sequences, images, masks


def gemma3_batch() -> tuple[dict, tuple]:
    sequences, images, masks = gemma3_samples()
    trees = [
        MediaTree.from_samples(sequences[:3], images[:3], IMAGE_TOKEN, masks[:3]),
        MediaTree.from_samples(sequences[3:], images[3:], IMAGE_TOKEN, masks[3:]),
    ]
    return MediaTreeCollator(max_packed_tokens=40)(trees), (sequences, images, masks)


@pytest.mark.parametrize("engine", ["cpu", "blocked", "reference"])
def test_gemma3_bidirectional_image_blocks_equal_per_branch(engine):
    """The tree mask plus Gemma 3's image blocks (global and 3-token sliding layers) = each branch alone with its
    own sdpa attention and the processor's token_type_ids; loss and every gradient, vision tower included."""
    model = tiny_vlm("gemma3")
    batch, (sequences, images, masks) = gemma3_batch()
    assert batch["input_ids"].shape[0] == 2
    blocks = vision_model_inputs(model, batch)["bidirectional_block"]
    assert torch.equal(blocks >= 0, batch["media_ids"] >= 0)
    assert (blocks.amax(1) >= 2).all()  # three blocks or more in each row (one per image run)
    adjacent = (blocks[:, 1:] >= 0) & (blocks[:, :-1] >= 0)
    assert (adjacent & (blocks[:, 1:] != blocks[:, :-1])).any()  # sibling images side by side: two blocks
    set_attention_backend(engine)
    try:
        loss, grads = loss_and_grads(model, lambda: tree_vision_lm_loss(model, batch))
    finally:
        set_attention_backend(None)
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert any("vision_tower" in n and g.abs().max() > 0 for n, g in grads.items())
    assert relative_error(loss, ref) < TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) < TOLERANCE


def test_gemma3_without_the_overlay_is_wrong():
    """The overlay is needed: dropping it from the tree (or token_type_ids from the branches) moves the gradients far
    beyond rounding."""
    model = tiny_vlm("gemma3")
    batch, (sequences, images, masks) = gemma3_batch()

    def without_overlay():
        inputs = vision_model_inputs(model, batch)
        del inputs["bidirectional_block"]
        return tree_causal_lm_loss(model, batch, model_inputs=inputs)

    loss, grads = loss_and_grads(model, without_overlay)
    ref, ref_grads = loss_and_grads(model, lambda: per_branch_vlm_loss(model, sequences, images, masks))
    assert max(relative_error(loss, ref), max_grad_relative_error(grads, ref_grads)) > 1e-3
    assert max_grad_relative_error(grads, ref_grads) > 1e-3
    causal, causal_grads = loss_and_grads(
        model, lambda: per_branch_vlm_loss(model, sequences, images, masks, drop_image_blocks=True)
    )
    assert relative_error(causal, loss) < TOLERANCE  # the causal tree is the causal branches: the overlay is the gap
    assert max_grad_relative_error(causal_grads, grads) < TOLERANCE


def test_image_run_split_between_nodes_is_refused():
    """A trie whose node boundary cuts an image run (not what MediaTree.from_samples builds) is refused by name."""
    model = tiny_vlm("gemma3")
    m = MEDIA_TOKEN_BASE
    merged = Tree.from_sequences([[1, 2, m, m, m, m, 5], [1, 2, m, m, m, m, 6]])
    assert merged.node_tokens == [[1, 2, m, m, m, m], [5], [6]]
    cut = Tree([[1, 2, m, m], [m, m, 5], [m, m, 6]], [-1, 0, 0], merged.branch_end_nodes, merged.branch_loss_spans)
    batch = MediaTreeCollator(max_packed_tokens=16)([MediaTree(cut, IMAGE_TOKEN, [tiny_image("gemma3", 1)])])
    with pytest.raises(ValueError, match=r"packed row 0: the image tokens from token 4 on continue .*split between"):
        tree_vision_lm_loss(model, batch)


def test_image_features_follow_the_rows_of_each_image():
    """An image's features are its entries of the encoder's output in order (InternVL: one entry per crop, the image's
    crops written as one run); entries that do not add up to the images' rows are refused."""
    from hf_tree.vision.forward import image_features

    entries = torch.arange(5 * 2 * 3, dtype=torch.float64).reshape(5, 2, 3)  # 5 crops of 2 tokens
    batch = {"image_inputs": {"pixel_values": torch.zeros(5, 3, 8, 8)}, "image_rows": torch.tensor([2, 1, 2])}
    per_image = image_features(entries, batch)
    assert [len(f) for f in per_image] == [4, 2, 4]
    assert torch.equal(torch.cat(per_image), entries.reshape(10, 3))
    with pytest.raises(ValueError, match="returned 5 feature entries for images with 4"):
        image_features(entries, {**batch, "image_rows": torch.tensor([2, 2])})
    grids = {"image_inputs": {"image_grid_thw": torch.tensor([[1, 2, 2]] * 5)}, "image_rows": torch.tensor([4] * 5)}
    assert len(image_features(entries, grids)) == 5  # Qwen: rows are patches, one entry per image


def test_a_forward_without_encoder_outputs_is_refused():
    """Image trees hand the images' features through ``mm_encoder_outputs``, which transformers' vision-language
    forwards take from 5.18 on; before (5.16.1, Axolotl's pin: .ci/trl_oldest.sh runs this test there) the keyword
    fell into ``**kwargs`` and the packed rows trained without their images (the vision tower got no gradient, loss
    off by 1.9e-3 relative). Refused by name there, accepted here."""
    model = tiny_vlm("qwen2_vl")
    takes_it = "mm_encoder_outputs" in inspect.signature(type(model).forward).parameters
    assert takes_it == (Version(transformers.__version__) >= Version(ENCODER_OUTPUTS_TRANSFORMERS))
    if takes_it:
        assert vision_family(model).mrope
    else:
        with pytest.raises(ValueError, match=r"takes no mm_encoder_outputs in transformers .* 'transformers>=5\.18"):
            vision_family(model)
