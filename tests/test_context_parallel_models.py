"""Tree context parallel for sliding-window, chunked, softcapped and hybrid models under accelerate's FSDP2 + CP config.

accelerate 1.15 refuses any model with a sliding-window (or linear-attention) layer at ``accelerator.prepare`` when
``cp_size > 1`` (its ring attention drops masks); the tree trainers skip accelerate's attention hooks for the models
they drive (``hf_tree.parallel.skip_accelerate_attention_hooks``), so these models reach hf_tree's exact tree CP,
whose tree mixers run on the whole row gathered from the ranks (``hf_tree.models.mixers.install``). One
``accelerate launch`` of this file (2 gloo ranks, ``parallelism_config_cp_size: 2``) runs:

- shard cases: a tiny Mistral (window 4), a tiny Gemma 3 (window 3 on half its layers, attention and final logit
  softcapping), a tiny Llama 4 (chunks of 4 depths on one layer, a NoPE layer) and tiny Qwen3.5 (GatedDeltaNet +
  conv), LFM2 (short conv) and Bamba (Mamba2 + conv) hybrids, on rows deeper than the windows and chunks, with
  shards cut inside segments (deeper than the window, inside a chunk), at forks and at sibling starts: per-rank
  logits, the summed loss and every gradient against the same model on the whole batch (float64, 1e-9);
- Llama 4's temperature tuning refused by the whole row's length, not the shard's;
- ``TreeTrainer`` on Mistral (also with LoRA), Gemma 3, Llama 4, Qwen3.5, LFM2 and Bamba (with LoRA), and TRL's
  ``TreeSFTTrainer`` on Gemma 3 and Qwen3.5 (FSDP2, activation checkpointing): losses and final parameters against
  the same run in one process (the test's own process);
- the refusal that stays: accelerate's own for a windowed model prepared outside a tree trainer.

A second launch on 4 ranks (``--shards-only``) runs the shard cases and the Llama 4 refusal again.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.context_parallel_harness import ACCELERATE_CONFIG as LLAMA_ACCELERATE_CONFIG
from tests.context_parallel_harness import (
    FLOAT64_TOLERANCE,
    sharded_step,
    single_process,
    train_tree_trainer,
)
from tests.helpers import HYBRIDS, VOCAB, finish_launched_worker, free_port, relative_error
from tests.workloads import TINY_LLAMA4, agent_row, deep_forest_rows, grpo_row, make_batch

REPO = Path(__file__).resolve().parents[1]
# The CP launch of test_context_parallel_distributed without its Llama-only wrap class (set per model: WRAP_CLASSES).
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
    # Chunked attention (Llama 4, chunks of 4 depths on layer 0; the "window" the trees must be deeper than).
    "llama4": ("llama4_text", TINY_LLAMA4, TINY_LLAMA4["attention_chunk_size"]),
    # Hybrids (no window: 0); the configs of tests/helpers.HYBRIDS.
    "qwen3_5": ("qwen3_5_text", HYBRIDS["qwen3_5_text"], 0),
    "lfm2": ("lfm2", HYBRIDS["lfm2"], 0),
    "bamba": ("bamba", HYBRIDS["bamba"], 0),
}
# The layer class FSDP2 wraps in each model TreeTrainer trains in the launch.
WRAP_CLASSES = {
    "mistral": "MistralDecoderLayer",
    "gemma3": "Gemma3DecoderLayer",
    "qwen3_5": "Qwen3_5DecoderLayer",
    "lfm2": "Lfm2DecoderLayer",
    "bamba": "BambaDecoderLayer",
    "llama4": "Llama4TextDecoderLayer",
}
# TreeTrainer runs of the launch (each costs ~10 s of two CPU processes): name -> (model, LoRA adapters).
TRAINER_RUNS = {
    "mistral": ("mistral", False),
    "gemma3": ("gemma3", False),
    "qwen3_5": ("qwen3_5", False),
    "lfm2": ("lfm2", False),
    "llama4": ("llama4", False),  # chunked layers: accelerate's hooks refuse 'chunked_attention' too
    "mistral_lora": ("mistral", True),
    "bamba_lora": ("bamba", True),  # adapters on the Mamba2 mixer's projections too (all-linear)
}
# TRL's TreeSFTTrainer runs of the launch: a windowed, softcapped model and a hybrid.
SFT_RUNS = ("gemma3", "qwen3_5")
# name: (model, rows, strategy, max_packed_tokens, query_block_size, chunks_per_rank)
SHARD_CASES = {
    "mistral_deep_forest_balanced": ("mistral", deep_forest_rows, "balanced", 72, 5, 8),
    "mistral_agent_naive": ("mistral", agent_row, "naive", 128, 1024, 8),
    "gemma3_grpo_balanced": ("gemma3", grpo_row, "balanced", 128, 8, 4),
    "gemma3_deep_forest_zigzag": ("gemma3", deep_forest_rows, "zigzag", 72, 1024, 8),
    "llama4_deep_forest_balanced": ("llama4", deep_forest_rows, "balanced", 72, 5, 8),
    "llama4_agent_naive": ("llama4", agent_row, "naive", 128, 1024, 8),
    "qwen3_5_deep_forest_balanced": ("qwen3_5", deep_forest_rows, "balanced", 72, 5, 8),
    "qwen3_5_agent_naive": ("qwen3_5", agent_row, "naive", 128, 1024, 8),
    "lfm2_grpo_balanced": ("lfm2", grpo_row, "balanced", 128, 8, 4),
    "bamba_deep_forest_zigzag": ("bamba", deep_forest_rows, "zigzag", 72, 1024, 8),
}
# Trainer accumulates the logged loss in float32 (tr_loss): two float32 roundings apart at most.
LOGGED_LOSS_TOLERANCE = 2 * torch.finfo(torch.float32).eps
# Qwen3.5 and Bamba compute exp(A_log.float()) in float32 even in a float64 model: A_log's gradient is a float32 sum
# over the tokens, added in another order when each rank sums its shard (measured 1e-8..7e-8; 1e-16 elsewhere).
FLOAT32_CAST_TOLERANCE = 1e-6
FLOAT32_CAST_PARAMETERS = ("A_log",)
# Llama 4 computes its RoPE (complex float32) and its router in float32 inside a float64 model: a hidden state that
# differs in the 16th digit (attention summed in other blocks) can round to another float32, so every gradient
# behind them sits at the float32 floor (measured up to 3.6e-8 on the agent row, 4e-16 on the deep forest; logits
# and loss stay within 1e-9).
FLOAT32_CAST_MODELS = ("llama4",)
# TreeTrainer's context_parallel_* arguments in the launch.
TRAINER_OPTIONS = {"context_parallel_strategy": "balanced", "context_parallel_query_block_size": 5}


# ----------------------------------------------------------------------------------------------- worker
@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """``float64_norms`` and ``float64_qwen3_5_norms``: no float32 norm between a model and its oracle."""
    from tests.helpers import float64_norms, float64_qwen3_5_norms

    with float64_norms(), float64_qwen3_5_norms():
        yield


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


def chunk_cuts(kv_end: torch.Tensor, owner: torch.Tensor, chunk: int) -> int:
    """How many cuts fall inside a chunk below the first: ``p`` continues ``p - 1``'s only path on another rank,
    ``depth(p)`` is not a chunk start and at least one chunk lies above (so a block starting at ``p`` must take its
    chunk's ancestors from the other rank and leave the earlier chunks out). ``kv_end [B, N]``, ``owner [N]``."""
    count, owner = 0, owner.tolist()
    for row in kv_end.tolist():
        for p in range(1, len(row)):
            depth = sum(row[j] > p for j in range(p))
            inside = owner[p] != owner[p - 1] and row[p - 1] > p and row[p] == row[p - 1]
            count += inside and depth > chunk and depth % chunk != 0
    return count


def run_shard_case(name: str, cp) -> dict:
    from hf_tree.parallel import plan_context_parallel
    from tests.helpers import max_grad_relative_error, tiny_model

    model_name, rows_fn, strategy, max_packed_tokens, block, chunks = SHARD_CASES[name]
    family, overrides, window = MODELS[model_name]
    batch = make_batch(rows_fn, max_packed_tokens)
    model = tiny_model(family, dtype=torch.float64, vocab_size=VOCAB, **overrides)
    ref_logits, ref_loss, ref_grads = single_process(model, batch)

    plan = plan_context_parallel(batch["kv_end"], cp.size, strategy, chunks)
    _, logits_err, total, grads = sharded_step(model, batch, plan, cp, block, ref_logits)
    owner = torch.empty(plan.num_slots, dtype=torch.int64)
    for rank, ids in enumerate(plan.indices):
        owner[ids] = rank
    return {
        "logits": logits_err,
        "loss": relative_error(total, ref_loss),
        "grad_errors": {n: max_grad_relative_error({n: grads[n]}, {n: ref_grads[n]}) for n in grads},
        "num_grads": len(grads),
        "cuts": shard_cuts(batch["kv_end"], owner[: plan.num_tokens], window),
        "chunk_cuts": chunk_cuts(batch["kv_end"], owner[: plan.num_tokens], window) if family == "llama4_text" else 0,
        "max_depth": max(int((row[:p] > p).sum()) for row in batch["kv_end"] for p in range(plan.num_tokens)),
    }


def llama4_temperature_refusal(cp) -> dict:
    """Llama 4's NoPE layers scale queries by packed index, which on a shard restarts at 0: a row reaching the
    config's ``floor_scale`` is refused under CP as in one process, though each shard alone is shorter."""
    from hf_tree.parallel import plan_context_parallel, shard_batch_for_context_parallel, tree_context_parallel
    from tests.helpers import tiny_model

    batch = make_batch(agent_row, 128)
    plan = plan_context_parallel(batch["kv_end"], cp.size)
    model = tiny_model("llama4_text", dtype=torch.float64, vocab_size=VOCAB, **TINY_LLAMA4, floor_scale=plan.num_tokens)
    local = shard_batch_for_context_parallel(batch, plan, cp.rank)
    inputs = {k: local[k] for k in ("input_ids", "position_ids", "kv_end")}
    try:
        with tree_context_parallel(batch, plan, cp.rank, cp.group), torch.no_grad():
            model(**inputs, use_cache=False)
    except ValueError as error:
        return {"error": str(error), "num_tokens": plan.num_tokens, "shard_len": plan.shard_len}
    return {"error": "", "num_tokens": plan.num_tokens, "shard_len": plan.shard_len}


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


def sft_run(output_dir: str, model_name: str) -> dict:
    """2 SGD steps of ``TreeSFTTrainer`` (TRL) on 8 synthetic agent conversations (chat template, tools) with the
    float64 ``model_name`` model (``MODELS``), 2 trees per micro-batch, gradient accumulation 2, cut as
    ``TRAINER_OPTIONS`` say under CP: logged losses and the final full parameters."""
    from torch.distributed.tensor import DTensor

    from hf_tree.assets import load_smollm2_tokenizer
    from hf_tree.data.synthetic_agent import synthetic_agent_dataset
    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.helpers import SMOLLM2_VOCAB, exact_sgd_args, tiny_model

    family, overrides, _ = MODELS[model_name]
    model = tiny_model(family, dtype=torch.float64, vocab_size=SMOLLM2_VOCAB, **overrides)
    args = exact_sgd_args(
        output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.2,
        seed=3,
        bf16=False,
        gradient_checkpointing=False,  # TRL's default True; the launch's FSDP2 checkpoints the layers itself
        train_sampling_strategy="sequential",
        max_length=None,
        max_branch_tokens=4096,
        max_packed_tokens=4096,
        **TRAINER_OPTIONS,
    )
    dataset = synthetic_agent_dataset(8, seed=4, max_user_turns=2, max_tool_steps=1)
    trainer = TreeSFTTrainer(
        model=model, args=TreeSFTConfig(**args), train_dataset=dataset, processing_class=load_smollm2_tokenizer()
    )
    trainer.train()
    named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    return {
        "cp_size": 1 if trainer.tree_context_parallel is None else trainer.tree_context_parallel.size,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in named},
    }


