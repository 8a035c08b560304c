"""End-to-end training-step benchmark: the same data, one optimizer step, four ways, side by side in one run.

    python benchmarks/train_step.py                      # tiny model and SmolLM2-135M, all workloads (long)
    python benchmarks/train_step.py --models tiny        # the tiny model only
    python benchmarks/train_step.py --quick              # smoke test: tiny model, tiny steps, one repeat

Methods (each runs forward + backward over the whole step, then ``AdamW.step()``; the loss of every method
is divided by the step's total trained tokens, as ``Trainer`` does with ``num_items_in_batch``):

- ``per_branch``: every branch alone, one sequence per forward, no padding (the strongest flat baseline
  on a CPU), ``attn_implementation="sdpa"``.
- ``padded``: ``transformers.Trainer``'s default: micro-batches of ``--batch-size`` branches right-padded
  by TRL's ``DataCollatorForLanguageModeling`` (attention mask, labels -100), SDPA.
- ``trl_packing``: TRL padding-free packing: branches packed into rows of ``--max-packed-tokens`` by
  ``trl.pack_dataset(strategy="bfd")`` and collated with ``padding_free=True`` (one row of concatenated
  sequences, ``position_ids`` restarting at 0). On CPU there is no flash-attn; transformers' SDPA path detects
  the packed sequences from ``position_ids`` and builds the block-diagonal causal mask itself, so this is
  TRL's padding-free semantics with SDPA (no reimplementation needed; the loss check confirms it).
- ``hf_tree``: tree packing: ``TreeDataCollator``'s rows (one row per micro-batch, same row length as TRL),
  ``tree_causal_lm_loss`` with ``attn_implementation="tree_flash"`` and the engine ``select_backend`` picks
  (``blocked`` on CPU). ``--with-dense`` adds ``hf_tree_dense``: the same with the dense-mask reference engine.

Batches are collated before the timed region (data loading is the dataloader's job); collation time is
reported separately. Timings are medians of ``--repeats`` round-robin repeats (machine noise hits every
method alike). Peak memory: the torch profiler's allocation events over one step, above what was allocated
before it; gradients and AdamW state exist beforehand, so it is the step's activations and temporaries.
Loss check: each method's step loss against ``per_branch`` (relative difference; float32).

Workloads (real data, read offline from installed packages; see hf_tree.data):
- ``groups``: CHAMP ``0-Shot`` completion groups (4 models' answers to one short prompt; dedup ~1.1).
- ``long_prompts``: CHAMP ``5-Shot`` groups (a ~1.5k-token few-shot prompt, 4 answers; dedup ~2.6).
- ``agent``: BFCL multi-turn tasks replayed through their simulators (per-turn samples sharing ~3-7k tokens
  of tool schemas and history; dedup ~5), rendered with TRL's qwen3 template.
- ``agent_small``: hf_tree's synthetic agent trajectories (shorter; dedup ~3), for models too slow on ``agent``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from _profiling import cpu_peak_bytes
from trl import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree import Tree, pack_trees, tree_causal_lm_loss
from hf_tree.attention import select_backend, set_attention_backend
from hf_tree.builders import build_tree_dataset
from hf_tree.stats import plan_rows

datasets.disable_progress_bars()

WORKLOADS = ("groups", "long_prompts", "agent", "agent_small")
METHODS = ("per_branch", "padded", "trl_packing", "hf_tree")
MIB = 1 << 20


@dataclass
class Workload:
    """One optimizer step's data: whole trees, and the same data as branches."""

    name: str
    trees: list[Tree]
    sequences: list[list[int]] = field(init=False)
    loss_masks: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.sequences = [t.branch_tokens(b) for t in self.trees for b in range(t.num_branches)]
        self.loss_masks = [t.branch_loss_mask(b) for t in self.trees for b in range(t.num_branches)]

    def remapped(self, vocab_size: int) -> Workload:
        """The same branches with token ids taken modulo ``vocab_size``, merged again (``--quick`` only: a small
        vocabulary keeps the smoke test's LM head cheap)."""
        trees = [
            Tree.from_sequences(
                [[i % vocab_size for i in t.branch_tokens(b)] for b in range(t.num_branches)],
                [t.branch_loss_mask(b) for b in range(t.num_branches)],
            )
            for t in self.trees
        ]
        return Workload(self.name, trees)

    @property
    def num_branch_tokens(self) -> int:
        return sum(t.num_branch_tokens for t in self.trees)

    @property
    def num_tree_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trees)

    @property
    def num_trained(self) -> int:
        """Trained tokens summed over branches: every method's loss divisor."""
        return sum(int(t.branch_num_trained.sum()) for t in self.trees)

    @property
    def dedup_ratio(self) -> float:
        return self.num_branch_tokens / self.num_tree_tokens


