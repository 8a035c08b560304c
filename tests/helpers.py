"""Shared test helpers: exact training runs, the pieces of the TRL-against-tree-trainer comparisons and the
``accelerate launch`` command of the 2-process tests. The data and tree workloads live in tests/workloads.py; no
test module imports another (issue 17).

The oracle itself (tiny models from configs, hybrids included; the per-branch reference loss and gradients; the
error measures) lives in ``hf_tree.testing``, shared with the model zoo and the benchmarks; it is re-exported here
under the names the tests use.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree.attention import TreeAttentionOptions
from hf_tree.models.mixers import build_topology
from hf_tree.testing import (  # noqa: F401  (re-exported: the oracle, see hf_tree/testing.py)
    FLOAT32_FLOOR,
    FLOAT32_GRAD_FLOOR,
    HYBRIDS,
    MOE_SETTINGS,
    SLOW_HYBRIDS,
    TINY,
    VOCAB,
    float64_family_norms,
    float64_norms,
    float64_qwen3_5_norms,
    grads_of,
    hybrid_model,
    max_grad_error,
    per_branch_forest_loss,
    per_branch_loss,
    relative_error,
    replaced,
    tiny_config,
    tiny_model,
)
from hf_tree.testing import own_attention_name as own_attention  # noqa: F401  (a name: "sdpa" or "eager")
from hf_tree.trl.compat import has_fused_lm_head
from hf_tree.versions import FUSED_HEAD_TRL, is_tested, pip_range

# The gradient measures under the names the tests use: ``hf_tree.testing.max_grad_error`` with the float64 floor,
# with the floor of float32 internals (hybrids), and per tensor against its own norm (state dicts, saved files).
max_grad_relative_error = max_grad_error


def float32_floor_grad_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max_grad_error(got, expected, floor=FLOAT32_GRAD_FLOOR)


def max_relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max_grad_error(got, expected, floor=0.0)


# ------------------------------------------------------------------------------- SmolLM2's real tokenizer
SMOLLM2_VOCAB = 49152  # SmolLM2's tokenizer
QWEN3_TEMPLATE = str(importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja")


def smollm2_tokenizer_or_skip() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's tokenizer from the offline asset; skips the calling test (or fixture) when it is missing."""
    from hf_tree.assets import load_smollm2_tokenizer, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing (CI installs it): {error}")
    return load_smollm2_tokenizer()


def rendered(tokenizer, messages, **kwargs) -> list[int]:
    """The builders' oracle: the chat template's own tokenization of ``messages``."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


# ------------------------------------------------------------------------------------------- training runs
def exact_sgd_args(output_dir: str, **settings) -> dict:
    """Keyword arguments of ``TrainingArguments`` (or a TRL config) for runs compared against an oracle.

    Constant-rate SGD without weight decay keeps a gradient error visible in the update (Adam would normalise it
    away). Clipping stays at Trainer's and TRL's default (``max_grad_norm=1.0``), the path users run: both runs clip
    by their own global gradient norm, so a gradient error still shows (clipping can hide one only when it is a
    common scale factor of every gradient, which the norm then undoes), and the clipped step is covered too. The
    loss is logged every step; nothing is saved or reported, and data loads in the main process. ``settings`` add
    to or override these (``max_grad_norm=0.0``: no clipping, where a test says why).
    """
    defaults = dict(
        output_dir=output_dir,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return {**defaults, **settings}


def clipped_sgd_updates(model: torch.nn.Module, max_grad_norm: float = 1.0) -> dict[str, torch.Tensor]:
    """The update of ``exact_sgd_args``' step at learning rate 1 from ``model``'s accumulated gradients, for oracles
    that backpropagate by hand: clipped by their global norm as Trainer clips (``clip_grad_norm_``; 0: no clipping),
    then negated. Parameters without a gradient are left out."""
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return {name: -grad for name, grad in grads_of(model).items()}


def train_and_measure_updates(trainer) -> dict[str, torch.Tensor]:
    """Run ``trainer.train()`` with RMSNorm kept in float64; how far it moved each trainable parameter."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with float64_norms():
        trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------- transformers.Trainer on the branches (the oracle)
