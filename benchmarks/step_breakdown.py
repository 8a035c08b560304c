"""Where one training step's time goes: tree vs per-branch, split into embedding, linear layers, attention,
other decoder ops, loss head and backward engine, on real CHAMP groups at chosen dedup ratios.

    python benchmarks/step_breakdown.py --model tiny                  # a small random Llama, real groups
    python benchmarks/step_breakdown.py --model smollm2 --repeats 3   # the real SmolLM2-135M (slow on 2 cores)
    python benchmarks/step_breakdown.py --quick                       # smoke test (tiny model, small vocab)
    python benchmarks/step_breakdown.py --model smollm2 --dtype bfloat16   # bf16 weights (GPU users' loading)
    python benchmarks/step_breakdown.py --model smollm2 --autocast         # float32 weights, CPU bf16 autocast

``--autocast`` runs every step of both methods under ``torch.autocast("cpu", torch.bfloat16)``, what TRL's
``bf16=True`` does on CPU (float32 master weights); ``--dtype bfloat16`` loads the weights in bfloat16 instead.

One group (a prompt and its 4 CHAMP answers) per step, or ``--groups-per-step`` groups packed into rows of
``--max-tree-tokens``, forward + backward only (no optimizer). ``tree``: ``TreeDataCollator``'s rows and
``tree_causal_lm_loss`` on ``tree_flash`` (the engine ``select_backend`` picks: ``cpu`` off CUDA);
``per_branch``: every branch alone with ``sdpa``, one after the other. Workload, collation and loss are
``train_step.py``'s own (imported, not copied). Groups: for each ``--targets`` ratio, the CHAMP group whose
dedup ratio is closest to it among the first ``--problems`` problems (``0-Shot`` prompts below 2, ``5-Shot``
few-shot prompts from 2 up), with at most ``--max-tree-tokens`` tree tokens.

How the split is measured (torch profiler, one profiled step per repeat, methods interleaved, medians):
forward hooks open a profiler range around the embedding, every ``nn.Linear`` of the decoder, every attention
module and the decoder; a forward op belongs to the innermost range around it (``attention`` is the attention
module without its projections: rotary, the kernel and reshapes; ``other`` is the decoder outside those ranges:
norms, activations, residuals; ``loss head`` is everything outside the decoder: the LM head and the loss).
Each backward node runs under the forward op's sequence number, so it lands in the same column. ``bwd engine``
is backward wall time outside any node. The profiler slows small ops, so ``profiled s`` exceeds the
unprofiled ``step s`` that is timed (median of the same interleaved repeats) for the speedup. Peak memory: the
allocation peak of one more step per method (``_profiling.cpu_peak_bytes``; per-branch holds one branch at a time).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step  # noqa: E402  (the workload, collation and loss of the end-to-end benchmark)
from _profiling import cpu_peak_bytes  # noqa: E402

from hf_tree.attention import select_backend, set_attention_backend  # noqa: E402

PARTS = ("embed", "linear", "attention", "other", "loss head")
RANGE = {"hf::embed": "embed", "hf::linear": "linear", "hf::attention": "attention", "hf::decoder": "other"}
METHODS = ("per_branch", "hf_tree")
BACKWARD_NODE = "autograd::engine::evaluate_function: "
TARGET_PER_R = 0.9  # the step should keep 90% of the tree's token saving, and never be slower than per-branch


def pick_groups(
    tokenizer: transformers.PreTrainedTokenizerBase,
    targets: list[float],
    problems: int,
    max_tokens: int,
    groups_per_step: int = 1,
) -> list[train_step.Workload]:
    """For each target dedup ratio, the workload of the ``groups_per_step`` groups closest to it (see the module
    docstring)."""
    pools = {}
    out = []
    for target in targets:
        kind = "groups" if target < 2 else "long_prompts"
        if kind not in pools:
            pools[kind] = [
                t
                for t in train_step._trees(kind, tokenizer, problems)
                if t.num_branches > 1 and t.num_tokens <= max_tokens
            ]
        if not pools[kind]:
            raise ValueError(
                f"--max-tree-tokens={max_tokens}: no {kind} group of the first {problems} problems fits; raise it."
            )
        if len(pools[kind]) < groups_per_step:
            raise ValueError(
                f"--groups-per-step={groups_per_step}: only {len(pools[kind])} {kind} groups of the first {problems} "
                "problems fit; raise --problems."
            )
        closest = sorted(pools[kind], key=lambda t: abs(t.num_branch_tokens / t.num_tokens - target))
        name = f"R~{target:g}" + (f", {groups_per_step} groups" if groups_per_step > 1 else "")
        out.append(train_step.Workload(name, closest[:groups_per_step]))
    return out


class Ranges:
    """Forward hooks that open a named profiler range around modules (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        decoder = model.get_decoder()
        self.handles = []
        self._watch(decoder, "hf::decoder")
        self._watch(decoder.get_input_embeddings(), "hf::embed")
        for module in decoder.modules():
            if isinstance(module, torch.nn.Linear):
                self._watch(module, "hf::linear")
            elif type(module).__name__.endswith("Attention"):
                self._watch(module, "hf::attention")

    def _watch(self, module: torch.nn.Module, name: str) -> None:
        stack = []

        def enter(*_):
            stack.append(record_function(name).__enter__())

        def leave(*_):
            stack.pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def split(events) -> dict[str, float]:
    """Seconds per ``(part, 'fwd'|'bwd')`` of one profiled step (see the module docstring)."""
    main = [e for e in events if e.name == "hf::step"][0].thread
    events = [e for e in events if e.thread == main]
    ranges = [e for e in events if e.name in RANGE]
    times: dict[str, float] = defaultdict(float)
    for name in ("hf::forward", "hf::backward"):
        times[name] = sum(e.time_range.elapsed_us() for e in events if e.name == name) / 1e6

    def innermost(e) -> str:
        inside = [r for r in ranges if _contains(r, e)]
        return RANGE[max(inside, key=lambda r: r.time_range.start).name] if inside else "loss head"

    # Forward: a range's own time is its span minus the spans of the ranges directly inside it.
    def parent(r):
        around = [o for o in ranges if o is not r and _contains(o, r)]
        return max(around, key=lambda o: o.time_range.start) if around else None

    own = {id(r): r.time_range.elapsed_us() for r in ranges}
    for r in ranges:
        p = parent(r)
        if p is not None:
            own[id(p)] -= r.time_range.elapsed_us()
    for r in ranges:
        times[(RANGE[r.name], "fwd")] += own[id(r)] / 1e6
    decoder = sum(r.time_range.elapsed_us() for r in ranges if r.name == "hf::decoder") / 1e6
    times[("loss head", "fwd")] = times["hf::forward"] - decoder
    # Backward: each top-level node in the part of the forward op with its sequence number.
    part_of = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE) and not e.name.startswith("hf::"):
            part_of.setdefault(e.sequence_nr, innermost(e))
    nodes = 0.0
    for e in events:
        if e.name.startswith(BACKWARD_NODE) and not _inside_node(e):
            seconds = e.time_range.elapsed_us() / 1e6
            times[(part_of.get(e.sequence_nr, "other"), "bwd")] += seconds
            nodes += seconds
    times[("engine", "bwd")] = times["hf::backward"] - nodes
    return times


