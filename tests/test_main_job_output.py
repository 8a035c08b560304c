"""What the main job shows: the smoothed loss picture and the line confirming a quantized base (QLoRA)."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from hf_tree.models.quantization import log_quantized_base, quantized_base_description
from hf_tree.plots import smoothed
from tests.helpers import saved_tiny_model, tiny_model


def test_smoothed_is_a_bias_corrected_moving_average():
    assert smoothed([3.0, 3.0, 3.0]) == pytest.approx([3.0, 3.0, 3.0])  # no pull towards 0 at the start
    weight = 0.6
    values = [4.0, 2.0, 1.0]
    expected, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        expected.append(average / (1 - weight**i))
    assert smoothed(values, weight) == pytest.approx(expected)
    assert smoothed(values, 0.0) == pytest.approx(values)


def test_loss_curve_draws_held_out_losses_as_points(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    from hf_tree import plots

    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))  # keep the figure to read its lines back
    history = [{"step": 0, "eval_loss": 2.4}] + [{"step": s, "loss": 2.5 - 0.01 * s} for s in range(1, 9)]
    history.append({"step": 8, "eval_loss": 2.1})
    path = plots.plot_loss_curve(history, tmp_path / "loss.png", title="t")
    assert path.stat().st_size > 0
    lines = {line.get_label(): line for line in drawn[0].axes[0].get_lines()}
    held_out = lines["held-out loss"]
    assert held_out.get_linestyle() == "None" and list(held_out.get_xdata()) == [0, 8]
    smooth = next(line for label, line in lines.items() if label.startswith("smoothed"))
    assert list(smooth.get_ydata()) == pytest.approx(smoothed([2.5 - 0.01 * s for s in range(1, 9)]))


bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize(
    "quantization, expected",
    [
        (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
            "bitsandbytes 4-bit nf4, compute dtype float32",
        ),
        (BitsAndBytesConfig(load_in_8bit=True), "bitsandbytes 8-bit (LLM.int8), compute dtype float32"),
    ],
)
def test_quantized_base_is_described(tmp_path, caplog, quantization, expected):
    path = saved_tiny_model(tmp_path, torch.float32, hidden_size=64, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)
    assert quantized_base_description(model) == expected
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    assert quantized_base_description(peft) == expected  # as the trainers see a QLoRA model
    with caplog.at_level(logging.INFO, logger="hf_tree"):
        log_quantized_base(peft)
    assert f"hf_tree: the base model is quantized: {expected};" in caplog.text
    assert quantized_base_description(tiny_model()) is None
