"""Gemma 4 text and Gemma 3n text (issue 43), tiny as the model zoo builds them (``hf_tree.zoo.tiny_config``: Gemma
4's wider full-attention heads and per-layer inputs, Gemma 3n's shared-KV layers, sliding windows of 4 tokens),
through TRL's ``SFTTrainer`` and ``TreeSFTTrainer``: one SGD step (2 micro-batches of 2 rows, each a tree of one
prompt and its 2 completions) logs TRL's loss and moves every parameter as TRL does, in float64."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from hf_tree.zoo import tiny_config
from tests.helpers import assert_same_step_as_trl, own_attention, sft_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = {
    "prompt": ["w10 w11 w12 w13 w14 w15", "w10 w11 w12 w13 w14 w15", "w16 w17", "w16 w17"],
    "completion": [" w20 w21 w22", " w23 w24", " w25", " w26 w27"],
}


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
def test_sft_step_equals_trl(tmp_path, model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float64)
    model.set_attn_implementation(own_attention(model))
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    trl, trl_updates = sft_step(SFTTrainer, SFTConfig, path, ROWS)
    tree, tree_updates = sft_step(TreeSFTTrainer, TreeSFTConfig, path, ROWS)
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)
