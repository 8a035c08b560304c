"""Depth-first execution vs today's split vs one packed row vs per-branch, for trees larger than a row.

    python benchmarks/depth_first.py            # small Llama (hidden 128, 4 layers); ~4 min on a shared 2-core box
    python benchmarks/depth_first.py --quick    # smoke test: a 2-layer model, short sequences, one repeat

Methods (forward + backward of one tree, no optimizer step; every loss divided by the tree's trained tokens):
- ``per_branch``: every branch alone (the model's own attention, shifted cross-entropy), one backward per branch.
- ``split``: today's ``tree_execution="packed"``: the tree split by its branches into parts of at most a row
  (``split_tree``), one ``tree_causal_lm_loss`` forward/backward per row; shared prefixes are recomputed per part.
- ``packed``: the whole tree in one row (what "packed" does when the row is large enough to hold the tree).
- ``depth_first``: ``hf_tree.depth_first`` with units of at most a row (``tree_execution="auto"``).

Workloads (real ones rendered by the tree builders with SmolLM2's tokenizer, ids modulo the model's vocabulary):
``grpo``: one prompt and 16 completions (random ids), the row a quarter of the tree (each split part holds the prompt
and two completions); ``agent``: the largest of the first 16 synthetic agent conversations
(``hf_tree.data.synthetic_agent``); ``CHAMP R~1.1/1.2/2.5``: the three CHAMP groups of ``step_breakdown.py`` (a
prompt and the answers of 4 models; ``0-Shot`` prompts for 1.1 and 1.2, ``5-Shot`` for 2.5; needs ``champ-dataset``,
skipped with a note otherwise); ``BFCL``: the smallest tree of the first 16 BFCL multi-turn ``base`` tasks
(``hf_tree.data.bfcl``, Qwen3 template: a long shared tool prompt and turns, short diverging ends). Every tree but
GRPO gets the row ``max(longest branch, a quarter of the tree)`` (split needs a branch to fit a row), plus
depth-first with a row of a quarter of the tree (``depth_first/4``) when that is smaller (split cannot run there).

Timings: medians of ``--repeats`` interleaved repeats after one warm-up run each. Peak: bytes allocated through
torch's CPU allocator above the start, in one extra profiled run (``_profiling.cpu_peak_bytes``); the model and its
gradients are allocated before, so the peak is activations, caches and transient buffers.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from _profiling import cpu_peak_bytes

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree import Tree, pack_trees, split_tree, tree_causal_lm_loss
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward

MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
QUICK_MODEL = dict(MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
VOCAB = 2048
MIB = 1 << 20


def llama(quick: bool, seed: int = 0) -> transformers.PreTrainedModel:
    """A small random float32 Llama on ``tree_flash`` (without ``kv_end`` it is exactly SDPA)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=16384, **(QUICK_MODEL if quick else MODEL)
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tree_flash", dtype=torch.float32)


def grpo_tree(prompt_tokens: int, completion_tokens: int, num_completions: int = 16, seed: int = 0) -> Tree:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_tokens)]
    completions = [[rng.randrange(3, VOCAB) for _ in range(completion_tokens)] for _ in range(num_completions)]
    masks = [[0] * prompt_tokens + [1] * completion_tokens for _ in completions]
    return Tree.from_sequences([prompt + c for c in completions], masks)


def remapped(tree: Tree, branch_tokens: int | None = None) -> Tree:
    """``tree``'s branches with ids modulo ``VOCAB``; with ``branch_tokens``, cut to that many tokens and every token
    trained (a cut may keep only untrained prompt tokens)."""
    branches = [[t % VOCAB for t in tree.branch_tokens(b)][:branch_tokens] for b in range(tree.num_branches)]
    masks = None if branch_tokens else [tree.branch_loss_mask(b) for b in range(tree.num_branches)]
    return Tree.from_sequences(branches, masks)


def agent_tree(conversations: int, branch_tokens: int | None = None) -> Tree:
    """The largest tree of the first ``conversations`` synthetic agent conversations (see ``remapped``)."""
    from hf_tree.assets import load_smollm2_tokenizer
    from hf_tree.builders import build_tree_dataset
    from hf_tree.data.sources import builtin_rows, chat_template_text

    rows, _ = builtin_rows("synthetic-agent", None, conversations)
    trees = build_tree_dataset(rows, load_smollm2_tokenizer(), chat_template=chat_template_text("qwen3"))
    tree = max((Tree.from_dict(row) for row in trees), key=lambda t: t.num_tokens)
    return remapped(tree, branch_tokens)


CHAMP_TARGETS = (1.1, 1.2, 2.5)  # step_breakdown.py's default --targets


