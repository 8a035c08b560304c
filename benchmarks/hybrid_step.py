"""Hybrid-model training step: tree vs one branch at a time on a small Qwen3.5 (GatedDeltaNet + attention).

    python benchmarks/hybrid_step.py            # hidden 256, 8 layers; GRPO group (1024 + 8 x 256) and agent trees
    python benchmarks/hybrid_step.py --quick    # smoke test: a 2-layer model, short sequences, one repeat

Methods (forward + backward of the whole step, no optimizer step; both losses divided by the step's trained tokens):
- ``per_branch``: every branch alone through the same model with ``attn_implementation="sdpa"`` (the model's own
  GatedDeltaNet path, one sequence per forward).
- ``hf_tree``: the trees packed into rows (the ``TreeDataCollator``'s rows), ``tree_causal_lm_loss`` with
  ``tree_flash``; the GatedDeltaNet layers run hf_tree's tree-aware convolution and gated delta rule.

Workloads: ``grpo``: one prompt of 1024 random tokens and 8 completions of 256 (dedup R = 3.33); ``agent``: hf_tree's
synthetic agent trajectories rendered by the tree builders (SmolLM2 tokenizer, ids taken modulo the model's
vocabulary), whole trees until ``--agent-tokens`` tree tokens.

Timings: medians of ``--repeats`` interleaved repeats after one warm-up run each. Time share of a layer kind: the
forward (pre-hook to hook) plus the backward (gradient of the layer's output ready to gradient of its input ready,
tensor hooks) of every such layer, over the step time, from one extra run per method.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from train_step import Workload, collate, make_workload, micro_batch_loss

import hf_tree  # noqa: F401  (registers tree_flash, installs the tree mixers)
from hf_tree import Tree

MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,  # default Qwen3.5 pattern: 3 linear-attention layers, then a full-attention one
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=32,
    max_position_embeddings=32768,
)
QUICK_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
VOCAB = 4096


def qwen3_5(quick: bool, seed: int) -> transformers.PreTrainedModel:
    """A random float32 ``Qwen3_5ForCausalLM``."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("qwen3_5_text", vocab_size=VOCAB, **(QUICK_MODEL if quick else MODEL))
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def grpo_group(prompt: int, completions: int, length: int, seed: int) -> Workload:
    """One prompt and ``completions`` distinct completions of ``length`` random tokens; loss on completions."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (prompt,), generator=generator).tolist()
    tails = torch.randint(3, VOCAB, (completions, length), generator=generator).tolist()
    tree = Tree.from_sequences([head + t for t in tails], [[0] * prompt + [1] * length for _ in tails])
    return Workload("grpo", [tree])


def agent_trees(tree_tokens: int, max_packed_tokens: int) -> Workload:
    """Synthetic agent trajectories (hf_tree.data.synthetic_agent through hf_tree.builders), ids modulo VOCAB."""
    from hf_tree.assets import load_smollm2_tokenizer

    work = make_workload("agent_small", load_smollm2_tokenizer(), tree_tokens, max_packed_tokens, smallest=True)
    return Workload("agent", work.remapped(VOCAB).trees)


class LayerTimer:
    """Forward + backward seconds spent inside modules of the given classes (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kinds: dict[str, str]) -> None:
        self.seconds = {kind: 0.0 for kind in kinds.values()}
        self.handles = []
        for module in model.modules():
            kind = kinds.get(type(module).__name__)
            if kind is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter(kind), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave(kind)))
        self.started: dict[str, float] = {}

    def _enter(self, kind: str) -> Callable:
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if hidden is not None and hidden.requires_grad:  # its gradient is ready when the layer's backward ends
                hidden.register_hook(lambda grad: self._add(kind, "backward") or None)
            self.started[kind] = time.perf_counter()

        return hook

    def _leave(self, kind: str) -> Callable:
        def hook(module, args, output):
            self.seconds[kind] += time.perf_counter() - self.started.pop(kind)
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:  # the gradient of the output is ready when the layer's backward starts
                out.register_hook(lambda grad: self._start(kind, "backward") or None)

        return hook

    def _start(self, kind: str, phase: str) -> None:
        self.started[f"{kind}/{phase}"] = time.perf_counter()

    def _add(self, kind: str, phase: str) -> None:
        start = self.started.pop(f"{kind}/{phase}", None)
        if start is not None:
            self.seconds[kind] += time.perf_counter() - start

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