def _contains(outer, inner) -> bool:
    return outer.time_range.start <= inner.time_range.start and inner.time_range.end <= outer.time_range.end


def _inside_node(e) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith(BACKWARD_NODE):
            return True
        parent = parent.cpu_parent
    return False


def step(method: str, model: torch.nn.Module, batches: list[dict], num_items: int, autocast: bool = False) -> None:
    """Forward + backward of every micro-batch (gradients accumulate; no optimizer), the forward under CPU bf16
    autocast if asked (as the Trainer's ``autocast_smart_context_manager``: backward outside it)."""
    with record_function("hf::step"):
        for batch in batches:
            with record_function("hf::forward"), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = train_step.micro_batch_loss(method, model, batch, num_items)
            with record_function("hf::backward"):
                loss.backward()


@dataclass
class Figures:
    seconds: list[float] = field(default_factory=list)
    parts: list[dict] = field(default_factory=list)
    peak_bytes: int = 0
    """Allocation peak of one more step above what existed before it (gradients already allocated)."""

    def median(self, key) -> float:
        return statistics.median(p.get(key, 0.0) for p in self.parts)


def measure(model: torch.nn.Module, work: train_step.Workload, args, pad_id: int) -> dict[str, Figures]:
    """Interleaved repeats of each method: one timed step, then one profiled step."""
    batches = {m: train_step.collate(m, work, args, pad_id) for m in METHODS}
    figures = {m: Figures() for m in METHODS}
    ranges = None
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for m in METHODS:
            model.set_attn_implementation("tree_flash" if m == "hf_tree" else "sdpa")
            model.zero_grad(set_to_none=False)
            start = time.perf_counter()
            step(m, model, batches[m], work.num_trained, args.autocast)
            if repeat:
                figures[m].seconds.append(time.perf_counter() - start)
            if repeat and not args.timing_only:
                model.zero_grad(set_to_none=False)
                ranges = Ranges(model)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step(m, model, batches[m], work.num_trained, args.autocast)
                ranges.remove()
                figures[m].parts.append(split(prof.events()))
    for m in METHODS if not args.timing_only else ():
        model.set_attn_implementation("tree_flash" if m == "hf_tree" else "sdpa")
        model.zero_grad(set_to_none=False)
        figures[m].peak_bytes = cpu_peak_bytes(
            functools.partial(step, m, model, batches[m], work.num_trained, args.autocast)
        )
    set_attention_backend(None)
    return figures


