"""TRL options GPU users set, through the tree trainers (issue 49): ``gradient_checkpointing``, ``torch_compile``,
``padding_free`` and ``use_liger_kernel`` each train TRL's exact update (one SGD step in float64 against TRL's own
trainer, ``assert_same_step_as_trl``) or are refused by name with a ``ValueError`` before the first step."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from hf_tree.trl.dpo import TreeDPOConfig
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import assert_same_step_as_trl, one_step, saved_tiny_model, sft_step

ROWS = {
    "prompt": ["w10 w11 w12 w13 w14 w15", "w10 w11 w12 w13 w14 w15", "w16 w17", "w16 w17"],
    "completion": [" w20 w21 w22", " w23 w24", " w25", " w26 w27"],
}
CHECKPOINTING = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})


@pytest.fixture
def model_path(tmp_path) -> str:
    return saved_tiny_model(tmp_path / "model", torch.float64)


@pytest.mark.parametrize(
    "settings",
    # each repeats the fast tier's SFT step (tests/test_sft.py) with one setting; compiling takes ~1 min on CPU
    [
        pytest.param(CHECKPOINTING, marks=pytest.mark.slow),
        pytest.param(dict(torch_compile=True), marks=pytest.mark.slow),
    ],
    ids=["gradient_checkpointing", "torch_compile"],
)
def test_sft_option_trains_trls_step(model_path, settings):
    trl, trl_updates = sft_step(SFTTrainer, SFTConfig, model_path, ROWS, **settings)
    tree, tree_updates = sft_step(TreeSFTTrainer, TreeSFTConfig, model_path, ROWS, **settings)
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


@pytest.mark.slow  # repeats the fast tier's GRPO step (tests/test_grpo.py) with checkpointing
def test_grpo_gradient_checkpointing_trains_trls_step(model_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trl, trl_updates = one_step(GRPOTrainer, GRPOConfig, model_path, False, **CHECKPOINTING)
    tree, tree_updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, model_path, False, **CHECKPOINTING)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    assert_same_step_as_trl(trl, trl_updates, tree, tree_updates)


@pytest.mark.parametrize("field", ["padding_free", "use_liger_kernel"])
def test_sft_refuses_option_by_name(model_path, field):
    with pytest.raises(ValueError, match=f"{field}=True"):
        sft_step(TreeSFTTrainer, TreeSFTConfig, model_path, ROWS, **{field: True})


@pytest.mark.parametrize("field", ["use_liger_kernel", "torch_compile"])
@pytest.mark.parametrize("config_cls", [TreeGRPOConfig, TreeDPOConfig], ids=["grpo", "dpo"])
def test_tree_forward_refuses_option_by_name(tmp_path, config_cls, field):
    """Refused when the config is built (before any step), with ``tree_forward=False`` left to TRL's own forward:
    Liger's kernels need CUDA and are unchecked on packed trees; ``torch.compile(model)`` cannot wrap the tree
    forward bound as ``model.forward`` (dynamo's ``getfile`` assertion at the first step, measured with GRPO)."""
    settings = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{field: True})
    with pytest.raises(ValueError, match=f"{field}=True"):
        config_cls(**settings)
    assert getattr(config_cls(**settings, tree_forward=False), field)
