"""Tree context parallel for sliding-window and softcapped models under accelerate's FSDP2 + CP config.

accelerate 1.15 refuses any model with a sliding-window layer at ``accelerator.prepare`` when ``cp_size > 1`` (its
ring attention drops masks); the tree trainers skip accelerate's attention hooks for the models they drive
(``hf_tree.parallel.skip_accelerate_attention_hooks``), so windowed and softcapped models reach hf_tree's exact
tree CP. One ``accelerate launch`` of this file (2 gloo ranks, ``parallelism_config_cp_size: 2``) runs:

- shard cases: a tiny Mistral (window 4) and a tiny Gemma 3 (window 3 on half its layers, attention and final
  logit softcapping) on rows deeper than the window, with shards cut inside segments (deeper than the window),
  at forks and at sibling starts: per-rank logits, the summed loss and every gradient against the same model on
  the whole batch (float64, 1e-9);
- ``TreeTrainer`` on both models (FSDP2, activation checkpointing): losses and final parameters against the same
  run in one process (the test's own process);
- the refusals that stay: accelerate's own for a windowed model prepared outside a tree trainer, and hf_tree's
  for a hybrid (its mixers named) when a tree trainer is built under CP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import VOCAB, finish_launched_worker, free_port, relative_error
from tests.test_context_parallel_distributed import (
    ACCELERATE_CONFIG as LLAMA_ACCELERATE_CONFIG,
)
from tests.test_context_parallel_distributed import (
    FLOAT64_TOLERANCE,
    _grads,
    _logits_error,
    _single_process,
    train_tree_trainer,
)
from tests.workloads import agent_row, deep_forest_rows, grpo_row, make_batch

REPO = Path(__file__).resolve().parents[1]
# The CP launch of test_context_parallel_distributed without its Llama-only wrap class (FSDP2 then wraps each model's
# _no_split_modules, e.g. MistralDecoderLayer, Gemma3DecoderLayer).
ACCELERATE_CONFIG = {
    **LLAMA_ACCELERATE_CONFIG,
    "fsdp_config": {
        k: v for k, v in LLAMA_ACCELERATE_CONFIG["fsdp_config"].items() if k != "fsdp_transformer_layer_cls_to_wrap"
    },
}
# name: (family, config overrides, the smallest window): windows smaller than the trees' depth.
MODELS = {
    "mistral": ("mistral", dict(sliding_window=4), 4),
    "gemma3": (
        "gemma3_text",
        dict(
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            head_dim=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        3,
    ),
}
# name: (model, rows, strategy, max_packed_tokens, query_block_size, chunks_per_rank)
SHARD_CASES = {
    "mistral_deep_forest_balanced": ("mistral", deep_forest_rows, "balanced", 72, 5, 8),
    "mistral_agent_naive": ("mistral", agent_row, "naive", 128, 1024, 8),
    "gemma3_grpo_balanced": ("gemma3", grpo_row, "balanced", 128, 8, 4),
    "gemma3_deep_forest_zigzag": ("gemma3", deep_forest_rows, "zigzag", 72, 1024, 8),
}
# Trainer accumulates the logged loss in float32 (tr_loss): two float32 roundings apart at most.
LOGGED_LOSS_TOLERANCE = 2 * torch.finfo(torch.float32).eps
# TreeTrainer's context_parallel_* arguments in the launch.
TRAINER_OPTIONS = {"context_parallel_strategy": "balanced", "context_parallel_query_block_size": 5}


# ----------------------------------------------------------------------------------------------- worker
def shard_cuts(kv_end: torch.Tensor, owner: torch.Tensor, window: int) -> list[str]:
    """Where the plan cuts the rows: for each position ``p`` whose token sits on another rank than ``p - 1``, per
    row, ``"segment"`` (``p`` continues ``p - 1``'s only path, at a depth beyond the window: the window spans the
    cut), ``"shallow segment"``, ``"fork"`` (``p`` is the first child of a node with several), ``"sibling"`` (``p``
    starts a later branch under a shared ancestor) or ``"tree"`` (a new tree or padding). ``kv_end [B, N]``,
    ``owner [N]`` (rank of each global position)."""
    kinds = []
    for row in kv_end.tolist():
        for p in range(1, len(row)):
            if owner[p] == owner[p - 1]:
                continue
            depth = sum(row[j] > p for j in range(p))
            if row[p - 1] > p:  # p is p-1's first child (or the next token of its segment)
                single = row[p] == row[p - 1]
                kinds.append(("segment" if depth > window else "shallow segment") if single else "fork")
            else:
                kinds.append("sibling" if depth else "tree")
    return kinds


def run_shard_case(name: str, cp) -> dict:
    import torch.distributed as dist

    from hf_tree import tree_causal_lm_loss
    from hf_tree.parallel import plan_context_parallel, shard_batch_for_context_parallel, tree_context_parallel
    from tests.helpers import max_grad_relative_error, tiny_model

    model_name, rows_fn, strategy, max_packed_tokens, block, chunks = SHARD_CASES[name]
    family, overrides, window = MODELS[model_name]
    batch = make_batch(rows_fn, max_packed_tokens)
    model = tiny_model(family, dtype=torch.float64, vocab_size=VOCAB, **overrides)
    ref_logits, ref_loss, ref_grads = _single_process(model, batch)

    plan = plan_context_parallel(batch["kv_end"], cp.size, strategy, chunks)
    local = shard_batch_for_context_parallel(batch, plan, cp.rank)
    with tree_context_parallel(batch, plan, cp.rank, cp.group, query_block_size=block):
        logits_error = _logits_error(model, local, plan, cp.rank, ref_logits)
        loss = tree_causal_lm_loss(model, local)
        loss.backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g, group=cp.group)  # the CP ranks' gradient contributions add up
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp.group)
    owner = torch.empty(plan.num_slots, dtype=torch.int64)
    for rank, ids in enumerate(plan.indices):
        owner[ids] = rank
    return {
        "logits": logits_error,
        "loss": relative_error(total, ref_loss),
        "grads": max_grad_relative_error(grads, ref_grads),
        "num_grads": len(grads),
        "cuts": shard_cuts(batch["kv_end"], owner[: plan.num_tokens], window),
        "max_depth": int(max((batch["kv_end"][0] > p).sum() for p in range(plan.num_tokens))),
    }


def accelerate_refusal(accelerator) -> str:
    """accelerate's refusal of a windowed model prepared outside a tree trainer (its ring attention would drop the
    window): kept."""
    from tests.helpers import tiny_model

    family, overrides, _ = MODELS["mistral"]
    model = tiny_model(family, dtype=torch.float64, vocab_size=VOCAB, **overrides)
    try:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    except ValueError as error:
        return str(error)
    return ""


def hybrid_refusal(output_dir: str) -> str:
    """hf_tree's refusal of a hybrid when a tree trainer is built under CP (before any step)."""
    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import exact_sgd_args, hybrid_model
    from tests.workloads import branch_groups, tree_dataset

    args = TreeTrainingArguments(**exact_sgd_args(output_dir, max_steps=1, max_packed_tokens=48))
    try:
        TreeTrainer(model=hybrid_model("qwen3_5_text"), args=args, train_dataset=tree_dataset(branch_groups(seed=5)))
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
    results = {"cp_size": cp.size}
    with float64_norms():
        for name in SHARD_CASES:
            results[name] = run_shard_case(name, cp)
    results["accelerate_refusal"] = accelerate_refusal(accelerator)
    results["hybrid_refusal"] = hybrid_refusal(str(Path(out_dir, "hybrid")))
    trainers = {}
    for name, (family, overrides, _) in MODELS.items():
        trainers[name] = train_tree_trainer(str(Path(out_dir, name)), family, overrides, TRAINER_OPTIONS)
    if accelerator.process_index == 0:
        torch.save(trainers, Path(out_dir, "trainers.pt"))
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(results))
    finish_launched_worker()


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], dict]:
    out = tmp_path_factory.mktemp("context_parallel_windowed")
    config = out / "accelerate_cp.json"
    config.write_text(json.dumps(ACCELERATE_CONFIG))
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(free_port()), __file__, str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return results, torch.load(out / "trainers.pt")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHARD_CASES))
def test_windowed_and_softcapped_shards_match_single_process(launched, name):
    results, _ = launched
    assert all(r["cp_size"] == 2 for r in results)
    for rank, r in enumerate(results):
        case = r[name]
        assert case["num_grads"] > 0
        assert case["max_depth"] > MODELS[SHARD_CASES[name][0]][2]  # the trees are deeper than the window
        for what in ("logits", "loss", "grads"):
            assert case[what] <= FLOAT64_TOLERANCE, (rank, what, case)