def collate_branches(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Reference collator: every branch of every row, right-padded; labels -100 where not trained."""
    branches = [(seq, mask) for row in rows for seq, mask in zip(row["sequences"], row["masks"])]
    length = max(len(seq) for seq, _ in branches)
    input_ids = torch.zeros(len(branches), length, dtype=torch.long)
    attention_mask = torch.zeros(len(branches), length, dtype=torch.long)
    labels = torch.full((len(branches), length), -100, dtype=torch.long)
    for i, (seq, mask) in enumerate(branches):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(seq), -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def branch_loss_func(normalization: str, branches_per_step: int, label_smoothing: float = 0.0):
    """Reference ``compute_loss_func`` in float64: token = HF's sum / num_items_in_batch (counted by Trainer
    over the accumulated batch); sequence = per-branch means summed / branches in the step. ``label_smoothing``:
    transformers' ``LabelSmoother`` per token, ``(1 - eps) * CE + eps * mean over the vocabulary of -log p``."""

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].to(torch.float64)
        targets = labels[:, 1:]
        trained = targets != -100
        ce = F.cross_entropy(logits.transpose(1, 2), targets.clamp_min(0), reduction="none")
        ce = (1 - label_smoothing) * ce - label_smoothing * torch.log_softmax(logits, -1).mean(-1)
        ce = ce * trained
        if normalization == "token":
            return ce.sum() / num_items_in_batch
        return (ce.sum(1) / trained.sum(1)).sum() / branches_per_step

    return loss_func


def common_args(tmp_path, name: str, batch_size: int, accumulation: int, **overrides) -> dict:
    """``exact_sgd_args`` of the TreeTrainer-against-Trainer runs (3 CPU steps, lr 0.5, seed 7) in
    ``tmp_path/name``; ``overrides`` add to or override these."""
    defaults = dict(
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=3,
        learning_rate=0.5,
        seed=7,
        use_cpu=True,
    )
    return exact_sgd_args(str(tmp_path / name), **{**defaults, **overrides})


# ------------------------------------------------------------------------------- TRL trainers vs tree twins
TRL_TOLERANCE = 1e-9
# Parameter updates of one step: TRL's fused log-prob kernel computes its gradients in float32 even in a float64
# model (hidden-state gradients and the LM head's weight gradient), rounding differently for a different number of
# rows (TRL: every position of the padded batch; tree: the scored ones). TRL itself moves by ~3e-8 when only its
# padding changes (pad_to_multiple_of); a missing, doubled or misplaced token changes updates by > 1e-3.
TRL_STEP_TOLERANCE = 1e-6
# Tests that compare against TRL's fused LM head itself (``model(..., fused_lm_head=True)`` of a model TRL equipped)
# skip, saying why, where an older TRL of the supported range is installed (.ci/trl_oldest.sh runs TRL 1.9, which has
# none; there the tree trainers are compared with TRL's trainers, which score from the model's logits).
needs_fused_head_trl = pytest.mark.skipif(
    not is_tested(importlib.metadata.version("trl"), FUSED_HEAD_TRL),
    reason=f"needs {pip_range(FUSED_HEAD_TRL)} (TRL's fused LM head); trl {importlib.metadata.version('trl')} is "
    "installed",
)


def on_completions(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values [B, K]`` of the last ``K`` columns where ``mask [B, T]`` marks real tokens, zero elsewhere: TRL 1.9
    scores a completion's padding from the padding (what its loss masks out), TRL 1.16 and the tree pass score it
    zero, so values are compared where the loss reads them."""
    return values * mask[:, -values.shape[1] :]


def add_trl_fused_head(model: PreTrainedModel, **settings) -> None:
    """TRL's fused LM head on ``model`` (``add_fused_lm_head(model, **settings)``) where TRL has one; TRL 1.9's
    trainers score from the model's logits, so there is nothing to install."""
    if has_fused_lm_head():
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, **settings)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A real (word-level) fast tokenizer over the tiny vocabulary: ids 0-2 special, ``w{i}`` -> id ``i``."""
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, TINY["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def saved_tiny_model(path, dtype: torch.dtype, family: str = "llama", **overrides) -> str:
    """Save a tiny model (Llama by default; ``sdpa``, or ``eager`` where the model refuses it) to ``path`` for
    trainers that load their models by path; returns the path."""
    model = tiny_model(family, dtype=dtype, **overrides)
    model.set_attn_implementation(own_attention(model))
    model.save_pretrained(path)
    return str(path)


def tiny_trl_config(cls, path: str, dtype: torch.dtype, **settings):
    """A TRL config (``cls``) for a CPU run of the tiny model saved at ``path`` (batches of 4, exact SGD when
    trained, see ``exact_sgd_args``); ``settings`` add to or override these."""
    defaults = dict(use_cpu=True, bf16=False, model_init_kwargs={"dtype": dtype}, per_device_train_batch_size=4)
    return cls(**exact_sgd_args(f"{path}/out", **{**defaults, **settings}))


def assert_same_step_as_trl(trl, trl_updates: dict, tree, tree_updates: dict) -> None:
    """The tree trainer logged TRL's loss and moved every parameter as TRL did (and TRL did move them)."""
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert trl_updates.keys() == tree_updates.keys()
    for name, update in trl_updates.items():
        assert relative_error(tree_updates[name], update) <= TRL_STEP_TOLERANCE, name
    assert any(u.norm() > 0 for u in trl_updates.values())