def champ_trees(problems: int, branch_tokens: int | None = None) -> list[tuple[str, Tree]]:
    """``step_breakdown.py``'s CHAMP groups (the group closest to each of ``CHAMP_TARGETS`` among the first
    ``problems`` problems, at most 4096 tree tokens), as ``(label, tree)``; ``[]`` without ``champ-dataset``."""
    if importlib.util.find_spec("champ_dataset") is None:
        return []
    import step_breakdown

    from hf_tree.assets import load_smollm2_tokenizer

    works = step_breakdown.pick_groups(load_smollm2_tokenizer(), list(CHAMP_TARGETS), problems, 4096)
    return [(f"CHAMP {work.name}", remapped(work.trees[0], branch_tokens)) for work in works]


def bfcl_tree(tasks: int, branch_tokens: int | None = None) -> Tree:
    """The smallest tree of the first ``tasks`` BFCL multi-turn ``base`` tasks (``train_step.py``'s agent trees)."""
    import train_step

    from hf_tree.assets import load_smollm2_tokenizer

    trees = train_step._trees("agent", load_smollm2_tokenizer(), tasks)
    return remapped(min(trees, key=lambda t: t.num_tokens), branch_tokens)


def rows_of(tree: Tree) -> tuple[int, int | None]:
    """``(row, quarter)``: the smallest row split accepts that is at least a quarter of the tree, and the quarter
    when it is smaller than that row (``depth_first/4``)."""
    quarter = -(-tree.num_tokens // 4)
    row = max(int(tree.branch_lengths.max()), quarter)
    return row, (quarter if quarter < row else None)


# ------------------------------------------------------------------------------------------------ methods
def branch_tensors(tree: Tree, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each branch of ``tree`` on ``device``: its token ids ``[L]`` (int64) and the loss mask of its targets
    ``[L - 1]`` (float32)."""
    return [
        (
            torch.tensor(tree.branch_tokens(b), device=device),
            torch.tensor(tree.branch_loss_mask(b)[1:], dtype=torch.float32, device=device),
        )
        for b in range(tree.num_branches)
    ]


def per_branch(model: torch.nn.Module, branches: list[tuple[torch.Tensor, torch.Tensor]], divisor: float) -> None:
    """Every branch alone through ``model`` (its current attention), one backward per branch: the shifted
    cross-entropy of its trained targets over ``divisor``, on float32 logits as transformers' loss upcasts them.
    ``branches``: ``branch_tensors`` on the model's device."""
    for ids, mask in branches:
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        (F.cross_entropy(logits.float(), ids[1:], reduction="none") * mask).sum().div(divisor).backward()


def packed_rows(model: torch.nn.Module, tree: Tree, divisor: float, row: int) -> None:
    """Today's packing: split into parts of at most ``row`` tokens, bin-packed, one forward/backward per row."""
    batch, _ = pack_trees(split_tree(tree, row), row)
    for r in range(batch["input_ids"].shape[0]):
        n = batch["input_ids"].shape[1]
        in_row = (batch["loss_positions"] >= r * n) & (batch["loss_positions"] < (r + 1) * n)
        row_batch = {k: batch[k][r : r + 1] for k in ("input_ids", "position_ids", "kv_end")}
        row_batch["loss_positions"] = batch["loss_positions"][in_row] - r * n
        row_batch.update({k: batch[k][in_row] for k in ("loss_targets", "loss_weights")})
        row_batch["num_loss_items"] = batch["num_loss_items"]
        tree_causal_lm_loss(model, row_batch, num_items_in_batch=divisor).backward()


def depth_first(model: torch.nn.Module, tree: Tree, divisor: float, row: int) -> None:
    depth_first_backward(model, [tree], DepthFirstConfig(max_unit_tokens=row), num_items_in_batch=divisor)


def methods(tree: Tree, row: int, quarter: int | None) -> dict[str, Callable[[torch.nn.Module, float], None]]:
    runs = {
        "per_branch": lambda m, d: per_branch(m, branch_tensors(tree, m.device), d),
        "split": lambda m, d: packed_rows(m, tree, d, row),
        "packed": lambda m, d: packed_rows(m, tree, d, tree.num_tokens),
        "depth_first": lambda m, d: depth_first(m, tree, d, row),
    }
    if quarter is not None:
        runs["depth_first/4"] = lambda m, d: depth_first(m, tree, d, quarter)
    return runs


def computed_tokens(name: str, tree: Tree, row: int) -> int:
    """Tokens each method forwards."""
    if name == "per_branch":
        return tree.num_branch_tokens
    if name == "split":
        return sum(part.num_tokens for part in split_tree(tree, row))
    return tree.num_tokens


# ---------------------------------------------------------------------------------------------- measuring
def measure(model: torch.nn.Module, tree: Tree, runs: dict, repeats: int) -> dict[str, tuple[float, int]]:
    """``{method: (median seconds, peak bytes)}``; repeats interleave the methods."""
    divisor = float(tree.token_weights.sum())

    def step(run) -> None:
        model.zero_grad(set_to_none=False)
        run(model, divisor)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        step(run)  # warm-up (and the model's first-use self-check)
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            step(run)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), cpu_peak_bytes(lambda r=run: step(r))) for name, run in runs.items()}


