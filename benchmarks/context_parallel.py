"""Tree context parallel: memory and step time per rank at cp=1 against larger CP sizes, and the work balance of the
shard plans.

Part 1 (no model): for long packed rows (a GRPO group, an agent trajectory, a random deep tree) and several CP
sizes, the attention work balance (max / mean visible query-key pairs per rank) of each split strategy against
the naive equal-token split, and the shard length each needs (its memory).

Part 2 (tiny Llama, float32, one long row): one training step (``tree_causal_lm_loss`` forward + backward) at
cp=1 in this process and at cp=2 in two forked gloo processes, measuring on every rank

- activation memory: bytes of the distinct storages autograd saves for backward during the forward
  (parameters excluded), i.e. what a long row costs beyond the model;
- peak memory: the running total of the torch profiler's allocation events over forward + backward, above what
  was allocated before (CPU); ``torch.cuda.max_memory_allocated`` on CUDA;
- step time: a third step, not profiled.

cp=1 runs the memory-frugal "blocked" engine on CPU (the automatic ``cpu`` engine would pick the faster
``segments`` for these rows; the comparison is with the leanest whole-row engine). The target is
cp=2 activation memory per rank <= 0.6x cp=1.

Part 3 (``--models``): the same step on one long GRPO tree (16k tokens) for a tiny sliding-window Mistral
(window 256, shorter than the shared prompt) and a tiny LFM2 hybrid (short convolutions, run on the whole row
gathered from the ranks) at cp=1 and each of ``--cp`` (default 2 and 4), the ratios of the largest rank to cp=1.

    python benchmarks/context_parallel.py            # rows of 32k-128k tokens for balance, 8k for memory
    python benchmarks/context_parallel.py --models mistral lfm2 --cp 2 4   # part 3 only (16k tokens)
    python benchmarks/context_parallel.py --quick    # small sizes, seconds (smoke test; part 3 on 1k tokens)

The last line printed is a JSON summary (what tests/test_context_parallel_benchmark_smoke.py reads).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from _profiling import cpu_peak_bytes
from transformers import AutoModelForCausalLM

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention import ENGINES, attention_engine_scope
from hf_tree.parallel import STRATEGIES, plan_context_parallel, shard_batch_for_context_parallel, tree_context_parallel

VOCAB = 512


# ----------------------------------------------------------------------------------------------- long rows
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def grpo_tree(num_tokens: int, rng: random.Random) -> Tree:
    """A prompt of a quarter of the row and 16 completions sharing it."""
    prompt = _tokens(rng, num_tokens // 4)
    length = (num_tokens - len(prompt)) // 16
    sequences = [prompt + _tokens(rng, length) for _ in range(16)]
    return Tree.from_sequences(sequences, [[0] * len(prompt) + [1] * length for _ in sequences])


def agent_tree(num_tokens: int, rng: random.Random) -> Tree:
    """Eight turns; each turn forks the (reasoning-stripped) history into reasoning + answer (trained), and
    the history continues with the answer and the next user message."""
    per_turn = num_tokens // 8
    history = _tokens(rng, per_turn // 4)
    sequences, masks = [], []
    for _ in range(8):
        reasoning, answer = _tokens(rng, per_turn // 2), _tokens(rng, per_turn // 8)
        sequences.append(history + reasoning + answer)
        masks.append([0] * len(history) + [1] * (len(reasoning) + len(answer)))
        history = history + answer + _tokens(rng, per_turn // 8)
    return Tree.from_sequences(sequences, masks)


def deep_tree(num_tokens: int, rng: random.Random) -> Tree:
    """Random branches, each extending a random prefix of an earlier one: deep, irregular sharing."""
    sequences = [_tokens(rng, max(2, num_tokens // 16))]
    size = len(sequences[0])  # random tails are new tokens of the trie (with overwhelming probability)
    while True:
        base = rng.choice(sequences)
        tail = _tokens(rng, rng.randint(1, max(2, num_tokens // 24)))
        if size + len(tail) > num_tokens:
            return Tree.from_sequences(sequences)
        sequences.append(base[: rng.randint(1, len(base))] + tail)
        size += len(tail)


ROWS = {"grpo": grpo_tree, "agent": agent_tree, "deep": deep_tree}


def row_batch(tree: Tree) -> dict[str, torch.Tensor]:
    batch = TreeDataCollator(max_packed_tokens=tree.num_tokens)([tree])
    return {
        k: batch[k]
        for k in (
            "input_ids",
            "position_ids",
            "kv_end",
            "loss_positions",
            "loss_targets",
            "loss_weights",
            "num_loss_items",
        )
    }


# ----------------------------------------------------------------------------------------------- part 1
def balance_table(num_tokens: list[int], cp_sizes: list[int]) -> list[dict]:
    rows = []
    for name, make in ROWS.items():
        for n in num_tokens:
            kv_end = row_batch(make(n, random.Random(0)))["kv_end"]
            for cp_size in cp_sizes:
                plans = {s: plan_context_parallel(kv_end, cp_size, s) for s in STRATEGIES}
                rows.append(
                    {
                        "row": name,
                        "num_tokens": kv_end.shape[1],
                        "cp_size": cp_size,
                        **{f"{s}_balance": plans[s].work_balance for s in STRATEGIES},
                        **{f"{s}_shard_len": plans[s].shard_len for s in STRATEGIES},
                    }
                )
    print("\n== work balance: max / mean visible query-key pairs per rank (1.00 = perfect); shard length in tokens")
    print(
        f"{'row':6} {'tokens':>7} {'cp':>3} | "
        + " ".join(f"{s:>10}" for s in STRATEGIES)
        + " | "
        + " ".join(f"{'L ' + s:>12}" for s in STRATEGIES)
    )
    for r in rows:
        print(
            f"{r['row']:6} {r['num_tokens']:>7} {r['cp_size']:>3} | "
            + " ".join(f"{r[s + '_balance']:>10.3f}" for s in STRATEGIES)
            + " | "
            + " ".join(f"{r[s + '_shard_len']:>12}" for s in STRATEGIES)
        )
    return rows


# ----------------------------------------------------------------------------------------------- part 2
# Part 2 and 3 models: 4 layers, hidden 128, 8 query and 2 key/value heads; family and its own settings.
MODELS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 256}),  # every layer windowed, shorter than the trees' depth
    "lfm2": (  # short convolutions on 3 layers of 4
        "lfm2",
        {
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_L_cache": 3,
            "block_auto_adjust_ff_dim": False,
        },
    ),
}


def tiny_model(name: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    family, settings = MODELS[name]
    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        **settings,
    )
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flash")


def activation_bytes(model: torch.nn.Module, step) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``step()``'s forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(saved.values())


def peak_bytes(step) -> int:
    """Peak of torch's running allocation total over forward + backward (CPU profiler; CUDA allocator stats)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return cpu_peak_bytes(lambda: step().backward())


