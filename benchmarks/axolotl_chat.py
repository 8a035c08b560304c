"""Axolotl with and without hf_tree's plugin on a multi-turn chat config: dedup and step time, side by side in one run.

The data is what chat logs exported per turn look like: chats that share one system prompt, each exported as one sample
per assistant turn (sample t repeats turns 1..t-1), tokenized and masked by Axolotl (``type: chat_template``, its
default ``train_on_inputs: false``). Model: a random Llama (``--hidden_size``, 2 layers) with GPT-2's tokenizer
(``hf_tree.integrations.axolotl_example``). Both runs take the same config (float32, SGD, the same seed, so the same
micro-batches; the plugin's adds ``plugins: [hf_tree.integrations.axolotl.TreePlugin]``) through Axolotl's own
``train`` entry in this process. The step time is the wall time between the ends of consecutive optimizer steps (data
collation included); the first step is warmup. Printed: the plugin's logged ``dedup_ratio`` (median over its steps),
the median step times, their ratio, and the relative difference of the two runs' updates.

Runs in the Axolotl environment of .ci/axolotl.sh, e.g.:

    . .venv-axolotl/bin/activate && python benchmarks/axolotl_chat.py   # ~5 min on a loaded 2-core CPU
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from axolotl.integrations.base import BasePlugin, PluginManager  # noqa: E402
from axolotl.utils.dict import DictDefault  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_tree.integrations.axolotl_example import PLUGIN, example_config, write_example  # noqa: E402


class StepTimes(TrainerCallback):
    """Wall time between the ends of consecutive optimizer steps."""

    times: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        StepTimes.times = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        StepTimes.times.append(time.perf_counter())


class TimerPlugin(BasePlugin):
    """Adds ``StepTimes`` to the trainer Axolotl builds (registered by its dotted name, as any plugin)."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [StepTimes()]


def run(folder: pathlib.Path, plugin: bool, settings: dict) -> tuple[list[float], list[float], dict]:
    """One Axolotl run: its step times (warmup step left out), logged dedup ratios and trained parameters."""
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train

    PluginManager.get_instance().plugins.clear()  # only this run's plugins (the manager is a process-wide singleton)
    config = example_config(folder, plugin=False, output_dir=str(folder / f"out-{plugin}"), **settings)
    config["plugins"] = [PLUGIN, f"{__name__}.TimerPlugin"] if plugin else [f"{__name__}.TimerPlugin"]
    cfg = load_cfg(DictDefault(config))
    model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
    steps = [b - a for a, b in zip(StepTimes.times, StepTimes.times[1:])][1:]
    dedup = [entry["dedup_ratio"] for entry in trainer.state.log_history if "dedup_ratio" in entry]
    return steps, dedup, {name: p.detach().clone() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chats", type=int, default=8, help="chats (each exported as --turns samples)")
    parser.add_argument("--turns", type=int, default=4, help="assistant turns per chat (one sample each)")
    parser.add_argument("--system_words", type=int, default=300, help="words of the shared system prompt")
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_example(tmp, args.chats, args.turns, args.system_words, args.hidden_size)
        settings = dict(
            micro_batch_size=args.micro_batch_size,
            max_steps=args.chats * args.turns // args.micro_batch_size,
            sequence_len=2048,
            dataset_processes=1,
        )
        runs = {plugin: run(folder, plugin, settings) for plugin in (False, True)}
        initial = load_file(folder / "model" / "model.safetensors")
    (plain, _, expected), (trees, dedup, got) = runs[False], runs[True]
    difference = sum(float((got[n] - expected[n]).square().sum()) for n in expected) ** 0.5
    update = sum(float((expected[n] - initial[n]).square().sum()) for n in expected) ** 0.5
    plain_step, tree_step = statistics.median(plain), statistics.median(trees)
    print(f"torch threads {torch.get_num_threads()}; {args.chats} chats x {args.turns} turns, micro-batch {settings}")
    print(f"dedup_ratio (plugin, median over steps): {statistics.median(dedup):.2f}")
    print(f"step time median: Axolotl {plain_step:.3f} s, with the plugin {tree_step:.3f} s")
    print(f"step-time ratio (Axolotl / plugin): {plain_step / tree_step:.2f}")
    print(f"relative update difference (plugin vs Axolotl): {difference / update:.2e}")


if __name__ == "__main__":
    main()