def report(label: str, tree: Tree, row: int, quarter: int | None, results: dict) -> list[str]:
    base_time = results["depth_first"][0]
    branch_peak = results["per_branch"][1]
    lines = []
    for name, (seconds, peak) in results.items():
        unit = quarter if name == "depth_first/4" else tree.num_tokens if name == "packed" else row
        lines.append(
            f"| {label} | {name} | {unit} | {computed_tokens(name, tree, row)} | {seconds:.3f} | "
            f"{seconds / base_time:.2f} | {peak / MIB:.1f} | {peak / branch_peak:.2f} |"
        )
    return lines


def verdicts(label: str, tree: Tree, results: dict) -> list[str]:
    t = {name: seconds for name, (seconds, _) in results.items()}
    peak = {name: p for name, (_, p) in results.items()}
    speedup = t["per_branch"] / t["depth_first"]
    out = [
        f"{label}: depth_first is {t['split'] / t['depth_first']:.2f}x faster than split (target >= 1.5x: "
        f"{'met' if t['split'] >= 1.5 * t['depth_first'] else 'missed'})",
        f"{label}: depth_first peak = {peak['depth_first'] / peak['per_branch']:.2f} x per_branch's (target <= 1.3: "
        f"{'met' if peak['depth_first'] <= 1.3 * peak['per_branch'] else 'missed'})",
        f"{label}: depth_first is {speedup:.2f}x faster than per_branch at dedup {tree.dedup_ratio:.2f} "
        f"({speedup / tree.dedup_ratio:.2f} x dedup; target >= 0.8: "
        f"{'met' if speedup >= 0.8 * tree.dedup_ratio else 'missed'})",
    ]
    if "depth_first/4" in peak:
        out.append(
            f"{label}: depth_first/4 peak = {peak['depth_first/4'] / peak['per_branch']:.2f} x per_branch's, "
            f"{t['depth_first/4'] / t['depth_first']:.2f} x depth_first's time"
        )
    return out


HEADER = [
    "| workload | method | row / unit tokens | tokens forwarded | step s (median) | time / depth_first | peak MiB "
    "| peak / per_branch |",
    "|---|---|---|---|---|---|---|---|",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and trees, one repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=192)
    parser.add_argument("--agent-conversations", type=int, default=16)
    parser.add_argument("--champ-problems", type=int, default=64, help="CHAMP problems to pick the groups from")
    parser.add_argument("--bfcl-tasks", type=int, default=16, help="BFCL tasks to pick the smallest tree from")
    parser.add_argument("--branch-tokens", type=int, default=None, help="cut the real trees' branches")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: on a shared machine more threads spin)"
    )
    return parser.parse_args(argv)


def workloads(args: argparse.Namespace) -> list[tuple[str, Tree, int, int | None]]:
    """``(label, tree, row, quarter)`` of every workload (see the module docstring)."""
    grpo = grpo_tree(args.prompt_tokens, args.completion_tokens)
    grpo_row = args.prompt_tokens + 2 * args.completion_tokens  # the tree is 4x this row over 16 completions
    agent = agent_tree(args.agent_conversations, args.branch_tokens)
    real = [(f"agent ({agent.num_branches} branches)", agent)]
    real += champ_trees(args.champ_problems, args.branch_tokens)
    bfcl = bfcl_tree(args.bfcl_tasks, args.branch_tokens)
    real.append((f"BFCL ({bfcl.num_branches} branches)", bfcl))
    out = [(f"GRPO {args.prompt_tokens}+16x{args.completion_tokens}", grpo, grpo_row, None)]
    return out + [(label, tree, *rows_of(tree)) for label, tree in real]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.repeats, args.prompt_tokens, args.completion_tokens = 1, 48, 16
        args.agent_conversations, args.champ_problems, args.bfcl_tasks, args.branch_tokens = 4, 8, 2, 160
    torch.set_num_threads(args.threads)
    model = llama(args.quick)
    model.train()
    lines = list(HEADER)
    notes = [] if importlib.util.find_spec("champ_dataset") else ["CHAMP skipped: champ-dataset is not installed"]
    for label, tree, row, quarter in workloads(args):
        results = measure(model, tree, methods(tree, row, quarter), args.repeats)
        lines += report(label, tree, row, quarter, results)
        notes += [
            f"{label}: {tree.num_tokens} tree tokens = {tree.num_tokens / row:.2f} rows of {row}, "
            f"{tree.num_branch_tokens} branch tokens, dedup {tree.dedup_ratio:.2f}"
        ]
        notes += verdicts(label, tree, results)
        print(f"measured {label}", flush=True)
    size = "quick" if args.quick else "full"
    print(f"torch {torch.__version__}, {args.threads} threads, {size} model, medians of {args.repeats}")
    print("\n".join(lines))
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