def _trees(name: str, tokenizer: transformers.PreTrainedTokenizerBase, limit: int) -> list[Tree]:
    """The first ``limit`` problems/tasks/conversations of a workload's source, as trees."""
    from hf_tree.data.sources import builtin_rows, chat_template_text

    source, subset, template = {
        "groups": ("champ", "0-Shot", None),
        "long_prompts": ("champ", "5-Shot", None),
        "agent": ("bfcl", "base", "qwen3"),
        "agent_small": ("synthetic-agent", None, "qwen3"),
    }[name]
    rows, _ = builtin_rows(source, subset, limit)
    trees = build_tree_dataset(rows, tokenizer, chat_template=chat_template_text(template))
    return [Tree.from_dict(row, row=i) for i, row in enumerate(trees)]


def make_workload(
    name: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    step_tokens: int,
    max_packed_tokens: int,
    smallest: bool = False,
) -> Workload:
    """Trees in source order (or smallest first) until ``step_tokens`` tree tokens, skipping any with a branch
    longer than a row."""
    limit = 4
    while True:
        candidates = [t for t in _trees(name, tokenizer, limit) if int(t.branch_lengths.max()) <= max_packed_tokens]
        if smallest:
            candidates.sort(key=lambda t: t.num_tokens)
        chosen, total = [], 0
        for tree in candidates:
            if total >= step_tokens:
                break
            chosen.append(tree)
            total += tree.num_tokens
        if total >= step_tokens or limit >= 256:
            break
        limit *= 4
    if not chosen:
        raise ValueError(f"workload {name}: no tree fits max_packed_tokens={max_packed_tokens}; raise it.")
    return Workload(name, chosen)


# ---------------------------------------------------------------------------------------------- models


TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
QUICK_TINY = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
QUICK_VOCAB = 512  # --quick remaps token ids into this vocabulary


def tiny_model(vocab_size: int, seed: int, dims: dict[str, int]) -> transformers.PreTrainedModel:
    """A small random Llama over the real tokenizer's vocabulary (so real token ids work)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=16384, tie_word_embeddings=True, **dims
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def load_model(name: str, vocab_size: int, args: argparse.Namespace) -> transformers.PreTrainedModel:
    if name == "tiny":
        return tiny_model(QUICK_VOCAB if args.quick else vocab_size, args.seed, QUICK_TINY if args.quick else TINY)
    from hf_tree.assets import load_smollm2_model

    return load_smollm2_model(dtype=torch.float32, attn_implementation="sdpa")


# ---------------------------------------------------------------------------------------------- methods


def _labels(sequence: list[int], mask: list[int]) -> list[int]:
    return [t if m else -100 for t, m in zip(sequence, mask)]


def collate(method: str, work: Workload, args: argparse.Namespace, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches for ``method`` (done before timing, as a dataloader would)."""
    examples = [{"input_ids": s, "labels": _labels(s, m)} for s, m in zip(work.sequences, work.loss_masks)]
    if method == "per_branch":
        return [{k: torch.tensor([v]) for k, v in e.items()} for e in examples]
    if method == "padded":
        collator = DataCollatorForLanguageModeling(pad_token_id=pad_id)
        return [collator(examples[i : i + args.batch_size]) for i in range(0, len(examples), args.batch_size)]
    if method == "trl_packing":
        packed = pack_dataset(datasets.Dataset.from_list(examples), args.max_packed_tokens, strategy="bfd")
        assert sum(len(r) for r in packed["input_ids"]) == work.num_branch_tokens, "TRL packing truncated a branch"
        collator = DataCollatorForLanguageModeling(pad_token_id=pad_id, padding_free=True)
        return [collator([row]) for row in packed]
    plan = plan_rows(work.trees, args.max_packed_tokens)  # the collator's rows; one per micro-batch
    return [pack_trees(parts, args.max_packed_tokens, pad_token_id=pad_id)[0] for parts in plan.rows]


