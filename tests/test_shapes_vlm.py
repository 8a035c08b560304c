"""The offline shapes data: seeded, answers consistent with the drawing, and one image's questions trained as one
tree through transformers' own Qwen2-VL image processor (PIL backend) equal to per-question training."""

from __future__ import annotations

import random

import pytest

from hf_tree.data.shapes_vlm import COLORS, check_answer, draw_shapes, shapes_dataset, shapes_sft_dataset
from hf_tree.vision import MediaTree, MediaTreeCollator, tree_vision_lm_loss
from tests.helpers import float64_norms, relative_error
from tests.vision_models import IMAGE_TOKEN, float64_vision_rotary, per_branch_vlm_loss, placeholders, tiny_vlm

pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest.importorskip("PIL")  # hf_tree[vision]: the images are drawn with PIL


def test_shapes_are_seeded_and_answers_match_the_drawing():
    first, again = shapes_dataset(3, seed=7), shapes_dataset(3, seed=7)
    assert first["answer"] == again["answer"] and first["prompt"] == again["prompt"]
    assert len(set(first["image_id"])) == 3 and len(first) >= 3
    image, shapes = draw_shapes(random.Random(1))
    top = shapes[-1]  # drawn last, so its centre shows its colour
    assert image.getpixel(top.center) == COLORS[top.color]
    assert check_answer(" Red. ", "red") and not check_answer("", "red") and not check_answer("2 red", "red")


def test_sft_rows_are_the_questions_with_their_answers():
    prompts, conversations = shapes_dataset(2, seed=5), shapes_sft_dataset(2, seed=5)
    assert conversations["image_id"] == prompts["image_id"]
    for prompt, conversation in zip(prompts, conversations, strict=True):
        user, assistant = conversation["messages"]
        assert user == prompt["prompt"][0] and assistant["content"][0]["text"] == prompt["answer"]
        assert list(conversation["images"][0].getdata()) == list(prompt["image"].getdata())


def test_one_image_questions_as_a_tree_equal_per_question_training():
    from transformers import Qwen2VLImageProcessorPil

    rows = shapes_dataset(1, questions_per_image=3, seed=3)
    processor = Qwen2VLImageProcessorPil(
        patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=256, max_pixels=256
    )
    inputs = processor(images=[rows[0]["image"]], return_tensors="pt")
    image = {"pixel_values": inputs["pixel_values"].double(), "image_grid_thw": inputs["image_grid_thw"]}
    # word ids stand in for a tokenizer: the question's words hashed into the tiny vocabulary, then the answer's
    words = lambda text: [3 + sum(map(ord, w)) % 90 for w in text.split()]  # noqa: E731
    prompt = [1, 2, *placeholders("qwen2_vl", image)]
    sequences = [prompt + words(r["prompt"][0]["content"][1]["text"]) + words(r["answer"]) for r in rows]
    masks = [[0] * (len(s) - len(words(r["answer"]))) + [1] * len(words(r["answer"])) for s, r in zip(sequences, rows)]
    tree = MediaTree.from_samples(sequences, [[image]] * len(rows), IMAGE_TOKEN, masks)
    assert len(tree.media) == 1 and tree.tree.dedup_ratio > 1.5
    model = tiny_vlm("qwen2_vl")
    with float64_norms(), float64_vision_rotary():
        loss = tree_vision_lm_loss(model, MediaTreeCollator(max_packed_tokens=128)([tree]))
        reference = per_branch_vlm_loss(model, sequences, [[image]] * len(rows), masks)
    assert relative_error(loss, reference) < 1e-9
