"""``hf-tree sft`` vs ``trl sft`` on tool-use conversations that share their tool schemas: step time, dedup, updates.

The two trainers the two commands run (``TreeSFTTrainer`` and TRL's ``SFTTrainer``; ``hf-tree sft`` is TRL's script with
that one swap) train the same model on the same rows with the same config: TRL's defaults (batch 8 per device, AdamW at
2e-5, every token of a ``messages`` row trained) plus ``--max_length 256`` (fast on a CPU; TRL's default is 1024),
``--bf16 false`` (float32: the updates are compared), the same seed (so the same batches: in-batch merging keeps TRL's
sampler) and a loss logged every step; both truncate a row longer than ``max_length`` to its start (TRL's
``keep_start``; ``TreeSFTConfig``'s ``overlong="truncate"`` default, counted and logged). Rounds alternate which trainer
runs first; in each run the first step is warmup and the time of every later step is the wall time between the ends of
consecutive steps (data loading and collation included).

Data: the BFCL multi-turn tasks (``bfcl-eval``, ``hf_tree.data.bfcl``) rendered with their tool schemas by TRL's
``qwen3.jinja`` (the schemas sit in the system turn; tasks with the same API classes share them). A row keeps its first
``max_length`` tokens (TRL's truncation), at 256 or 1024 mostly schemas: ``--max_length None`` trains whole rows
(~4-7k tokens). Model: a random Llama (``--hidden_size``, 2 layers) with SmolLM2's real tokenizer, fast on a CPU, or
``--model smollm2`` (SmolLM2-135M-Instruct, ``hf_tree.assets``).

Printed: the logged ``dedup_ratio`` (median over the tree runs' steps), the median step times, the step-time ratio
(TRL / tree), ratio / dedup (how much of the dedup the step time turns into speed; the target is >= 0.9), and the
largest per-parameter relative difference of the two runs' updates after the same steps (float32 rounding). AdamW
divides each gradient element by its own running scale, so an element whose gradient is near 0 turns float32 rounding
into a visible difference (~1e-4) and a scale error would not show at all: ``--optim sgd`` gives the strict check
(< 1e-4 is float32 rounding there; a missing or misweighted token moves updates by > 1e-3).

    python benchmarks/sft_vs_trl.py                       # ~5 min on a loaded 2-core CPU
    python benchmarks/sft_vs_trl.py --max_length 1024     # TRL's default length (a TRL step: ~1.5 min at load 20)
    python benchmarks/sft_vs_trl.py --model smollm2 --steps 6 --rounds 3 --max_length None  # a GPU
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import transformers
import trl
from trl import SFTConfig, SFTTrainer

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tests.helpers imports from the repository
    sys.path.insert(0, str(REPO))

from hf_tree.assets import load_smollm2_tokenizer, smollm2_checkpoint  # noqa: E402
from hf_tree.data.bfcl import bfcl_multi_turn_dataset  # noqa: E402
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402

QWEN3_TEMPLATE = pathlib.Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
# Parameters whose update is below this fraction of the largest update norm are measured against that floor (as in
# benchmarks/trl_parity.py): their float32 rounding noise would otherwise read as a large relative difference.
UPDATE_FLOOR = 1e-3
TRAINERS = {"trl": (SFTTrainer, SFTConfig), "tree": (TreeSFTTrainer, TreeSFTConfig)}


class StepClock(transformers.TrainerCallback):
    """Wall time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def write_model(folder: pathlib.Path, model: str, hidden_size: int) -> str:
    """The model folder both trainers load, with SmolLM2's tokenizer and TRL's Qwen3 template (it renders tools)."""
    if model == "smollm2":
        source = smollm2_checkpoint()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    else:
        tokenizer = load_smollm2_tokenizer()
        loaded = tiny_model(
            "llama",
            dtype=torch.float32,
            attn="sdpa",
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            max_position_embeddings=8192,
        )
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    loaded.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return str(folder / "model")


def run(kind: str, model_path: str, dataset, options: dict, output_dir: str):
    """One training run; returns (seconds per step after the first, logged dedup ratios, parameter updates)."""
    trainer_cls, config_cls = TRAINERS[kind]
    args = config_cls(output_dir=output_dir, **options)
    trainer = trainer_cls(model=model_path, args=args, train_dataset=dataset)
    clock = StepClock()
    trainer.add_callback(clock)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    dedup = [log["dedup_ratio"] for log in trainer.state.log_history if "dedup_ratio" in log]
    updates = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return steps, dedup, updates


def max_update_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    floor = UPDATE_FLOOR * max(float(u.norm()) for u in a.values())
    return max(float((a[n] - b[n]).norm()) / max(float(a[n].norm()), floor) for n in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--hidden_size", type=int, default=64, help="the tiny Llama's width")
    parser.add_argument("--tasks", type=int, default=32, help="BFCL 'base' tasks (rows) to load, of 200")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is warmup)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each trainer, alternating which goes first")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="TRL's default: 8")
    parser.add_argument("--max_length", default="256", help="TRL's default: 1024; 'None' keeps whole rows")
    parser.add_argument("--seed", type=int, default=42, help="TRL's default: 42")
    parser.add_argument("--optim", default=None, help="e.g. 'sgd' (TRL's default AdamW when not given)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warmup)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    dataset, _ = bfcl_multi_turn_dataset("base", args.tasks)
    dataset = dataset.remove_columns("id")
    options = dict(
        per_device_train_batch_size=args.per_device_train_batch_size,
        max_length=None if args.max_length == "None" else int(args.max_length),
        seed=args.seed,
        max_steps=args.steps,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    if args.optim is not None:
        options["optim"] = args.optim
    times: dict[str, list[float]] = {"trl": [], "tree": []}
    dedups: list[float] = []
    differences: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        model_path = write_model(pathlib.Path(folder), args.model, args.hidden_size)
        for round_ in range(args.rounds):
            updates = {}
            for kind in ("trl", "tree") if round_ % 2 == 0 else ("tree", "trl"):
                steps, dedup, updates[kind] = run(kind, model_path, dataset, options, f"{folder}/{kind}{round_}")
                times[kind] += steps
                dedups += dedup
            differences.append(max_update_difference(updates["trl"], updates["tree"]))

    trl_time, tree_time = statistics.median(times["trl"]), statistics.median(times["tree"])
    dedup = statistics.median(dedups)
    ratio = trl_time / tree_time
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"# hf-tree sft vs trl sft: BFCL base ({len(dataset)} tasks, tool schemas), model {args.model}, "
        f"batch {args.per_device_train_batch_size}, max_length {args.max_length}, {args.rounds} rounds x "
        f"{args.steps} steps, {device}"
    )
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"trl step seconds (median of {len(times['trl'])}): {trl_time:.3f}")
    print(f"tree step seconds (median of {len(times['tree'])}): {tree_time:.3f}")
    print(f"dedup ratio (logged, median of {len(dedups)} steps): {dedup:.2f}")
    print(f"step-time ratio (trl / tree): {ratio:.2f}")
    print(f"ratio / dedup: {ratio / dedup:.2f}")
    print(f"max relative update difference: {max(differences):.1e}")


if __name__ == "__main__":
    main()