def step_seconds(step) -> float:
    """Wall time of one forward + backward (not profiled)."""
    start = time.perf_counter()
    step().backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(rank: int, cp_size: int, tree: Tree, out: Path, port: int, model_name: str = "llama") -> None:
    """One rank's activation and peak memory and step time for one training step on ``tree`` (cp=1: the whole
    row)."""
    group = None
    if cp_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp_size)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    model = tiny_model(model_name).to(device)
    batch = {k: v.to(device) for k, v in row_batch(tree).items()}
    plan = plan_context_parallel(batch["kv_end"], cp_size)
    local = shard_batch_for_context_parallel(batch, plan, rank)

    inputs = batch if cp_size == 1 else local

    def in_context(measurement):  # a fresh CP context per step: its masks are built inside the measurement
        if cp_size == 1:
            with attention_engine_scope(ENGINES["blocked" if device.type == "cpu" else "flex"]):
                return measurement(lambda: tree_causal_lm_loss(model, inputs))
        with tree_context_parallel(batch, plan, rank, group):
            return measurement(lambda: tree_causal_lm_loss(model, inputs))

    activations = in_context(lambda step: activation_bytes(model, step))
    model.zero_grad(set_to_none=True)
    peak = in_context(peak_bytes)
    model.zero_grad(set_to_none=True)
    seconds = in_context(step_seconds)
    result = {"activations": activations, "peak": peak, "seconds": seconds}
    (out / f"cp{cp_size}_rank{rank}.json").write_text(json.dumps(result))
    if cp_size > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_row(name: str, num_tokens: int, model_name: str = "llama", cp_sizes: tuple[int, ...] = (2,)) -> dict:
    """cp=1 in this process, then each of ``cp_sizes`` in that many forked gloo processes, on the ``name`` row of
    ``num_tokens``: per CP size, each rank's figures and the largest rank's ratio to cp=1."""
    tree = ROWS[name](num_tokens, random.Random(0))
    per_cp = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        measure(0, 1, tree, out, 0, model_name)
        for cp_size in cp_sizes:
            # fork: the children reuse this process's imports (seconds, not tens of seconds); safe because main()
            # keeps torch single-threaded, so no OpenMP pool exists to be broken by the fork.
            args = (cp_size, tree, out, free_port(), model_name)
            mp.start_processes(measure, args=args, nprocs=cp_size, join=True, start_method="fork")
        for cp_size in (1, *cp_sizes):
            ranks = [json.loads((out / f"cp{cp_size}_rank{r}.json").read_text()) for r in range(cp_size)]
            per_cp[cp_size] = {key: [r[key] for r in ranks] for key in ("activations", "peak", "seconds")}
    for figures in per_cp.values():
        for key in ("activations", "peak", "seconds"):
            figures[f"{key}_ratio"] = max(figures[key]) / per_cp[1][key][0]
    return {"row": name, "model": model_name, "num_tokens": tree.num_tokens, "cp": per_cp}