def micro_batch_loss(method: str, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
    if method.startswith("hf_tree"):
        return tree_causal_lm_loss(model, batch, num_items_in_batch=num_items)
    return model(**batch, use_cache=False, num_items_in_batch=num_items).loss


def training_step(
    method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict], num_items: int
) -> float:
    """Forward + backward of every micro-batch, then the optimizer step; returns the step's loss."""
    total = 0.0
    for batch in batches:
        loss = micro_batch_loss(method, model, batch, num_items)
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: peak memory is the step's own
    return total


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    losses: list[float] = field(default_factory=list)
    collate_seconds: float = 0.0
    num_micro_batches: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def run_workload(model: torch.nn.Module, work: Workload, methods: list[str], args, pad_id: int) -> dict[str, Result]:
    initial = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # create gradients and AdamW state before any measurement
        p.grad = torch.zeros_like(p)
    optimizer.step()
    results = {m: Result() for m in methods}
    batches = {}
    for m in methods:
        start = time.perf_counter()
        batches[m] = collate(m.removesuffix("_dense"), work, args, pad_id)
        results[m].collate_seconds = time.perf_counter() - start
        results[m].num_micro_batches = len(batches[m])

    def step(m: str) -> Callable[[], None]:
        def run() -> None:
            model.load_state_dict(initial)  # every run starts from the same weights: losses comparable
            model.set_attn_implementation("tree_flash" if m.startswith("hf_tree") else "sdpa")
            set_attention_backend("reference" if m == "hf_tree_dense" else None)
            start = time.perf_counter()
            loss = training_step(m, model, optimizer, batches[m], work.num_trained)
            results[m].seconds.append(time.perf_counter() - start)
            results[m].losses.append(loss)

        return run

    for m in methods:  # the first run of each method is the profiled one (memory), untimed
        results[m].peak_bytes = cpu_peak_bytes(step(m))
        results[m].seconds.clear()
        print(f"  {m}: profiled run done (loss {results[m].losses[-1]:.6f})", flush=True)
    for _ in range(args.repeats):
        for m in methods:
            step(m)()
    set_attention_backend(None)
    model.load_state_dict(initial)
    return results


# ---------------------------------------------------------------------------------------------- report


def format_rows(model_name: str, work: Workload, results: dict[str, Result]) -> list[str]:
    base = results["per_branch"]
    lines = []
    for m, r in results.items():
        loss_error = max(abs(loss - base.losses[0]) / abs(base.losses[0]) for loss in r.losses)
        lines.append(
            f"| {model_name} | {work.name} | {work.dedup_ratio:.2f} | {m} | {r.num_micro_batches} | {r.median:.3f} | "
            f"{1e6 * r.median / work.num_branch_tokens:.1f} | {base.median / r.median:.2f}x | "
            f"{r.peak_bytes / MIB:.0f} | {loss_error:.1e} | {r.collate_seconds:.2f} |"
        )
    return lines


HEADER = (
    "| model | workload | dedup | method | micro-batches | s/step | us/branch token | speedup vs per_branch | "
    "peak MiB | loss rel. diff | collate s |"
)


def verdicts(work: Workload, results: dict[str, Result]) -> list[str]:
    """The issue's targets, each with its measured figure and PASS/MISS."""
    if "hf_tree" not in results:
        return []
    tree = results["hf_tree"]
    speedup = results["per_branch"].median / tree.median
    out = [
        f"speedup vs per_branch {speedup:.2f}x >= 0.8 x dedup = {0.8 * work.dedup_ratio:.2f}x: "
        f"{'PASS' if speedup >= 0.8 * work.dedup_ratio else 'MISS'}",
        f"not slower than per_branch ({speedup:.2f}x >= 1): {'PASS' if speedup >= 1 else 'MISS'}",
    ]
    if "trl_packing" in results:
        trl = results["trl_packing"]
        vs_trl = trl.median / tree.median
        memory = tree.peak_bytes / trl.peak_bytes
        out += [
            f"faster than TRL packing ({vs_trl:.2f}x > 1): {'PASS' if vs_trl > 1 else 'MISS'}",
            f"peak memory vs TRL packing {memory:.2f}x <= 1.2x: {'PASS' if memory <= 1.2 else 'MISS'}",
        ]
    return out


def median_seconds(figure: dict, method: str) -> float:
    """Median step time of ``method`` in one (model, workload) figure."""
    return statistics.median(figure["methods"][method]["seconds"])


