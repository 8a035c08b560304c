"""Tree context parallel on 2 CPU processes (gloo) equals the single-process run.

One ``accelerate launch`` of this file (FSDP2 config, ``parallelism_config_cp_size: 2``) runs every case on
both ranks and writes the measured errors; the tests read them. The cp=1 oracle is the same model on the
whole batch in the same process (itself checked against per-branch training in test_loss_equivalence.py):
per-rank logits, the loss summed over ranks and every parameter gradient (summed over ranks, or reduced by
FSDP2) must match it: float64 to 1e-9 relative (RMSNorm kept in float64), float32 to 1e-5.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.context_parallel_harness import (
    ACCELERATE_CONFIG,
    FLOAT32_TOLERANCE,
    FLOAT64_TOLERANCE,
    REPO,
    full_grads,
    sharded_step,
    single_process,
    train_tree_trainer,
)
from tests.helpers import VOCAB, finish_launched_worker, free_port
from tests.workloads import agent_row, deep_forest_rows, grpo_row, make_batch

CASES = {
    "grpo_llama_f64_balanced": (grpo_row, "llama", torch.float64, "balanced", 128, 8),
    "agent_qwen3_f64_zigzag": (agent_row, "qwen3", torch.float64, "zigzag", 128, 1024),
    "deep_forest_llama_f64_contiguous": (deep_forest_rows, "llama", torch.float64, "contiguous", 72, 5),
    "deep_forest_qwen3_f64_balanced": (deep_forest_rows, "qwen3", torch.float64, "balanced", 72, 1024),
    "agent_llama_f32_balanced": (agent_row, "llama", torch.float32, "balanced", 128, 7),
    "three_tokens_llama_f64_naive": (lambda: [([[5, 6, 7]], None)], "llama", torch.float64, "naive", 16, 1024),
}
FSDP_CASE = "fsdp2_grpo_llama_f64_balanced"


# ----------------------------------------------------------------------------------------------- worker
def run_case(name: str, cp) -> dict:
    from hf_tree.parallel import plan_context_parallel
    from tests.helpers import max_grad_relative_error, relative_error, tiny_model

    rows_fn, family, dtype, strategy, max_packed_tokens, block = CASES[name]
    batch = make_batch(rows_fn, max_packed_tokens)
    model = tiny_model(family, dtype=dtype, vocab_size=VOCAB)
    ref_logits, ref_loss, ref_grads = single_process(model, batch)

    plan = plan_context_parallel(batch["kv_end"], cp.size, strategy)
    local, logits_err, total, grads = sharded_step(model, batch, plan, cp, block, ref_logits)
    return {
        "logits": logits_err,
        "loss": relative_error(total, ref_loss),
        "grads": max_grad_relative_error(grads, ref_grads),
        "num_grads": len(grads),
        "shape": list(batch["input_ids"].shape),
        "local_edges": int(local["loss_positions"].numel()),
        "report": plan.report(),
        "tolerance": FLOAT64_TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE,
    }


def run_fsdp_case(accelerator, cp) -> dict:
    """FSDP2 over accelerate's ``dp_shard_cp`` mesh with activation checkpointing, the CP group from its ``cp``
    mesh, as a trainer runs it."""
    from hf_tree import tree_causal_lm_loss
    from tests.helpers import max_grad_relative_error, relative_error, tiny_model

    batch = make_batch(grpo_row, 128)
    model = tiny_model("llama", dtype=torch.float64, vocab_size=VOCAB)
    ref_logits, ref_loss, ref_grads = single_process(copy.deepcopy(model), batch)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    factory, local = cp.prepare(batch)
    with factory():
        loss = tree_causal_lm_loss(model, local)
        # FSDP2 averages gradients over the dp_shard_cp ranks; the CP parts must add up: scale by the
        # number of processes, as TreeTrainer does for data parallelism.
        accelerator.backward(loss * accelerator.num_processes)
    grads = full_grads(model)
    total = accelerator.reduce(loss.detach(), reduction="sum")
    return {
        "loss": relative_error(total, ref_loss),
        "grads": max_grad_relative_error(grads, ref_grads),
        "num_grads": len(grads),
        "tolerance": FLOAT64_TOLERANCE,
        "sharded": type(model).__name__,
        "checkpointed": sum("checkpoint" in type(m).__name__.lower() for m in model.modules()),
        "refusal": _accelerate_context_parallel_refusal(accelerator, model, batch),
    }


def _accelerate_context_parallel_refusal(accelerator, model, batch) -> str:
    """accelerate's own context parallel (torch ring attention, causal only) around a tree forward must raise."""
    buffers = [batch[k].clone() for k in ("input_ids", "position_ids", "kv_end")]
    try:
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1]):
            model(input_ids=buffers[0], position_ids=buffers[1], kv_end=buffers[2])
    except ValueError as error:
        return str(error)
    return ""