def worker(out_dir: str, shards_only: bool) -> None:
    """Every case of the launch (``shards_only``: the shard cases, for the 4-rank launch)."""
    from accelerate import Accelerator

    from hf_tree.distributed import enable_fsdp2_on_cpu
    from hf_tree.parallel import TreeContextParallel

    enable_fsdp2_on_cpu()
    accelerator = Accelerator()
    cp = TreeContextParallel.from_accelerator(accelerator)
    results = {"cp_size": cp.size}
    trainers = {}
    with float64_everywhere():
        for name in SHARD_CASES:
            results[name] = run_shard_case(name, cp)
        results["llama4_temperature_refusal"] = llama4_temperature_refusal(cp)
        if shards_only:
            Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(results))
            finish_launched_worker()
        results["accelerate_refusal"] = accelerate_refusal(accelerator)
        for name, (model_name, lora) in TRAINER_RUNS.items():
            family, overrides, _ = MODELS[model_name]
            # FSDP2 wraps each decoder layer (Qwen3.5's _no_split_modules also names its vision block, absent from
            # the text model, which accelerate refuses): the launch config's wrap class, set per model.
            os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = WRAP_CLASSES[model_name]
            trainers[name] = train_tree_trainer(str(Path(out_dir, name)), family, overrides, TRAINER_OPTIONS, lora)
        for model_name in SFT_RUNS:
            os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = WRAP_CLASSES[model_name]
            trainers[f"sft_{model_name}"] = sft_run(str(Path(out_dir, f"sft_{model_name}")), model_name)
    if accelerator.process_index == 0:
        torch.save(trainers, Path(out_dir, "trainers.pt"))
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(results))
    finish_launched_worker()


