"""Tree training speed on a ~1B model against TRL's padded batch and a padding-free varlen baseline, with targets.

    python benchmarks/gpu_speed.py                          # one CUDA GPU, ~3 minutes
    python benchmarks/gpu_speed.py --json speed.json --tree-engine cuda,flex
    python benchmarks/gpu_speed.py --device cpu --quick     # this script's structure on CPU with tiny shapes

Model: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32/8 heads of 64, vocabulary 128256, tied embeddings), random
weights, bfloat16. One step is the forward and backward of the workload's loss (summed weighted cross-entropy of the
trained tokens over their count); the median of ``--repeats`` after a warm-up round (compilation, autotuning).

Workloads (random token ids; prompts untrained, completions trained):

- ``GRPO group``: a 1024-token prompt and 8 completions of 128, 256, ..., 1024 tokens;
- ``shared system prompt``: 16 conversations of 150-450 tokens after one 600-token system prompt;
- ``little sharing``: 4 answers of 1450-2022 tokens to one 371-token prompt (dedup ~1.15);
- ``no sharing``: 8 distinct rows of 1024 tokens.

Methods (every branch's tokens trained the same way, so each computes the same loss):

- ``padded``: TRL's padded batch, one row per branch, right-padded, ``attn_implementation="sdpa"``, logits of
  every position (as TRL's trainers compute them);
- ``padding_free``: every branch concatenated into one row with restarting position ids, attention by sequence
  (TRL's ``padding_free=True``): flash-attn's varlen kernel where installed, else PyTorch's
  ``torch.nn.attention.varlen.varlen_attn`` (both registered here as transformers attention functions; on CPU, SDPA
  sequence by sequence);
- ``tree[ENGINE]``: hf_tree's packed tree (``tree_causal_lm_loss``) on each engine of ``--tree-engine``
  (``hf_tree.attention.set_attention_backend``; any name of ``hf_tree.attention.ENGINES``, ``cuda`` = automatic).

Per method: median time, peak memory allocated during the step (CUDA) and MFU = 6 x parameters (embedding excluded
unless tied to the head) x tokens the method computes (padding excluded) / time / the measured bfloat16 matmul peak.
``R`` = the branches' tokens / the tree's tokens (what deduplication saves). Targets (issue 49), printed beside the
figures: no sharing >= 1.0x padded; GRPO group >= 2.6x padded; little sharing >= 1.2x padded; every row tree vs
padding-free >= 0.95 x R; tree MFU >= 45% on the GRPO group; tree peak memory <= padded on every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_tree
import hf_tree  # noqa: E402, F401  (registers tree_flash)
from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss  # noqa: E402
from hf_tree.attention import ENGINES, set_attention_backend  # noqa: E402
from hf_tree.attention.flash import flash_attn_varlen_func  # noqa: E402

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
QUICK_MODEL = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
QUICK_MODEL.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
VARLEN_ATTENTION = "hf_tree_bench_varlen"
MFU_TARGET = 0.45


@dataclass
class Workload:
    name: str
    trees: list[Tree]
    speedup_target: float | None
    """Least tree speed-up over ``padded`` (issue 49), or ``None``."""
    mfu_target: float | None = None

    @property
    def tree_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trees)

    @property
    def branch_tokens(self) -> int:
        return sum(t.num_branch_tokens for t in self.trees)

    @property
    def padded_tokens(self) -> int:
        lengths = [len(t.branch_tokens(b)) for t in self.trees for b in range(t.num_branches)]
        return len(lengths) * max(lengths)


def _prompt_tree(rng: random.Random, vocab: int, prompt: int, completions: list[int]) -> Tree:
    tokens = [rng.randrange(3, vocab) for _ in range(prompt)]
    branches = [tokens + [rng.randrange(3, vocab) for _ in range(n)] for n in completions]
    return Tree.from_sequences(branches, [[0] * prompt + [1] * n for n in completions])


def workloads(vocab: int, quick: bool) -> list[Workload]:
    """The four workloads (``quick``: every length divided by 32)."""
    rng, scale = random.Random(0), 32 if quick else 1

    def n(tokens: int) -> int:
        return max(2, tokens // scale)

    conversations = [n(rng.randrange(150, 451)) for _ in range(16)]
    return [
        Workload("GRPO group", [_prompt_tree(rng, vocab, n(1024), [n(128 * i) for i in range(1, 9)])], 2.6, MFU_TARGET),
        Workload("shared system prompt", [_prompt_tree(rng, vocab, n(600), conversations)], None),
        Workload("little sharing", [_prompt_tree(rng, vocab, n(371), [n(x) for x in (1450, 1700, 1876, 2022)])], 1.2),
        Workload("no sharing", [_prompt_tree(rng, vocab, 1, [n(1024) - 1]) for _ in range(8)], 1.0),
    ]


# ------------------------------------------------------------------------------------------ padding-free attention
def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function for padding-free rows (``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]``
    -> ``[1, T, H, D]``): causal attention within each sequence of ``cu_seq_lens_q`` (passed as model kwargs)."""
    cu, max_length = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if query.is_cuda and flash_attn_varlen_func() is not None:
        out = flash_attn_varlen_func()(q, k, v, cu, cu, max_length, max_length, softmax_scale=scaling, causal=True)
    elif query.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, cu, cu, max_length, max_length, scale=scaling, window_size=(-1, 0), enable_gqa=True)
    else:  # CPU (this script's smoke run): SDPA sequence by sequence
        bounds = cu.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scaling, enable_gqa=True
                ).transpose(0, 1)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        )
    return out[None], None