def report(work: train_step.Workload, figures: dict[str, Figures]) -> list[str]:
    """The group's speedup line, the per-part table of the profiled steps (unless ``--timing-only``) and the verdict."""
    base, tree = figures["per_branch"], figures["hf_tree"]
    speedup = statistics.median(base.seconds) / statistics.median(tree.seconds)
    lines = [
        f"{work.name}: dedup {work.dedup_ratio:.2f}, {work.num_tree_tokens} tree / {work.num_branch_tokens} branch "
        f"tokens, {len(work.sequences)} branches; step s per_branch {statistics.median(base.seconds):.3f}, "
        f"tree {statistics.median(tree.seconds):.3f}: speedup {speedup:.2f}x = {speedup / work.dedup_ratio:.2f} R; "
        f"step s per repeat per_branch {_seconds(base.seconds)}, tree {_seconds(tree.seconds)} (speedups "
        f"{_seconds([b / t for b, t in zip(base.seconds, tree.seconds, strict=True)])}: under load, the median of "
        "these interleaved pairs is steadier than the ratio of medians)"
    ]
    if base.parts:
        lines += _part_rows(work, base, tree)
    met = speedup >= TARGET_PER_R * work.dedup_ratio and speedup >= 1.0
    lines.append(
        f"target (issue 16): speedup >= {TARGET_PER_R} R = {TARGET_PER_R * work.dedup_ratio:.2f}x and >= 1.0x: "
        f"{'PASS' if met else 'MISS'}"
    )
    return lines


def _seconds(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _part_rows(work: train_step.Workload, base: Figures, tree: Figures) -> list[str]:
    """The peak memory line and the per-part table of the profiled steps."""
    figures = {"per_branch": base, "hf_tree": tree}
    lines = [
        f"peak MiB per_branch {base.peak_bytes / 2**20:.0f}, tree {tree.peak_bytes / 2**20:.0f}",
        "| part | pass | per_branch s | share | tree s | share | tree / per_branch | per_branch / tree / R |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total = {m: f.median("hf::forward") + f.median("hf::backward") for m, f in figures.items()}
    for part in (*PARTS, "engine"):
        for direction in ("fwd", "bwd"):
            key = (part, direction)
            if part == "engine" and direction == "fwd":
                continue
            b, t = base.median(key), tree.median(key)
            ratio = f"{t / b:.2f}" if b > 0 else "-"
            vs_r = f"{b / t / work.dedup_ratio:.2f}" if t > 0 else "-"
            lines.append(
                f"| {part} | {direction} | {b:.3f} | {b / total['per_branch']:.0%} | {t:.3f} | "
                f"{t / total['hf_tree']:.0%} | {ratio} | {vs_r} |"
            )
    b, t = total["per_branch"], total["hf_tree"]
    vs_r = b / t / work.dedup_ratio
    lines.append(f"| profiled total | | {b:.3f} | 100% | {t:.3f} | 100% | {t / b:.2f} | {vs_r:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    parser.add_argument("--quick", action="store_true", help="smoke test: smaller tiny model, small vocab, 1 repeat")
    parser.add_argument("--targets", default="1.1,1.2,2.5", help="comma list of dedup ratios, one group each")
    parser.add_argument("--problems", type=int, default=64, help="CHAMP problems to choose the groups from")
    parser.add_argument("--max-tree-tokens", type=int, default=4096, help="largest group (tree tokens); row length")
    parser.add_argument(
        "--groups-per-step", type=int, default=1, help="groups per step (trees packed into rows of --max-tree-tokens)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' dtype")
    parser.add_argument(
        "--autocast", action="store_true", help="forward under CPU bfloat16 autocast (TRL's bf16=True on CPU)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed + profiled repeats per method")
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="only the timed steps (speedups): no profiled step per repeat, no peak-memory step, no per-part table",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's); 1 on a busy host")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.autocast and args.dtype != "float32":
        parser.error(f"--autocast runs float32 weights under bf16 autocast; got --dtype {args.dtype}")
    if args.quick:
        args.model, args.repeats = "tiny", 1
    args.max_packed_tokens = args.max_tree_tokens  # the tree's row: one group per row (train_step's collate)
    args.batch_size = 1
    return args


def main(argv: list[str] | None = None) -> list[tuple[train_step.Workload, dict[str, Figures]]]:
    """Measure and print every group's breakdown; returns ``[(group, {method: figures})]``."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_tree.assets import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = train_step.load_model(args.model, len(tokenizer), args).to(getattr(torch, args.dtype))
    targets = [float(t) for t in args.targets.split(",")]
    works = pick_groups(tokenizer, targets, args.problems, args.max_tree_tokens, args.groups_per_step)
    if args.quick:
        works = [w.remapped(train_step.QUICK_VOCAB) for w in works]
    print(
        f"model={args.model} dtype={args.dtype} autocast={args.autocast} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} tree engine={select_backend(torch.device('cpu'))} repeats={args.repeats}",
        flush=True,
    )
    out = []
    for work in works:
        figures = measure(model, work, args, pad_id)
        print("\n".join(["", *report(work, figures)]), flush=True)
        out.append((work, figures))
    return out


if __name__ == "__main__":
    main()