# ----------------------------------------------------------------------------------------------- tests
def launch(out: Path, num_processes: int, *flags: str) -> list[dict]:
    """``accelerate launch`` of this file on ``num_processes`` gloo ranks, all of them one CP group; the ranks'
    results."""
    config = out / "accelerate_cp.json"
    parallelism = {"parallelism_config_cp_size": num_processes, "parallelism_config_dp_shard_size": 1}
    config.write_text(
        json.dumps({**ACCELERATE_CONFIG, "num_processes": num_processes, "parallelism_config": parallelism})
    )
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(free_port()), __file__, str(out), *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(num_processes)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], dict]:
    out = tmp_path_factory.mktemp("context_parallel_models")
    return launch(out, 2), torch.load(out / "trainers.pt")


@pytest.fixture(scope="module")
def launched_on_four(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("context_parallel_models_4"), 4, "--shards-only")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHARD_CASES))
def test_shards_matchsingle_process(launched, name):
    check_shard_case(launched[0], name, 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHARD_CASES))
def test_shards_on_four_ranks_matchsingle_process(launched_on_four, name):
    check_shard_case(launched_on_four, name, 4)


def check_shard_case(results: list[dict], name: str, cp_size: int) -> None:
    """Every rank's logits, the summed loss and every gradient of the case equal the whole batch's."""
    assert len(results) == cp_size and all(r["cp_size"] == cp_size for r in results)
    for rank, r in enumerate(results):
        case = r[name]
        assert case["num_grads"] > 0
        assert case["max_depth"] > MODELS[SHARD_CASES[name][0]][2]  # the trees are deeper than the window
        assert case["logits"] <= FLOAT64_TOLERANCE and case["loss"] <= FLOAT64_TOLERANCE, (rank, case)
        for parameter, error in case["grad_errors"].items():
            float32_cast = parameter.endswith(FLOAT32_CAST_PARAMETERS) or SHARD_CASES[name][0] in FLOAT32_CAST_MODELS
            tolerance = FLOAT32_CAST_TOLERANCE if float32_cast else FLOAT64_TOLERANCE
            assert error <= tolerance, (rank, parameter, error)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("models", [("mistral", "gemma3"), ("qwen3_5", "lfm2", "bamba")], ids=["windowed", "hybrid"])