def register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, lambda *args, **kwargs: None)  # sequences come as cu_seq_lens


# ---------------------------------------------------------------------------------------------------- methods
Step = Callable[[torch.nn.Module], None]


@contextlib.contextmanager
def attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """``model`` on attention implementation ``name`` for the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def branches(workload: Workload) -> list[tuple[list[int], list[int]]]:
    """Each branch's tokens and 0/1 train mask of its tokens (``mask[0]`` unused)."""
    return [(t.branch_tokens(b), t.branch_loss_mask(b)) for t in workload.trees for b in range(t.num_branches)]


def methods(workload: Workload, device: torch.device, engines: list[str]) -> dict[str, tuple[Step, int]]:
    """Name -> (one forward + backward of the workload's loss, tokens the method computes)."""
    rows = branches(workload)
    divisor = float(sum(sum(mask[1:]) for _, mask in rows))
    longest = max(len(ids) for ids, _ in rows)

    padded_ids = torch.tensor([ids + [0] * (longest - len(ids)) for ids, _ in rows], device=device)
    padded_mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids, _ in rows], device=device)
    padded_weights = torch.tensor(
        [mask[1:] + [0] * (longest - len(mask)) for _, mask in rows], dtype=torch.float32, device=device
    )

    def padded(model) -> None:
        with attention(model, "sdpa"):
            logits = model(input_ids=padded_ids, attention_mask=padded_mask, use_cache=False).logits[:, :-1]
            loss = F.cross_entropy(logits.float().flatten(0, 1), padded_ids[:, 1:].flatten(), reduction="none")
            (loss * padded_weights.flatten()).sum().div(divisor).backward()

    flat_ids = torch.tensor([t for ids, _ in rows for t in ids], device=device)[None]
    positions = torch.cat([torch.arange(len(ids), device=device) for ids, _ in rows])[None]
    # a row's last token predicts nothing: its target is the next row's first token, weight 0
    flat_weights = torch.tensor([w for _, mask in rows for w in mask[1:] + [0]][:-1], device=device)
    lengths = torch.tensor([0] + [len(ids) for ids, _ in rows], device=device)
    sequences = dict(
        cu_seq_lens_q=lengths.cumsum(0).to(torch.int32),
        cu_seq_lens_k=lengths.cumsum(0).to(torch.int32),
        max_length_q=longest,
        max_length_k=longest,
    )

    def padding_free(model) -> None:
        with attention(model, VARLEN_ATTENTION):
            output = model(input_ids=flat_ids, position_ids=positions, use_cache=False, **sequences)
            loss = F.cross_entropy(output.logits[0, :-1].float(), flat_ids[0, 1:], reduction="none")
            (loss * flat_weights).sum().div(divisor).backward()

    collator = TreeDataCollator(max_packed_tokens=workload.tree_tokens)
    batch = {k: v.to(device) for k, v in collator([t.to_dict() for t in workload.trees]).items()}

    def tree_step(engine: str) -> Step:
        def step(model) -> None:
            set_attention_backend(engine)
            try:
                tree_causal_lm_loss(model, batch, num_items_in_batch=divisor).backward()
            finally:
                set_attention_backend(None)

        return step

    steps = {"padded": (padded, workload.branch_tokens), "padding_free": (padding_free, workload.branch_tokens)}
    steps.update({f"tree[{engine}]": (tree_step(engine), workload.tree_tokens) for engine in engines})
    return steps


# ---------------------------------------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    milliseconds: float
    peak_gib: float | None
    """Peak memory allocated during the step (CUDA), GiB."""
    mfu: float | None
    """Fraction of the measured bfloat16 matmul peak (CUDA)."""


@dataclass
class RowResult:
    workload: str
    tree_tokens: int
    branch_tokens: int
    padded_tokens: int
    dedup: float
    """R: the branches' tokens over the tree's."""
    methods: dict[str, Measurement] = field(default_factory=dict)
    targets: list[dict] = field(default_factory=list)
    """One ``{"target", "measured", "met"}`` per target checked on this row."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(device: torch.device) -> float | None:
    """The measured bfloat16 matmul throughput (FLOP/s) of an 8192^3 product (CUDA), else ``None``."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync(device)
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ a
    sync(device)
    return 2 * 8192**3 * repeats / (time.perf_counter() - start)


