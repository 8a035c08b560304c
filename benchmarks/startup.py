"""Start-up time: ``import hf_tree``, ``hf-tree --help`` and a ``tree_flash`` model, against torch + transformers.

Each command runs in a fresh interpreter, ``--repeats`` times, the commands interleaved (so a load change on a shared
machine hits them alike); the table gives the median wall time. Targets (issue 34): ``hf-tree --help`` <= 1 s;
``import hf_tree`` <= 0.5 s more than ``import torch, transformers``; the last two rows show what hf_tree adds where
transformers' modeling code is used (``tree_flash`` is registered as ``transformers.modeling_utils`` loads).

    python benchmarks/startup.py                            # this checkout
    python benchmarks/startup.py --baseline /work/main      # and another checkout's hf_tree beside it
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = (
    "from transformers import AutoModelForCausalLM, LlamaConfig\n"
    "config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
    "num_attention_heads=2, num_key_value_heads=1)\n"
    "AutoModelForCausalLM.from_config(config, attn_implementation={!r})"
)
# (label, python arguments, whether it runs hf_tree: then once per checkout)
COMMANDS = [
    ("import torch, transformers", ["-c", "import torch, transformers"], False),
    ("import hf_tree", ["-c", "import hf_tree"], True),
    ("hf-tree --help", ["-m", "hf_tree.cli", "--help"], True),
    ("sdpa Llama from config (no hf_tree)", ["-c", TINY_LLAMA.format("sdpa")], False),
    ("import hf_tree + tree_flash Llama", ["-c", "import hf_tree\n" + TINY_LLAMA.format("tree_flash")], True),
]


def wall_time(arguments: list[str], checkout: Path) -> float:
    """Seconds one fresh interpreter takes to run ``arguments`` with ``checkout``'s hf_tree first on the path."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *arguments], env=env, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (the median is reported)")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout whose hf_tree is timed too")
    args = parser.parse_args()
    checkouts = {"this": REPO_ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs = [
        (f"{label} [{name}]" if uses_hf_tree and len(checkouts) > 1 else label, arguments, checkout)
        for label, arguments, uses_hf_tree in COMMANDS
        for name, checkout in (checkouts.items() if uses_hf_tree else [("this", REPO_ROOT)])
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for _ in range(args.repeats):
        for label, arguments, checkout in runs:
            times[label].append(wall_time(arguments, checkout))
    print(f"| command | median s ({args.repeats} runs) | min s | max s |\n|---|---|---|---|")
    for label, values in times.items():
        print(f"| {label} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
