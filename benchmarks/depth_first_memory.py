"""The memory knob: a low-dedup CHAMP group as one packed row, depth-first in units of about one branch, and one
branch at a time, on SmolLM2-135M: peak memory (a fresh process per measurement) and speed.

    PYTHONPATH=. python benchmarks/depth_first_memory.py            # SmolLM2-135M, CHAMP R~1.1, float32
    PYTHONPATH=. python benchmarks/depth_first_memory.py --quick    # smoke test: a tiny Llama, the group cut short

The group: ``step_breakdown.py``'s CHAMP group closest to ``--target`` (a prompt and 4 model answers). Methods
(forward + backward of the group, no optimizer; ``depth_first.py``'s own functions): ``per_branch`` (each branch
alone, one backward each), ``packed`` (the whole group in one row: what ``tree_execution="packed"`` trains) and
``depth_first`` (``tree_execution="depth_first"`` with ``max_unit_tokens`` = the longest branch: a unit budget of
about one branch).

Peak memory: each method in a fresh process (so no method reuses memory another freed): the model loaded, its
gradients allocated (as after a first step), then the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) during one step, above its resident set before it. The first-use self-check is off
(``HF_TREE_SELF_CHECK=0``: its probe is not the step's memory). Speed: one more process runs the methods
interleaved, one warm-up each, medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import depth_first  # noqa: E402  (the methods and the tiny model of the depth-first benchmark)
import step_breakdown  # noqa: E402  (the CHAMP groups)

from hf_tree import Tree  # noqa: E402

MIB = 1 << 20
METHODS = ("per_branch", "packed", "depth_first")


def group(args: argparse.Namespace) -> Tree:
    """The CHAMP group closest to ``--target`` (ids modulo the tiny model's vocabulary with ``--quick``)."""
    from hf_tree.assets import load_smollm2_tokenizer

    [work] = step_breakdown.pick_groups(load_smollm2_tokenizer(), [args.target], args.problems, 4096)
    tree = work.trees[0]
    return depth_first.remapped(tree, 160) if args.quick else tree


def load(args: argparse.Namespace) -> torch.nn.Module:
    if args.quick:
        model = depth_first.llama(quick=True)
    else:
        from hf_tree.assets import load_smollm2_model

        model = load_smollm2_model(dtype=getattr(torch, args.dtype))
    for p in model.parameters():  # as after a first step: every method accumulates into the same gradients
        p.grad = torch.zeros_like(p)
    return model.train()


def run(name: str, model: torch.nn.Module, tree: Tree) -> None:
    divisor = float(tree.token_weights.sum())
    row = int(tree.branch_lengths.max())  # depth-first units of about one branch
    if name == "per_branch":
        depth_first.per_branch(model, depth_first.branch_tensors(tree, model.device), divisor)
    elif name == "packed":
        depth_first.packed_rows(model, tree, divisor, tree.num_tokens)
    else:
        depth_first.depth_first(model, tree, divisor, row)


def _status_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def measure_peak(args: argparse.Namespace) -> None:
    """One method's step in this (fresh) process; prints ``{"peak_bytes": ...}`` (see the module docstring)."""
    model, tree = load(args), group(args)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set := the current one
    before = _status_kib("VmRSS:")
    run(args.peak_of, model, tree)
    print(json.dumps({"peak_bytes": (_status_kib("VmHWM:") - before) * 1024}))


def measure_speed(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per method, interleaved after one warm-up each."""
    model, tree = load(args), group(args)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for repeat in range(args.repeats + 1):
        for m in METHODS:
            start = time.perf_counter()
            run(m, model, tree)
            if repeat:
                times[m].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in times.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny Llama, the group cut to 160 tokens, one repeat")
    parser.add_argument("--target", type=float, default=1.1, help="dedup ratio of the CHAMP group")
    parser.add_argument("--problems", type=int, default=64, help="CHAMP problems to choose the group from")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peak-of", choices=METHODS, help=argparse.SUPPRESS)  # the child process's method
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.problems = 1, 8
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.peak_of:
        measure_peak(args)
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ, HF_TREE_SELF_CHECK="0")
    peaks = {}
    for m in METHODS:
        child = subprocess.run(
            [sys.executable, __file__, *argv, "--peak-of", m], env=env, capture_output=True, text=True, check=True
        )
        peaks[m] = json.loads(child.stdout.strip().splitlines()[-1])["peak_bytes"]
    os.environ["HF_TREE_SELF_CHECK"] = "0"
    seconds = measure_speed(args)
    tree = group(args)
    row = int(tree.branch_lengths.max())
    print(
        f"CHAMP R~{args.target:g}: {tree.num_tokens} tree / {tree.num_branch_tokens} branch tokens (dedup "
        f"{tree.dedup_ratio:.2f}), {tree.num_branches} branches, longest {row}; {'tiny' if args.quick else 'SmolLM2'} "
        f"{args.dtype}, {args.threads} thread(s), medians of {args.repeats}"
    )
    print("| method | unit tokens | tokens forwarded | peak MiB over the model | peak / per-branch | step s | speed |")
    print("|---|---|---|---|---|---|---|")
    units = {"per_branch": row, "packed": tree.num_tokens, "depth_first": row}
    forwarded = {"per_branch": tree.num_branch_tokens, "packed": tree.num_tokens, "depth_first": tree.num_tokens}
    for m in METHODS:
        print(
            f"| {m} | {units[m]} | {forwarded[m]} | {peaks[m] / MIB:.0f} | {peaks[m] / peaks['per_branch']:.2f} | "
            f"{seconds[m]:.2f} | {seconds['per_branch'] / seconds[m]:.2f}x |"
        )


if __name__ == "__main__":
    main()