def flop_parameters(model: torch.nn.Module) -> int:
    """Parameters of the model's matmuls: all but the input embedding (counted once, as the head, when tied)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return total if tied else total - embedding.numel()


def measure(model, step: Step, tokens: int, repeats: int, device: torch.device, peak: float | None) -> Measurement:
    times, memory = [], None
    for repeat in range(repeats + 1):  # the first round warms up
        model.zero_grad(set_to_none=True)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        step(model)
        sync(device)
        if repeat:
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            memory = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    seconds = statistics.median(times)
    mfu = None if peak is None else 6 * flop_parameters(model) * tokens / seconds / peak
    return Measurement(seconds * 1e3, memory, mfu)


def check_targets(row: RowResult, workload: Workload) -> None:
    """Append the issue's targets for this row, each against the best tree engine's figure."""
    trees = {name: m for name, m in row.methods.items() if name.startswith("tree[")}
    best = min(trees, key=lambda name: trees[name].milliseconds)
    tree = trees[best]
    padded, padding_free = row.methods["padded"], row.methods["padding_free"]

    def add(target: str, measured: float, least: float, unit: str = "x") -> None:
        text = f"{measured:.2f}{unit}" if unit == "x" else f"{measured:.0%}"
        row.targets.append(dict(target=f"{best} {target}", measured=text, met=measured >= least))

    if workload.speedup_target is not None:
        add(
            f"vs padded >= {workload.speedup_target}x", padded.milliseconds / tree.milliseconds, workload.speedup_target
        )
    least = 0.95 * row.dedup
    add(f"vs padding-free >= 0.95 R = {least:.2f}x", padding_free.milliseconds / tree.milliseconds, least)
    if workload.mfu_target is not None and tree.mfu is not None:
        add(f"MFU >= {workload.mfu_target:.0%}", tree.mfu, workload.mfu_target, unit="%")
    if tree.peak_gib is not None and padded.peak_gib is not None:
        met = tree.peak_gib <= padded.peak_gib
        row.targets.append(
            dict(
                target=f"{best} memory <= padded", measured=f"{tree.peak_gib:.1f} vs {padded.peak_gib:.1f} GiB", met=met
            )
        )


@functools.cache
def speed_model(device: torch.device, quick: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(QUICK_MODEL if quick else LLAMA_1B))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tree_flash", dtype=dtype)
    return model.to(device)


def run_workload(index: int, device: torch.device, quick: bool, repeats: int, engines: list[str]) -> RowResult:
    """Every method on the ``index``-th workload."""
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--tree-engine {engine!r} is unknown; choose among {sorted(ENGINES)}.")
    register_varlen_attention()
    model = speed_model(device, quick)
    workload = workloads(model.config.vocab_size, quick)[index]
    row = RowResult(
        workload.name,
        workload.tree_tokens,
        workload.branch_tokens,
        workload.padded_tokens,
        workload.branch_tokens / workload.tree_tokens,
    )
    peak = _peak(device)
    for name, (step, tokens) in methods(workload, device, engines).items():
        row.methods[name] = measure(model, step, tokens, repeats, device, peak)
    check_targets(row, workload)
    return row


@functools.cache
def _peak(device: torch.device) -> float | None:
    return matmul_peak_flops(device)


def summary(row: RowResult) -> str:
    """One line: shape, each method's figures, each target with its measurement."""
    cells = []
    for name, m in row.methods.items():
        extra = "" if m.peak_gib is None else f" {m.peak_gib:.1f} GiB"
        extra += "" if m.mfu is None else f" MFU {m.mfu:.0%}"
        cells.append(f"{name} {m.milliseconds:.1f} ms{extra}")
    targets = [f"{t['target']}: {t['measured']} {'met' if t['met'] else 'MISSED'}" for t in row.targets]
    shape = (
        f"{row.tree_tokens} tree / {row.branch_tokens} branch / {row.padded_tokens} padded tokens, R {row.dedup:.2f}"
    )
    return "; ".join([shape, ", ".join(cells), *targets])


def workload_names() -> list[str]:
    return [w.name for w in workloads(16, quick=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (a check of this script)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method after the warm-up")
    parser.add_argument(
        "--tree-engine", default="cuda", help="comma list of hf_tree.attention.ENGINES names (cpu device: 'cpu')"
    )
    parser.add_argument("--json", help="write the rows (figures and targets) to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_speed: no CUDA device (torch.cuda.is_available() is False); nothing measured.")
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    engines = ["cpu"] if device.type == "cpu" and args.tree_engine == "cuda" else args.tree_engine.split(",")
    rows = []
    for index, name in enumerate(workload_names()):
        rows.append(run_workload(index, device, args.quick, args.repeats, engines))
        print(f"{name}: {summary(rows[-1])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=1))
    missed = [f"{r.workload}: {t['target']}" for r in rows for t in r.targets if not t["met"]]
    print(f"targets missed: {missed}" if missed else "every target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
