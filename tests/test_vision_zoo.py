"""The vision-language model zoo (hf_tree.vision.zoo): every image-text-to-text architecture trains exactly or is
refused with a ValueError; never a silent difference."""

from __future__ import annotations

import types

import pytest
import torch

from hf_tree.vision import SUPPORTED, vision_family
from hf_tree.vision.zoo import check_vision_architecture, markdown_table, vision_model_types
from tests.vision_models import ZOO_CONFIGS as CONFIGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_supported_families_are_exact(model_type):
    result = check_vision_architecture(model_type, CONFIGS)
    assert result.state == "exact", result.detail
    assert result.grad_error is not None and result.grad_error <= 1e-4


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("paligemma", "bidirectionally"),
        ("fuyu", "image_patches_indices"),
        ("mistral3", "IMG_BREAK"),
        # builds a whole tiny Janus (~4 s) to refuse it; the "not tested" refusal itself is the same code path
        pytest.param("janus", "not tested", marks=pytest.mark.slow),
    ],
)
def test_unsupported_families_are_refused(model_type, reason):
    result = check_vision_architecture(model_type)
    assert result.state == "refused", result.detail
    assert model_type in result.detail and reason in result.detail


def test_every_unsupported_model_type_is_refused_by_name():
    """The refusal depends on ``model_type`` alone: also the types the zoo cannot build tiny are refused."""
    for model_type in sorted(set(vision_model_types()) - set(SUPPORTED)):
        stub = torch.nn.Module()
        stub.config = types.SimpleNamespace(model_type=model_type)
        with pytest.raises(ValueError, match=f"model_type='{model_type}'.*cannot be trained on image trees"):
            vision_family(stub)


def test_markdown_table_counts_states():
    table = markdown_table([check_vision_architecture("paligemma")])
    assert "| paligemma | PaliGemmaForConditionalGeneration | refused |" in table
    assert table.endswith("exact: 0, refused: 1, not buildable: 0, error: 0, MISMATCH: 0 (of 1)")


@pytest.mark.slow
def test_whole_image_text_to_text_mapping_has_no_silent_mismatch():
    results = [check_vision_architecture(t, CONFIGS, time_limit=120) for t in vision_model_types()]
    assert not [r.model_type for r in results if r.state == "MISMATCH"]
    assert {r.model_type for r in results if r.state == "exact"} == set(SUPPORTED)


def test_llava_onevision_refuses_a_branch_with_two_images():
    """LLaVA-OneVision encodes a multi-image sample's images without their anyres tiles (batch_num_images): the tree
    forward encodes every image as a sample's only one, so a branch showing two images is refused before encoding."""
    from hf_tree.vision import MediaTree, MediaTreeCollator, tree_vision_lm_loss
    from hf_tree.vision.zoo import build_tiny_vlm, placeholder_tokens, tiny_image

    model = build_tiny_vlm("llava_onevision", CONFIGS["llava_onevision"])
    first, second = tiny_image(model, 1), tiny_image(model, 2)
    a, b = placeholder_tokens(model, first), placeholder_tokens(model, second)
    sequences = [[1, 2, *a, 5, 6], [1, 2, *a, 5, *b, 7], [3, *b, 4]]
    tree = MediaTree.from_samples(sequences, [[first], [first, second], [second]], model.config.image_token_id)
    batch = MediaTreeCollator(max_packed_tokens=512)([tree])
    with pytest.raises(ValueError, match="shows 2 images.*one image each"):
        tree_vision_lm_loss(model, batch)
    one_each = MediaTree.from_samples([sequences[0], sequences[2]], [[first], [second]], model.config.image_token_id)
    tree_vision_lm_loss(model, MediaTreeCollator(max_packed_tokens=512)([one_each])).backward()
