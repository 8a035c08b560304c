"""``MediaTree``: branches merged by tokens and image identity, each image stored once; datasets round trip."""

from __future__ import annotations

import datasets
import pytest
import torch

from hf_tree.vision import MEDIA_TOKEN_BASE, MediaTree, MediaTreeCollator
from tests.vision_models import IMAGE_TOKEN, placeholders, tiny_image


def test_same_placeholders_different_images_do_not_merge():
    cat, dog = tiny_image("qwen2_vl", 1), tiny_image("qwen2_vl", 2)
    run = placeholders("qwen2_vl", cat)
    tree = MediaTree.from_samples([[1, *run, 5], [1, *run, 6], [1, *run, 5]], [[cat], [dog], [dict(cat)]], IMAGE_TOKEN)
    assert len(tree.media) == 2  # the cat, passed twice (as equal tensors), is stored once
    # root [1, vision_start], then one child per image: the cat's branch ends [5] twice, the dog's its own
    assert [len(t) for t in tree.tree.node_tokens] == [2, len(run) - 1 + 1, len(run) - 1 + 1]
    assert tree.branch_tokens(1) == [1, *run, 6]
    assert [tree.branch_media(b) for b in range(3)] == [[0], [1], [0]]


def test_round_trip_through_datasets():
    cat, dog = tiny_image("llava", 1), tiny_image("qwen2_vl", 2)
    trees = [
        MediaTree.from_samples([[1, *placeholders("llava", cat), 5], [1, 2]], [[cat], []], IMAGE_TOKEN),
        MediaTree.from_samples([[1, *placeholders("llava", cat), 6]], [[cat]], IMAGE_TOKEN),
    ]
    rows = datasets.Dataset.from_list([t.to_dict() for t in trees])
    back = [MediaTree.from_dict(row, row=i) for i, row in enumerate(rows)]
    for tree, again in zip(trees, back):
        assert again.tree.node_tokens == tree.tree.node_tokens
        assert all(torch.equal(a[k], b[k]) for a, b in zip(tree.media, again.media) for k in a)
        assert all(a[k].dtype == b[k].dtype for a, b in zip(tree.media, again.media) for k in a)
    # the two trees kept apart (merged, they would share the image's placeholders too)
    batch = MediaTreeCollator(max_packed_tokens=32, merge_in_batch=False)(list(rows))
    assert batch["image_inputs"]["pixel_values"].shape == (1, 3, 8, 8)  # shared by both trees: stored once
    assert int(batch["input_ids"].max()) < MEDIA_TOKEN_BASE and int((batch["input_ids"] == IMAGE_TOKEN).sum()) == 8
    assert torch.equal(batch["media_ids"] >= 0, batch["input_ids"] == IMAGE_TOKEN)
    qwen = MediaTree.from_samples([[1, *placeholders("qwen2_vl", dog)]], [[dog]], IMAGE_TOKEN).to_dict()
    assert MediaTree.from_dict(qwen).media[0]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_bad_input_names_the_sample():
    cat = tiny_image("llava", 1)
    run = placeholders("llava", cat)
    with pytest.raises(ValueError, match=r"sample 1 has 2 runs of image_token_id=100 but 1 images"):
        MediaTree.from_samples([[1, *run], [1, *run, 2, *run]], [[cat], [cat]], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="sample 1 shows image 0 with 2 placeholder tokens, but an earlier sample"):
        MediaTree.from_samples([[1, *run], [1, *run[:2]]], [[cat], [cat]], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="images has 1 entries but sequences has 2"):
        MediaTree.from_samples([[1, *run], [1, 2]], [[cat]], IMAGE_TOKEN)
    big = {"pixel_values": torch.zeros(1, 3, 16, 16, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"pixel_values of different shapes beyond dim 0"):
        MediaTreeCollator(max_packed_tokens=32)([MediaTree.from_samples([[1, *run], [1, *run]], [[cat], [big]], 100)])
    row = MediaTree.from_samples([[1, *run]], [[cat]], IMAGE_TOKEN).to_dict()
    with pytest.raises(ValueError, match="row 3: placeholders refer to media 0 but only 0 are stored"):
        MediaTree.from_dict({**row, "media": []}, row=3)
    with pytest.raises(ValueError, match=r"row 4: media 0: pixel_values has shape \[1, 3, 8, 8\] but 2 values"):
        MediaTree.from_dict(
            {**row, "media": [{"pixel_values": {**row["media"][0]["pixel_values"], "values": [1, 2]}}]}, 4
        )