def plot_results(figures: list[dict], path: str) -> None:
    """Bars: each method's speedup over ``per_branch`` (median step time), per model and workload; a black tick
    marks the workload's dedup ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Runs may differ in methods (--with-dense, --methods); a method a run lacks gets no bar there.
    ran = {m for f in figures for m in f["methods"]}
    methods = [m for m in ("padded", "trl_packing", "hf_tree", "hf_tree_dense") if m in ran]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(figures), 4.2))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        speedups = [
            median_seconds(f, "per_branch") / median_seconds(f, method) if method in f["methods"] else math.nan
            for f in figures
        ]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(figures))]
        bars = ax.bar(xs, speedups, width, label=method)
        ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.1f}" for v in speedups], fontsize=7)
    for i, f in enumerate(figures):
        ax.plot(
            [i - 0.45, i + 0.45], [f["dedup_ratio"]] * 2, color="black", lw=1.5, label="dedup ratio" if i == 0 else None
        )
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xticks(
        range(len(figures)), [f"{f['model']}\n{f['workload']}\n(dedup {f['dedup_ratio']:.2f})" for f in figures]
    )
    ax.set_ylabel("speedup over one branch at a time")
    ax.set_title("training step time, CPU (median); higher is better")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: a smaller tiny model over token ids modulo {QUICK_VOCAB}, the smallest tree per step, "
        "one repeat",
    )
    parser.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    parser.add_argument("--workloads", default=None, help=f"comma list of {WORKLOADS} (default: per model)")
    parser.add_argument("--step-tokens", type=int, default=None, help="tree tokens per optimizer step (at least)")
    parser.add_argument("--max-packed-tokens", type=int, default=8192, help="row length of TRL and hf_tree rows")
    parser.add_argument("--batch-size", type=int, default=4, help="branches per padded micro-batch")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 3, quick 1)")
    parser.add_argument(
        "--smallest", action="store_true", help="take the smallest trees of the first ones read (slow models)"
    )
    parser.add_argument("--with-dense", action="store_true", help="also run hf_tree with the dense-mask engine")
    parser.add_argument(
        "--methods", default=None, help="comma list of methods to run (per_branch, the reference, always runs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write all figures here")
    parser.add_argument("--plot", default=None, help="write a PNG of the speedups here")
    parser.add_argument("--plot-from", nargs="+", default=None, help="only plot: --json files of earlier runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.smallest = "tiny", args.repeats or 1, True
        args.workloads = args.workloads or "groups,agent_small"
        args.step_tokens = args.step_tokens or 1
    args.repeats = args.repeats or 3
    args.step_tokens = args.step_tokens or 4096
    return args


def default_workloads(model: str) -> list[str]:
    # BFCL steps take hours per-branch with the 135M model on a 2-core CPU; it runs the shorter trajectories.
    return ["groups", "long_prompts", "agent"] if model == "tiny" else ["groups", "long_prompts", "agent_small"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.plot_from:
        figures = [f for path in args.plot_from for f in json.loads(Path(path).read_text())["results"]]
        plot_results(figures, args.plot or "train_step.png")
        return {"results": figures}
    from hf_tree.assets import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    methods = list(METHODS) + (["hf_tree_dense"] if args.with_dense else [])
    if args.methods:
        unknown = set(args.methods.split(",")) - {*METHODS, "hf_tree_dense"}
        if unknown:
            raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {[*METHODS, 'hf_tree_dense']}.")
        methods = ["per_branch", *[m for m in args.methods.split(",") if m != "per_branch"]]
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} transformers={transformers.__version__} "
        f"tree engine={select_backend(torch.device('cpu'))} repeats={args.repeats} step_tokens>={args.step_tokens} "
        f"max_packed_tokens={args.max_packed_tokens} padded batch={args.batch_size}",
        flush=True,
    )
    table, notes, figures = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)], [], []
    for model_name in args.models.split(","):
        model = load_model(model_name, len(tokenizer), args)
        names = args.workloads.split(",") if args.workloads else default_workloads(model_name)
        for name in names:
            work = make_workload(name, tokenizer, args.step_tokens, args.max_packed_tokens, smallest=args.smallest)
            if args.quick:
                work = work.remapped(QUICK_VOCAB)
            print(
                f"{model_name} / {name}: {len(work.trees)} trees, {len(work.sequences)} branches, "
                f"{work.num_branch_tokens} branch tokens, {work.num_tree_tokens} tree tokens (dedup "
                f"{work.dedup_ratio:.2f})",
                flush=True,
            )
            results = run_workload(model, work, methods, args, pad_id)
            rows = format_rows(model_name, work, results)
            table += rows
            print("\n".join([HEADER, *rows]), flush=True)
            for verdict in verdicts(work, results):
                notes.append(f"{model_name} / {name}: {verdict}")
                print("  " + verdict, flush=True)
            figures.append({
                "model": model_name, "workload": name, "trees": len(work.trees), "branches": len(work.sequences),
                "branch_tokens": work.num_branch_tokens, "tree_tokens": work.num_tree_tokens,
                "dedup_ratio": work.dedup_ratio,
                "methods": {m: {"seconds": r.seconds, "peak_bytes": r.peak_bytes, "losses": r.losses,
                                "collate_seconds": r.collate_seconds, "micro_batches": r.num_micro_batches}
                            for m, r in results.items()},
            })  # fmt: skip
        del model
    print("\n" + "\n".join(table) + "\n\n" + "\n".join(notes))
    out = {"args": vars(args), "results": figures}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot_results(figures, args.plot)
    return out


if __name__ == "__main__":
    main()