def test_shards_cut_inside_windows_and_segments_at_forks_and_at_siblings(launched, models):
    """Cuts a window or a convolution/scan spans (inside a segment, deeper than the window), at a fork and at the
    start of a sibling branch all occur among the cases of the windowed models and of the hybrids."""
    results, _ = launched
    cuts = {kind for name, case in SHARD_CASES.items() if case[0] in models for kind in results[0][name]["cuts"]}
    assert {"segment", "fork", "sibling"} <= cuts, cuts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_llama4_shards_cut_inside_chunks(request, cp_size):
    """The Llama 4 cases cut a segment inside a chunk below the first one: the rank continuing it takes that chunk's
    ancestors from the other ranks and none of the earlier chunks (``check_shard_case`` shows the result exact)."""
    results = request.getfixturevalue("launched")[0] if cp_size == 2 else request.getfixturevalue("launched_on_four")
    assert sum(results[0][name]["chunk_cuts"] for name in SHARD_CASES if name.startswith("llama4")) > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_llama4_temperature_tuning_measures_the_whole_row_under_cp(request, cp_size):
    """A row of ``floor_scale`` tokens is refused on every rank, though each shard is shorter than
    ``floor_scale`` (the NoPE layers' packed index restarts on a shard; one process refuses the row too)."""
    results = request.getfixturevalue("launched")[0] if cp_size == 2 else request.getfixturevalue("launched_on_four")
    for r in results:
        refusal = r["llama4_temperature_refusal"]
        assert refusal["shard_len"] < refusal["num_tokens"]
        assert f"floor_scale={refusal['num_tokens']}" in refusal["error"], refusal


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TRAINER_RUNS))
def test_tree_trainer_under_accelerate_cp_matchessingle_process(launched, name, tmp_path):
    """``TreeTrainer`` under accelerate's FSDP2 + cp_size 2 config trains the windowed/softcapped/hybrid model, fully
    or through LoRA adapters (accelerate alone refuses these models at ``prepare``), to the losses and parameters of
    the same run in one process."""
    _, trainers = launched
    model_name, lora = TRAINER_RUNS[name]
    family, overrides, _ = MODELS[model_name]
    distributed = trainers[name]
    with float64_everywhere():
        single = train_tree_trainer(str(tmp_path), family, overrides, TRAINER_OPTIONS, lora)
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
    tolerance = FLOAT32_CAST_TOLERANCE if model_name in FLOAT32_CAST_MODELS else FLOAT64_TOLERANCE
    assert max(errors.values()) <= tolerance, errors


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model_name", SFT_RUNS)
def test_tree_sft_trainer_under_accelerate_cp_matchessingle_process(launched, tmp_path, model_name):
    """TRL's path: ``TreeSFTTrainer`` on agent conversations with the windowed, softcapped Gemma 3 and with the
    Qwen3.5 hybrid under the FSDP2 + cp_size 2 launch equals the same run in one process."""
    distributed = launched[1][f"sft_{model_name}"]
    with float64_everywhere():
        single = sft_run(str(tmp_path), model_name)
    assert distributed["cp_size"] == 2 and single["cp_size"] == 1
    assert len(distributed["losses"]) == len(single["losses"]) == 2
    for got, want in zip(distributed["losses"], single["losses"]):
        assert abs(got - want) <= LOGGED_LOSS_TOLERANCE * abs(want), (distributed["losses"], single["losses"])
    errors = {n: relative_error(p, single["params"][n]) for n, p in distributed["params"].items()}
    assert distributed["params"].keys() == single["params"].keys()
    assert max(errors.values()) <= FLOAT64_TOLERANCE, errors


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_refusal_outside_tree_trainers_stays(launched):
    results, _ = launched
    for r in results:
        assert "sliding_attention" in r["accelerate_refusal"], r["accelerate_refusal"]


if __name__ == "__main__":
    worker(sys.argv[1], "--shards-only" in sys.argv[2:])