@pytest.mark.slow
@pytest.mark.distributed
def test_shards_cut_inside_windows_at_forks_and_at_siblings(launched):
    results, _ = launched
    cuts = {kind for name in SHARD_CASES for kind in results[0][name]["cuts"]}
    assert {"segment", "fork", "sibling"} <= cuts, cuts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_tree_trainer_under_accelerate_cp_matches_single_process(launched, name, tmp_path):
    """``TreeTrainer`` under accelerate's FSDP2 + cp_size 2 config trains the windowed/softcapped model (accelerate
    alone refuses it at ``prepare``) to the losses and parameters of the same run in one process."""
    _, trainers = launched
    family, overrides, _ = MODELS[name]
    distributed = trainers[name]
    single = train_tree_trainer(str(tmp_path), family, overrides, TRAINER_OPTIONS)
    assert distributed["cp_size"] == 2 and single["cp_size"] == 1
    assert distributed["cp_options"] == ("balanced", 5)
    assert distributed["trees_per_step"] == single["trees_per_step"]
    assert len(distributed["losses"]) == len(single["losses"]) == 2
    # Trainer logs the loss through a float32 accumulator: equal up to its rounding (the parameters, below, are
    # compared in float64).
    for got, want in zip(distributed["losses"], single["losses"]):
        assert abs(got - want) <= LOGGED_LOSS_TOLERANCE * abs(want), (distributed["losses"], single["losses"])
    assert distributed["params"].keys() == single["params"].keys()
    errors = {n: relative_error(p, single["params"][n]) for n, p in distributed["params"].items()}
    assert max(errors.values()) <= FLOAT64_TOLERANCE, errors


@pytest.mark.slow
@pytest.mark.distributed
def test_refusals_outside_tree_trainers_and_for_hybrids_stay(launched):
    results, _ = launched
    for r in results:
        assert "sliding_attention" in r["accelerate_refusal"], r["accelerate_refusal"]
        assert "torch_chunk_gated_delta_rule" in r["hybrid_refusal"], r["hybrid_refusal"]
        assert "cp_size=1" in r["hybrid_refusal"]


if __name__ == "__main__":
    worker(sys.argv[1])