def worker(out_dir: str) -> None:
    from accelerate import Accelerator

    from hf_tree.distributed import enable_fsdp2_on_cpu
    from hf_tree.parallel import TreeContextParallel
    from tests.helpers import float64_norms

    enable_fsdp2_on_cpu()
    accelerator = Accelerator()
    cp = TreeContextParallel.from_accelerator(accelerator)
    results = {"distributed_type": str(accelerator.distributed_type), "cp_size": cp.size}
    with float64_norms():
        for name in CASES:
            results[name] = run_case(name, cp)
        results[FSDP_CASE] = run_fsdp_case(accelerator, cp)
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(results))


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("context_parallel")
    config = out / "accelerate_cp.json"
    config.write_text(json.dumps(ACCELERATE_CONFIG))
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        __file__,
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.distributed
def test_launch_uses_fsdp2_and_a_cp_group_of_two(results):
    assert all(r["distributed_type"] == "DistributedType.FSDP" and r["cp_size"] == 2 for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matchessingle_process(results, name):
    for rank, r in enumerate(results):
        case = r[name]
        assert case["num_grads"] > 0
        assert case["logits"] <= case["tolerance"], (rank, case)
        assert case["loss"] <= case["tolerance"], (rank, case)
        assert case["grads"] <= case["tolerance"], (rank, case)


@pytest.mark.distributed
def test_cases_cover_padding_odd_lengths_and_a_rank_without_loss_edges(results):
    shapes = {name: results[0][name]["shape"] for name in CASES}
    assert shapes["deep_forest_llama_f64_contiguous"][0] == 2  # two packed rows, the shorter one padded
    assert shapes["grpo_llama_f64_balanced"][1] % 2 == 1  # odd: the shards get a padding slot
    assert results[0]["grpo_llama_f64_balanced"]["report"]["num_padding_slots"] > 0
    # Three tokens, naive split: rank 1 holds the last token and a padding slot, predicts nothing, and runs
    # backward through one zero-weight edge.
    assert [r["three_tokens_llama_f64_naive"]["local_edges"] for r in results] == [2, 1]


@pytest.mark.distributed
def test_fsdp2_context_parallel_matchessingle_process(results):
    for rank, r in enumerate(results):
        case = r[FSDP_CASE]
        assert case["sharded"].startswith("FSDP") and case["checkpointed"] > 0, case
        assert case["loss"] <= case["tolerance"], (rank, case)
        assert case["grads"] <= case["tolerance"], (rank, case)


@pytest.mark.distributed
def test_accelerate_own_context_parallel_is_refused(results):
    for r in results:
        assert "accelerate's context parallel" in r[FSDP_CASE]["refusal"]


@pytest.mark.distributed
def test_tree_trainer_with_context_parallel_matchessingle_process(tmp_path):
    """``TreeTrainer`` under the FSDP2 + cp_size 2 launch (both ranks see the same batches, each trains its
    shard, cut as its ``context_parallel_*`` arguments say) gives the losses and parameters of the same run in one
    process."""
    from tests.helpers import relative_error, tiny_model

    config = tmp_path / "accelerate_cp.json"
    config.write_text(json.dumps(ACCELERATE_CONFIG))
    report = tmp_path / "report.pt"
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(free_port()), __file__, "--trainer", str(tmp_path / "cp"), str(report)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    distributed = torch.load(report)
    single = train_tree_trainer(str(tmp_path / "single"))

    assert distributed["cp_size"] == 2 and single["cp_size"] == 1
    assert distributed["cp_options"] == ("zigzag", 5)  # the context_parallel_* arguments reached the sharding
    assert len(distributed["losses"]) == len(single["losses"]) == 2
    # the step sums count each tree once, not once per CP rank
    assert distributed["trees_per_step"] == single["trees_per_step"]
    for got, want in zip(distributed["losses"], single["losses"]):
        assert abs(got - want) <= FLOAT64_TOLERANCE * abs(want), (distributed["losses"], single["losses"])
    assert distributed["params"].keys() == single["params"].keys()
    errors = {n: relative_error(p, single["params"][n]) for n, p in distributed["params"].items()}
    assert max(errors.values()) <= FLOAT64_TOLERANCE, errors
    initial = dict(tiny_model("llama", dtype=torch.float64, vocab_size=VOCAB).named_parameters())
    assert all(not torch.equal(p, initial[n]) for n, p in single["params"].items())  # training moved them


if __name__ == "__main__":
    if sys.argv[1] == "--trainer":
        out = train_tree_trainer(sys.argv[2])
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(out, sys.argv[3])
        finish_launched_worker()
    else:
        worker(sys.argv[1])
