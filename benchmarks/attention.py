"""Side-by-side attention benchmark: tree_flash vs dense-mask SDPA vs causal SDPA vs per-branch SDPA.

For each row shape (a GRPO group, an agent trajectory, a random deep tree) it times forward+backward of
one attention call on the same packed row, medians over several repeats taken round-robin (so machine
noise hits every method alike), then measures each method's peak memory in separate runs.

    python benchmarks/attention.py            # full sizes (~8k tokens), several minutes on 2 CPU cores
    python benchmarks/attention.py --quick    # tiny sizes, a few seconds (smoke test)
    python benchmarks/attention.py --threads 1 --dtype bfloat16   # other settings

Methods, as transformers runs them in one attention layer:
- ``tree_flash``: the engine ``select_backend`` picks for the device ("cpu" off CUDA: segments or blocked; "cuda" on
  CUDA: varlen, flash-attn or flex by ``hf_tree.attention.cuda``'s rule), or the one named by ``--backend``.
- ``dense_sdpa``: SDPA with the tree as a dense ``[N, N]`` bool mask and K/V repeated to all heads (what
  the ``sdpa`` implementation does with a 4D mask). The mask is built before the timed region, once per
  batch as in a model; its N*N bytes are not in the peak column.
- ``causal_sdpa``: SDPA ``is_causal=True`` with native GQA on the same N (plain packing's cost, no tree).
- ``per_branch``: causal SDPA on every branch alone, one after another (time summed, peak the largest).

Peak memory, CPU: the rise of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before each run) over its resident set at the start of one forward+backward,
inputs allocated before. It is measured in a fresh child process started with glibc's mmap threshold
pinned to 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so every tensor buffer is its own mapping, returned to the
system when freed: the peak counts live tensors (outputs, gradients, temporaries of every thread), not
allocator caches. (The torch profiler's memory events would miss the blocked engine's worker threads.)
Timings run in the parent with the default allocator. CUDA: ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_tree import Tree, pack_trees
from hf_tree.attention import ENGINES, TreeAttentionOptions, dense_tree_mask, select_backend
from hf_tree.attention.mask import visible_keys_per_query


@dataclass
class Row:
    """One packed row and the branches it holds."""

    name: str
    kv_end: torch.Tensor
    """``[1, N]`` int32."""
    position_ids: torch.Tensor
    """``[1, N]`` int64 depths."""
    branch_lengths: list[int]


def _pack(name: str, sequences: list[list[int]]) -> Row:
    tree = Tree.from_sequences(sequences)
    batch, _ = pack_trees([tree], max_packed_tokens=tree.num_tokens)
    return Row(name, batch["kv_end"], batch["position_ids"], [int(n) for n in tree.branch_lengths])


def _tokens(rng: random.Random, n: int) -> list[int]:
    # A large vocabulary: branches that should diverge do so at their first token.
    return [rng.randrange(1, 1 << 30) for _ in range(n)]


def grpo_row(prompt: int, completions: int, completion_length: int, rng: random.Random) -> Row:
    """One prompt followed by ``completions`` sampled completions (a GRPO group)."""
    shared = _tokens(rng, prompt)
    sequences = [shared + _tokens(rng, completion_length) for _ in range(completions)]
    return _pack(f"GRPO {prompt}+{completions}x{completion_length}", sequences)


def agent_row(turns: int, system: int, user: int, reasoning: int, answer: int, rng: random.Random) -> Row:
    """An agent trajectory with reasoning stripped from earlier turns: one sample per turn, each sharing
    the stripped history with the next (a trunk with one reasoning+answer side branch per turn)."""
    history = _tokens(rng, system)
    sequences = []
    for _ in range(turns):
        history += _tokens(rng, user)
        answer_tokens = _tokens(rng, answer)
        sequences.append(history + _tokens(rng, reasoning) + answer_tokens)
        history = history + answer_tokens
    return _pack(f"agent {turns} turns", sequences)


def random_deep_row(num_tokens: int, segment: int, rng: random.Random) -> Row:
    """Branches that fork from a random point of a random earlier branch until ``num_tokens`` are packed."""
    sequences = [_tokens(rng, segment)]
    total = segment
    while total < num_tokens:
        base = rng.choice(sequences)
        added = min(rng.randint(segment // 4, segment), num_tokens - total)
        sequences.append(base[: rng.randint(1, len(base))] + _tokens(rng, added))
        total += added
    return _pack("random deep tree", sequences)


@dataclass
class Inputs:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_out: torch.Tensor


def _inputs(n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> Inputs:
    def leaf(h: int) -> torch.Tensor:  # HF layout: [B, N, H, D] projected, viewed as [B, H, N, D]
        return torch.randn(1, n, h, dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()

    return Inputs(
        leaf(heads), leaf(kv_heads), leaf(kv_heads), torch.randn(1, heads, n, dim, dtype=dtype, device=device)
    )


def _backward(out: torch.Tensor, inputs: Inputs) -> None:
    out.backward(inputs.grad_out)
    for t in (inputs.query, inputs.key, inputs.value):
        t.grad = None


def _methods(row: Row, x: Inputs, branches: list[Inputs], backend: str) -> dict[str, Callable[[], None]]:
    scaling = x.query.shape[-1] ** -0.5
    groups = x.query.shape[1] // x.key.shape[1]
    kv_end, position_ids = row.kv_end.to(x.query.device), row.position_ids.to(x.query.device)
    dense_mask = dense_tree_mask(kv_end)[:, None]
    engine = ENGINES[backend]
    options = TreeAttentionOptions(scaling=scaling, position_ids=position_ids)

    def tree_flash() -> None:
        out = engine(x.query, x.key, x.value, kv_end, options)
        _backward(out.transpose(1, 2), x)

    def dense_sdpa() -> None:
        key, value = x.key.repeat_interleave(groups, 1), x.value.repeat_interleave(groups, 1)
        _backward(F.scaled_dot_product_attention(x.query, key, value, attn_mask=dense_mask, scale=scaling), x)

    def causal(inputs: Inputs) -> None:
        out = F.scaled_dot_product_attention(
            inputs.query, inputs.key, inputs.value, is_causal=True, scale=scaling, enable_gqa=True
        )
        _backward(out, inputs)

    def per_branch() -> None:
        for inputs in branches:
            causal(inputs)

    return {
        "tree_flash": tree_flash,
        "dense_sdpa": dense_sdpa,
        "causal_sdpa": lambda: causal(x),
        "per_branch": per_branch,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_memory(fn: Callable[[], None], device: str) -> int:
    """Peak bytes above the start of ``fn``: allocated by torch (CUDA) or resident (CPU, see the docstring)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current resident set
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def _setup(row: Row, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    n = row.kv_end.shape[1]
    shape = (args.heads, args.kv_heads, args.head_dim, args.dtype, args.device)
    x = _inputs(n, *shape)
    branches = [_inputs(length, *shape) for length in row.branch_lengths]
    methods = _methods(row, x, branches, args.backend or select_backend(torch.device(args.device)))
    for fn in methods.values():  # warm-up (and the blocked engine's worker threads start)
        fn()
    return methods


def time_row(row: Row, args: argparse.Namespace) -> dict[str, float]:
    """``{method: median seconds of forward+backward}``, repeats taken round-robin over the methods."""
    methods = _setup(row, args)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            _sync(args.device)
            start = time.perf_counter()
            fn()
            _sync(args.device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def memory_row(row: Row, args: argparse.Namespace) -> dict[str, int]:
    """``{method: peak bytes}`` of one forward+backward each."""
    return {name: peak_memory(fn, args.device) for name, fn in _setup(row, args).items()}


def visible_fraction(row: Row) -> float:
    """Visible (query, key) pairs of the tree over those of a causal mask of the same length."""
    n = row.kv_end.shape[1]
    return float(visible_keys_per_query(row.kv_end[0]).sum()) / (n * (n + 1) / 2)


def rows_for(args: argparse.Namespace) -> list[Row]:
    rng = random.Random(args.seed)
    if args.quick:
        return [grpo_row(128, 4, 64, rng), agent_row(3, 32, 16, 48, 16, rng), random_deep_row(512, 64, rng)]
    return [grpo_row(1024, 8, 512, rng), agent_row(10, 256, 128, 384, 128, rng), random_deep_row(8192, 512, rng)]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"  # tiny (quick) rows may stay within already-resident pages


def format_table(rows: list[Row], times: list[dict[str, float]], memory: list[dict[str, int]]) -> str:
    header = (
        "| row | N | visible pairs vs causal | tree_flash s | causal_sdpa s | dense_sdpa s | per_branch s | "
        "causal / tree | dense / tree | per-branch / tree | tree MiB | causal MiB | dense MiB | per-branch MiB | "
        "tree / causal memory |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    mib = 1 << 20
    for row, t, m in zip(rows, times, memory):
        lines.append(
            f"| {row.name} | {row.kv_end.shape[1]} | {visible_fraction(row):.2f} | {t['tree_flash']:.3f} | "
            f"{t['causal_sdpa']:.3f} | {t['dense_sdpa']:.3f} | {t['per_branch']:.3f} | "
            f"{t['causal_sdpa'] / t['tree_flash']:.2f}x | {t['dense_sdpa'] / t['tree_flash']:.2f}x | "
            f"{t['per_branch'] / t['tree_flash']:.2f}x | {m['tree_flash'] / mib:.1f} | {m['causal_sdpa'] / mib:.1f} | "
            f"{m['dense_sdpa'] / mib:.1f} | {m['per_branch'] / mib:.1f} | {_ratio(m['tree_flash'], m['causal_sdpa'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny rows and one repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 5, quick 1)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=sorted(ENGINES), default=None, help="tree engine (default: automatic)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # the memory child process
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    return args


def measure_memory(rows: list[Row], args: argparse.Namespace, argv: list[str]) -> list[dict[str, int]]:
    if args.device == "cuda":
        return [memory_row(row, args) for row in rows]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024))
    child = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-only"], env=env, capture_output=True, text=True, check=False
    )
    if child.returncode != 0:
        raise RuntimeError(f"memory measurement failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = rows_for(args)
    if args.memory_only:
        print(json.dumps([memory_row(row, args) for row in rows]))
        return ""
    backend = args.backend or select_backend(torch.device(args.device))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"device={args.device} threads={torch.get_num_threads()} dtype={args.dtype} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} tree_flash backend={backend} repeats={args.repeats} "
        f"torch={torch.__version__} load average at start={load}",
        flush=True,
    )
    times = []
    for row in rows:
        times.append(time_row(row, args))
        print(f"timed: {row.name}", flush=True)
    memory = measure_memory(rows, args, argv)
    table = format_table(rows, times, memory)
    print(f"load average at end={' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(table)
    return table


if __name__ == "__main__":
    main()