def print_memory(title: str, results: list[dict]) -> None:
    print(f"\n== memory per rank and step time, {title}: MiB (activations, peak), s; ratio: the largest rank / cp=1")
    print(
        f"{'model':8} {'row':6} {'tokens':>7} {'cp':>3} | {'activations':>28} {'ratio':>6} | {'peak':>28} {'ratio':>6} "
        f"| {'step':>24} {'ratio':>6}"
    )
    mib = 1 << 20
    for r in results:
        for cp_size, f in r["cp"].items():
            act = "/".join(f"{b / mib:.1f}" for b in f["activations"])
            peak = "/".join(f"{b / mib:.1f}" for b in f["peak"])
            step = "/".join(f"{t:.2f}" for t in f["seconds"])
            print(
                f"{r['model']:8} {r['row']:6} {r['num_tokens']:>7} {cp_size:>3} | {act:>28} "
                f"{f['activations_ratio']:>6.2f} | {peak:>28} {f['peak_ratio']:>6.2f} | {step:>24} "
                f"{f['seconds_ratio']:>6.2f}"
            )
    print("target: activation ratio at cp=2 (the largest rank / cp=1) <= 0.60")


def memory_table(num_tokens: int, rows: list[str]) -> list[dict]:
    results = [memory_row(name, num_tokens) for name in rows]
    print_memory("one training step of a tiny Llama (4 layers, hidden 128), float32", results)
    return results


def models_table(num_tokens: int, models: list[str], cp_sizes: tuple[int, ...]) -> list[dict]:
    """Part 3: one GRPO tree of ``num_tokens`` on each of ``models`` (windowed, hybrid) at cp=1 and ``cp_sizes``."""
    results = []
    for model in models:  # each row printed as soon as it is measured
        results.append(memory_row("grpo", num_tokens, model, cp_sizes))
        print_memory(f"one training step on one long tree, {model}, float32", results[-1:])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument(
        "--models", nargs="*", choices=["mistral", "lfm2"], help="part 3 only, on these models (default: both)"
    )
    parser.add_argument("--tokens", type=int, default=16384, help="part 3: tokens of the tree")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="part 3: CP sizes measured beside cp=1")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: keeps fork safe and the CP sizes' times comparable
    if args.models is not None:
        print(json.dumps({"models": models_table(args.tokens, args.models or ["mistral", "lfm2"], tuple(args.cp))}))
        return
    balance_tokens = [2048] if args.quick else [32768, 131072]
    cp_sizes = [2, 4] if args.quick else [2, 4, 8]
    memory_tokens = 1024 if args.quick else 8192
    balance = balance_table(balance_tokens, cp_sizes)
    memory = memory_table(memory_tokens, ["agent", "grpo"] if not args.quick else ["agent"])
    models = models_table(1024, ["mistral", "lfm2"], (2, 4)) if args.quick else []
    print(json.dumps({"balance": balance, "memory": memory, "models": models}))


if __name__ == "__main__":
    main()