LAYER_KINDS = {"Qwen3_5GatedDeltaNet": "linear_attention", "Qwen3_5Attention": "full_attention"}


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    loss: float = 0.0
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def step(method: str, model: torch.nn.Module, batches: list[dict], num_items: int) -> float:
    """Forward + backward of every micro-batch of ``method``; the step's loss."""
    model.set_attn_implementation("tree_flash" if method == "hf_tree" else "sdpa")
    total = 0.0
    for batch in batches:
        loss = micro_batch_loss(method, model, batch, num_items)
        loss.backward()
        total += float(loss.detach())
    model.zero_grad(set_to_none=False)
    return total


def run_workload(model: torch.nn.Module, work: Workload, args: argparse.Namespace) -> dict[str, Result]:
    options = argparse.Namespace(max_packed_tokens=args.max_packed_tokens, batch_size=1)
    batches = {m: collate(m, work, options, 0) for m in ("per_branch", "hf_tree")}
    results = {m: Result() for m in batches}
    for m, result in results.items():  # warm-up (untimed), then the time shares
        result.loss = step(m, model, batches[m], work.num_trained)
        timer = LayerTimer(model, LAYER_KINDS)
        start = time.perf_counter()
        step(m, model, batches[m], work.num_trained)
        elapsed = time.perf_counter() - start
        timer.remove()
        result.shares = {kind: seconds / elapsed for kind, seconds in timer.seconds.items()}
    for _ in range(args.repeats):  # interleaved: machine load hits both methods alike
        for m, result in results.items():
            start = time.perf_counter()
            step(m, model, batches[m], work.num_trained)
            result.seconds.append(time.perf_counter() - start)
    return results


HEADER = (
    "| workload | branches | branch tokens | tree tokens | R (dedup) | method | s/step (median) | speedup | "
    "speedup / R | linear-attn share | full-attn share | loss rel. diff |"
)


def format_rows(work: Workload, results: dict[str, Result]) -> list[str]:
    base = results["per_branch"]
    rows = []
    for m, r in results.items():
        speedup = base.median / r.median
        ratio = "" if m == "per_branch" else f"{speedup / work.dedup_ratio:.2f}"
        rows.append(
            f"| {work.name} | {len(work.sequences)} | {work.num_branch_tokens} | {work.num_tree_tokens} | "
            f"{work.dedup_ratio:.2f} | {m} | {r.median:.3f} | {speedup:.2f}x | {ratio} | "
            f"{r.shares['linear_attention']:.0%} | {r.shares['full_attention']:.0%} | "
            f"{abs(r.loss - base.loss) / abs(base.loss):.1e} |"
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: small model, short sequences, 1 repeat")
    parser.add_argument("--workloads", default="grpo,agent", help="comma list of: grpo, agent")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 3, quick 1)")
    parser.add_argument("--agent-tokens", type=int, default=None, help="tree tokens of the agent workload")
    parser.add_argument("--max-packed-tokens", type=int, default=8192, help="row length of the tree rows")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a loaded shared CPU, threads spin-waiting for each other made "
        "every small op several times slower)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.agent_tokens = args.agent_tokens or (1 if args.quick else 3000)
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Result]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = qwen3_5(args.quick, args.seed)
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} transformers={transformers.__version__} "
        f"model=Qwen3_5ForCausalLM {QUICK_MODEL if args.quick else MODEL} vocab={VOCAB} float32 "
        f"repeats={args.repeats}",
        flush=True,
    )
    table, out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)], {}
    for name in args.workloads.split(","):
        if name == "grpo":
            work = grpo_group(*((64, 4, 16) if args.quick else (1024, 8, 256)), seed=args.seed)
        elif name == "agent":
            work = agent_trees(args.agent_tokens, args.max_packed_tokens)
        else:
            raise SystemExit(f"--workloads: unknown {name!r}; choose from grpo, agent.")
        print(f"{name}: {len(work.trees)} trees, {len(work.sequences)} branches, R {work.dedup_ratio:.2f}", flush=True)
        out[name] = run_workload(model, work, args)
        rows = format_rows(work, out[name])
        table += rows
        speedup = out[name]["per_branch"].median / out[name]["hf_tree"].median
        verdict = "PASS" if speedup >= 0.7 * work.dedup_ratio else "MISS"
        print("\n".join(rows) + f"\n  target speedup >= 0.7 R = {0.7 * work.dedup_ratio:.2f}x: {verdict}", flush=True)
    print("\n" + "\n".join(table))
    return out


if __name__ == "__main__":
    main()
