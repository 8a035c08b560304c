"""Where the automatic CUDA engine should switch from ``varlen`` to ``flex``: one attention call, forward + backward,
on rows of one length cut into tree nodes of ``L`` tokens, for ``L`` from 8 to 1024.

    python benchmarks/varlen_threshold.py            # one CUDA GPU, about a minute
    python benchmarks/varlen_threshold.py --quick    # fewer node sizes, one repeat

Rows: ``--tokens`` (8192) tokens of trees whose every node holds ``L`` tokens and has ``--children`` (2) children
(padding at the end), in bfloat16 with Llama-3.2-1B's attention shapes (32 query heads, 8 KV heads, head dim 64).
Each row is timed (median of ``--repeats`` after a warm-up; FlexAttention's first call compiles) with ``varlen``
(PyTorch's flash varlen kernel, its two calls merged by log-sum-exp), ``varlen_paths`` (the same kernel in one call
over each segment's gathered root-to-segment path: no merge, but gathered keys; the plan ``varlen`` takes with a
sliding window), ``flex`` (compiled FlexAttention), ``flash_attn`` (flash-attn, where installed), and causal SDPA on
the whole row (the dense kernel's speed, which computes more pairs than the tree). It prints each
row's ``tokens_per_sequence`` (``hf_tree.attention.varlen.VarlenPlan``), the engine the current rule picks, and the
smallest value from which ``varlen`` is at least as fast as ``flex`` on every larger node size: the value to set
``hf_tree.attention.cuda.VARLEN_MIN_TOKENS_PER_SEQUENCE`` to (docs/attention.md). Without CUDA it prints the rows and
the rule's choices only, and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_tree
from hf_tree.attention import ENGINES, TreeAttentionOptions  # noqa: E402
from hf_tree.attention.cuda import VARLEN_MIN_TOKENS_PER_SEQUENCE, cuda_engine_choice  # noqa: E402
from hf_tree.attention.flash import flash_attn_varlen_func  # noqa: E402
from hf_tree.attention.varlen import cached_varlen_plan, plan_varlen_paths, torch_varlen_tree_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64


def tree_row(node_tokens: int, num_tokens: int, children: int) -> torch.Tensor:
    """``kv_end [1, num_tokens]`` int32 of trees (a forest) packed in DFS order, every node ``node_tokens`` tokens
    with ``children`` children, breadth first until the row is full; the rest is padding."""
    kv_end: list[int] = []

    def subtree(depth: int, max_depth: int) -> None:  # appends a node and its descendants, then sets their ends
        start = len(kv_end)
        kv_end.extend([0] * node_tokens)
        if depth < max_depth:
            for _ in range(children):
                subtree(depth + 1, max_depth)
        kv_end[start : start + node_tokens] = [len(kv_end)] * node_tokens

    max_depth = 0  # the deepest tree that fits
    while node_tokens * sum(children**d for d in range(max_depth + 2)) <= num_tokens:
        max_depth += 1
    while len(kv_end) + node_tokens * sum(children**d for d in range(max_depth + 1)) <= num_tokens:
        subtree(0, max_depth)
    kv_end += list(range(len(kv_end) + 1, num_tokens + 1))  # padding: each token sees itself
    return torch.tensor([kv_end], dtype=torch.int32)


def timed(step, repeats: int) -> float:
    """Median seconds of ``step()`` (forward + backward) after one warm-up call."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_step(engine: str, kv_end: torch.Tensor, q, k, v):
    """Forward + backward of one call: an engine of ``ENGINES``, or ``varlen_paths`` (the varlen engine on the
    one-call plan over whole root-to-segment paths instead of its two calls)."""
    options = TreeAttentionOptions(scaling=HEAD_DIM**-0.5)
    if engine == "varlen_paths":
        attend = functools.partial(torch_varlen_tree_attention, plan=plan_varlen_paths(kv_end, window=None))
    else:
        attend = ENGINES[engine]

    def step() -> None:
        out = attend(q, k, v, kv_end, options)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return step


def dense_step(q, k, v):
    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="node sizes 16, 64, 256; one repeat")
    args = parser.parse_args()
    sizes = [16, 64, 256] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024]
    repeats = 1 if args.quick else args.repeats
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else "no CUDA device: the rule only"
    print(
        f"varlen_threshold: {where}, torch {torch.__version__}, {args.tokens} tokens, {args.children} children per "
        f"node, bfloat16, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}; "
        f"VARLEN_MIN_TOKENS_PER_SEQUENCE={VARLEN_MIN_TOKENS_PER_SEQUENCE}"
    )
    engines = ["varlen", "varlen_paths", "flex"] + (["flash_attn"] if flash_attn_varlen_func() is not None else [])
    print(
        "| node tokens | tokens per sequence | rule picks | " + " | ".join(f"{e} ms" for e in engines) + " | dense ms |"
    )
    print("|---" * (4 + len(engines)) + "|")
    results = []
    for size in sizes:
        kv_end = tree_row(size, args.tokens, args.children).to(device)
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(
                1, h, args.tokens, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator
            ).requires_grad_()
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )
        per_sequence = cached_varlen_plan(kv_end).tokens_per_sequence
        picked = cuda_engine_choice(q, v, kv_end, TreeAttentionOptions(scaling=HEAD_DIM**-0.5))  # CPU: by the plan
        if not cuda:
            print(f"| {size} | {per_sequence:.1f} | {picked} |" + " skipped |" * (len(engines) + 1))
            continue
        times = {engine: timed(attention_step(engine, kv_end, q, k, v), repeats) for engine in engines}
        dense = timed(dense_step(q, k, v), repeats)
        results.append((per_sequence, times["varlen"] <= times["flex"]))
        cells = " | ".join(f"{1000 * times[e]:.2f}" for e in engines)
        print(f"| {size} | {per_sequence:.1f} | {picked} | {cells} | {1000 * dense:.2f} |")
    if results:
        losing = [value for value, varlen_wins in results if not varlen_wins]
        above = [value for value, _ in results if not losing or value > max(losing)]
        suggestion = f"{min(above):.0f}" if above else "none (flex won at every node size)"
        print(f"varlen at least as fast as flex from tokens_per_sequence >= {suggestion}")


if __name__ == "__main__":
    main()