def sft_step(cls, config_cls, path: str, rows: dict[str, list[str]], **settings):
    """``(trainer, its updates)`` after one SGD step of an SFT trainer (``cls``/``config_cls``: TRL's or the tree
    one) on the tiny model saved at ``path``, in float64: 2 micro-batches of 2 rows of ``rows`` (``prompt`` and
    ``completion`` columns) in order, so two rows with one prompt form one tree. ``settings`` add to or override the
    config's; ``peft_config`` goes to the trainer."""
    from datasets import Dataset  # imported here: most users of this module never need it

    peft_config = settings.pop("peft_config", None)
    step = dict(max_steps=1, learning_rate=1.0, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    step.update(train_sampling_strategy="sequential")
    args = tiny_trl_config(config_cls, path, torch.float64, **{**step, **settings})
    trainer = cls(
        model=path,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )
    return trainer, train_and_measure_updates(trainer)


# --------------------------------------------------------------------------------------------- TRL GRPO
def trainer_args(cls, path: str, dtype: torch.dtype, **overrides):
    """A GRPO config (``cls``: TRL's or the tree one) from ``tiny_trl_config``: 4 generations of at most 8 tokens,
    beta 0.1; ``overrides`` add to or override these."""
    grpo_defaults = dict(num_generations=4, max_completion_length=8, beta=0.1)
    return tiny_trl_config(cls, path, dtype, **{**grpo_defaults, **overrides})


def zero_reward(completions, **_) -> list[float]:
    """Reward 0 for every completion."""
    return [0.0] * len(completions)


# prompt text -> its group's completions (token ids): unequal lengths, shared prefixes, a duplicate
FIXED_COMPLETIONS = {
    "w10 w11 w12 w13 w14": [[20, 21, 22], [20, 21, 1], [23, 24, 25, 26, 27, 28], [29]],
    "w15 w16 w17": [[30, 31], [32, 33, 34, 35, 1], [30, 36], [30, 31]],
}


def fixed_rollout(prompts: list[str], trainer) -> dict:
    """Generation replaced by a fixed list of completions (TRL's ``rollout_func`` hook), identical for both."""
    seen: dict[str, int] = {}
    output = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
    for prompt in prompts:
        k = seen[prompt] = seen.get(prompt, -1) + 1
        output["prompt_ids"].append(trainer.processing_class(prompt)["input_ids"])
        output["completion_ids"].append(FIXED_COMPLETIONS[prompt][k % 4])
    return output


def varied_reward(completion_ids, **_) -> list[float]:
    """A reward that differs between completions (id sum mod 7), so the advantages are not all zero."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def seed_before_the_adapter(args) -> None:
    """``transformers.set_seed(args.seed)`` before a trainer is built: TRL 1.16's trainers seed before creating a LoRA
    adapter (randomly initialized), TRL 1.9's after it or never, so on 1.9 two trainers built in a row start from the
    same adapter only when seeded first."""
    transformers.set_seed(args.seed)


def one_step(cls, config_cls, path: str, peft: bool, rollout: bool = True, **overrides):
    """``one_step_trainer`` trained: ``(trainer, its updates)``."""
    trainer = one_step_trainer(cls, config_cls, path, peft, rollout, **overrides)
    return trainer, train_and_measure_updates(trainer)


def one_step_trainer(
    cls,
    config_cls,
    path: str,
    peft: bool,
    rollout: bool = True,
    prompts: Sequence[str] = tuple(FIXED_COMPLETIONS),
    eval_prompts: Sequence[str] | None = None,
    **overrides,
):
    """A trainer for one optimizer step (2 micro-batches of 4 shuffled rows from 2 groups, 2 iterations per
    generation: old policy, reference and policy passes all run), SGD so gradient errors stay visible (clipping on:
    ``exact_sgd_args``); ``overrides`` add to or override the config's settings. ``rollout``: completions from
    ``fixed_rollout`` (GRPO's ``rollout_func`` hook); RLOO has none and samples its own (the same seed and logits give
    the same). ``prompts``/``eval_prompts``: the training/evaluation datasets' prompts (keys of
    ``FIXED_COMPLETIONS``; repeats allowed)."""
    from datasets import Dataset  # imported here: most users of this module never need them
    from peft import LoraConfig

    settings = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=1, learning_rate=1.0)
    args = trainer_args(config_cls, path, torch.float64, **{**settings, **overrides})
    seed_before_the_adapter(args)
    return cls(
        path,
        varied_reward,
        args,
        train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
        eval_dataset=Dataset.from_dict({"prompt": list(eval_prompts)}) if eval_prompts else None,
        processing_class=word_tokenizer(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
        **({"rollout_func": fixed_rollout} if rollout else {}),
    )


# ----------------------------------------------------------------------------------------- accelerate launch
# 2-process layouts for stand-in accelerators: (accelerate's DistributedType name, is_fsdp2, dp_replicate_size, what
# the refusal names, or None where hf_tree.depth_first_runner.DepthFirstRunner.local_model runs: DDP and FSDP2).
PROCESS_LAYOUTS = [
    ("MULTI_CPU", False, 1, None),
    ("MULTI_GPU", False, 1, None),
    ("FSDP", True, 1, None),
    ("FSDP", False, 1, "under DistributedType.FSDP"),  # FSDP1
    ("FSDP", True, 2, "HSDP"),
    ("XLA", False, 1, "under DistributedType.XLA"),
    ("DEEPSPEED", False, 1, "DeepSpeed"),
]


def free_port() -> int:
    """A free local port, so launches in a row never share ``--main_process_port``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(config: Path) -> list[str]:
    """``accelerate launch`` of ``config`` (JSON or YAML) on 2 CPU processes in float32 (CP configs: the 2 processes
    shard data only)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 1000),
    ]
    if config.suffix == ".json" and "parallelism_config" in json.loads(config.read_text()):
        command += ["--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "1"]
    return command


# --------------------------------------------------------------------- attention engine oracles
def run(engine, q, k, v, kv_end, position_ids, grad_seed: int = 1, backward: bool = True, **options):
    """Output and, with ``backward``, (dq, dk, dv[, d sinks]) for a fixed random output gradient; ``options`` are
    the fields of ``TreeAttentionOptions`` but ``position_ids``."""
    options = TreeAttentionOptions(position_ids=position_ids, **options)
    if not backward:
        with torch.no_grad():
            return engine(q, k, v, kv_end, options), None
    out = engine(q, k, v, kv_end, options)
    generator = torch.Generator().manual_seed(grad_seed)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out)
    sinks = () if options.sinks is None else (options.sinks,)
    grads = torch.autograd.grad(out, (q, k, v, *sinks), grad)
    return out.detach(), grads


def detached64(tensors):
    return [t.detach().to(torch.float64).requires_grad_() for t in tensors]


# --------------------------------------------------------------------- benchmark smoke tests
REPO_ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``benchmarks/<script>`` in a subprocess (benchmarks profile memory and may pin the allocator) with this
    checkout's ``hf_tree`` first on the path; fails the test with its stderr unless it exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / script), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def finish_launched_worker() -> None:
    """End a worker launched by ``accelerate launch``/``torchrun`` after its report is written: every rank leaves
    together (an early exit aborts gloo's threads), then the process skips interpreter teardown, in which a CPU process
    sometimes aborts ("terminate called without an active exception", SIGABRT) after all its work is done, failing
    the launch."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------- tree mixer ops
# Exactness of a tree mixer op's decomposition (same op, float64 compute, the lone branch: different chunking).
TREE_OP_EXACT = 1e-12


def branch_paths(kv_end: torch.Tensor) -> list[list[int]]:
    """Flat packed indices of every root-to-leaf path (walking predecessors from each token nobody continues)."""
    pred = build_topology(kv_end).pred.tolist()
    continued = {p for p in pred if p >= 0}
    paths = []
    for leaf in range(len(pred)):
        if leaf in continued:
            continue
        path = [leaf]
        while pred[path[-1]] >= 0:
            path.append(pred[path[-1]])
        paths.append(path[::-1])
    return paths


def random_token_inputs(kv_end, *shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch, length = kv_end.shape
    return [torch.randn(batch, length, *s, dtype=torch.float64, generator=generator) for s in shapes]


def _on_branch(fn, tensors, kv_end, path):
    """``fn`` on one branch: every ``[B, N, ...]`` tensor gathered along ``path`` into ``[1, L, ...]``."""
    batch, length = kv_end.shape
    return fn(*(t.reshape(batch * length, *t.shape[2:])[path][None] for t in tensors))


def _at_path(tensor, kv_end, path):
    batch, length = kv_end.shape
    return tensor.reshape(batch * length, *tensor.shape[2:])[path][None]


def _lone_topology(path):
    return build_topology(torch.full((1, len(path)), len(path)))


def check_tree_op(tree_fn, hf_fn, lone_fn, inputs, kv_end):
    """Values at every branch vs the model's own function on the branch (float32 floor) and vs the tree op on the
    lone branch (exact); gradients of a random projection of the outputs vs the sum of per-branch ones."""
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = tree_fn(*inputs)
    projection = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    tree_grads = torch.autograd.grad((out * projection).sum(), inputs)
    paths = branch_paths(kv_end)
    # Each token's output once: a branch owns the tokens of its path not owned by an earlier branch.
    owned, seen = [], set()
    for path in paths:
        owned.append([k for k, i in enumerate(path) if i not in seen])
        seen.update(path)
    lone_total = 0.0
    for path, mine in zip(paths, owned):
        got = _at_path(out, kv_end, path)
        lone_topology = _lone_topology(path)
        lone = _on_branch(lambda *t, lone=lone_topology: lone_fn(lone, *t), inputs, kv_end, path)
        reference = _on_branch(hf_fn, inputs, kv_end, path)
        assert relative_error(got, lone) <= TREE_OP_EXACT
        assert relative_error(got, reference) <= FLOAT32_FLOOR
        lone_total = lone_total + (lone[0, mine] * _at_path(projection, kv_end, path)[0, mine]).sum()
    lone_grads = torch.autograd.grad(lone_total, inputs)
    for got, expected in zip(tree_grads, lone_grads):
        assert relative_error(got, expected) <= TREE_OP_EXACT
        assert expected.norm() > 0


def generate_and_score(model, input_ids, attention_mask):
    """Logits of a left-padded batch and a few greedy tokens (cached decoding): the paths without kv_end."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    generated = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    return logits, generated


def one_rank_context_parallel_errors(model: torch.nn.Module, batch: dict) -> tuple[float, float]:
    """(loss, largest gradient) relative errors of ``model`` on the packed ``batch`` under hf_tree's context parallel
    on one rank against the same batch packed: the mixers run on the row gathered from the ranks (asserted: they take
    that path), which on one rank is the whole row. The model's gradients are left zeroed."""
    from hf_tree import tree_causal_lm_loss
    from hf_tree.models.mixers.install import sharded_rows
    from hf_tree.parallel import plan_context_parallel, shard_batch_for_context_parallel, tree_context_parallel

    loss = tree_causal_lm_loss(model, batch)
    loss.backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    plan = plan_context_parallel(batch["kv_end"], 1)
    with tree_context_parallel(batch, plan, 0) as context:
        assert sharded_rows() is context
        cp_loss = tree_causal_lm_loss(model, shard_batch_for_context_parallel(batch, plan, 0))
        cp_loss.backward()
    errors = relative_error(cp_loss, loss), max_grad_relative_error(grads_of(model), grads)
    model.zero_grad(set_to_none=True)
    return errors
