"""TRL option parity: TRL's own ``trl/scripts/{sft,dpo,grpo,rloo,kto,reward}.py``, unmodified vs the class swap.

For every row of ``ROWS`` (a script and a few flags of its TRL config or ``ModelConfig``) the installed script runs
twice in this process on the same tiny local model and dataset: once as shipped, once from a temporary copy whose
``from trl import ...`` lines import hf_tree's classes under TRL's names instead (``swapped_source``; nothing else
changes). Each row ends in one state:

- ``exact``: both trained the same number of optimizer steps and every trainable parameter moved the same way (the
  largest per-parameter relative difference of the updates is at most ``EXACT_TOLERANCE``, float32 rounding);
- ``refused``: the swapped script raised ``ValueError`` before training (the message is shown);
- ``warned`` (rows marked ``dropout``): LoRA dropout stays on, the updates differ by their noise, and the swapped
  run logged ``hf_tree.models.dropout``'s warning;
- ``float32 noise`` (rows marked ``padding_noise``, the reward model's): the difference exceeds ``EXACT_TOLERANCE``
  but is at most twice TRL's own, measured by a third run of TRL's script in which only the padding changes;
- ``MISMATCH`` (a silent difference) or ``CRASH`` (any other error): failures.

Setup: a tiny Llama (2 layers, hidden 32; the MoE rows: a tiny Qwen3-MoE, 4 experts, top-2) with SmolLM2's real
tokenizer (vocab 49152, from the offline asset), saved to a temporary folder; float32, ``--bf16 false``, SGD at a
constant rate without clipping (a gradient error stays visible in the update), 2 optimizer steps unless the row says
otherwise. GRPO generates 4 completions of at most 6
tokens per prompt; the model's end-of-sequence token is made likely (``eos_bias``) so that some completions end and
others are truncated, and rewards come from ``benchmarks/trl_parity_rewards.py`` through the script's
``--reward_funcs`` dotted paths.

    python benchmarks/trl_parity.py                 # every row (~15 min on a 2-core CPU)
    python benchmarks/trl_parity.py --entropy-threshold-flips   # float32 ties of top_entropy_quantile
    python benchmarks/trl_parity.py --only grpo     # rows whose name starts with "grpo"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tests.helpers and the reward module import from the repository
    sys.path.insert(0, str(REPO))

from hf_tree.models.dropout import DROPOUT_WARNING  # noqa: E402
from hf_tree.testing import tiny_model  # noqa: E402
from tests.helpers import smollm2_tokenizer_or_skip  # noqa: E402
from tests.workloads import TINY_DEEPSEEK_V3  # noqa: E402

SCRIPTS = pathlib.Path(importlib.util.find_spec("trl").origin).parent / "scripts"
# TRL's names -> hf_tree's (module, class): the whole swap.
SWAP = {
    "SFTConfig": ("hf_tree.trl.sft", "TreeSFTConfig"),
    "SFTTrainer": ("hf_tree.trl.sft", "TreeSFTTrainer"),
    "DPOConfig": ("hf_tree.trl.dpo", "TreeDPOConfig"),
    "DPOTrainer": ("hf_tree.trl.dpo", "TreeDPOTrainer"),
    "GRPOConfig": ("hf_tree.trl.grpo", "TreeGRPOConfig"),
    "GRPOTrainer": ("hf_tree.trl.grpo", "TreeGRPOTrainer"),
    "RLOOConfig": ("hf_tree.trl.rloo", "TreeRLOOConfig"),
    "RLOOTrainer": ("hf_tree.trl.rloo", "TreeRLOOTrainer"),
    "RewardConfig": ("hf_tree.trl.reward", "TreeRewardConfig"),
    "RewardTrainer": ("hf_tree.trl.reward", "TreeRewardTrainer"),
    "KTOConfig": ("hf_tree.trl.kto", "TreeKTOConfig"),
    "KTOTrainer": ("hf_tree.trl.kto", "TreeKTOTrainer"),
}
# Largest per-parameter relative difference of two float32 updates counted as equal. Seen: 1e-7 .. 1e-5 (TRL's
# float32 kernels round differently for differently shaped batches); a missing or misweighted token moves > 1e-3.
EXACT_TOLERANCE = 1e-4
# Parameters whose update is tiny (q/k projections of a near-uniform random model move ~1e-5 of the largest update)
# are measured against this fraction of the largest update norm: their float32 rounding noise (~1e-9) would
# otherwise read as a large relative error.
UPDATE_FLOOR = 1e-3
REWARDS = "benchmarks.trl_parity_rewards"
# TRL's copy of Qwen3's template: assistant_only_loss swaps in its {% generation %}-marked training variant
QWEN3_TEMPLATE = SCRIPTS.parent / "chat_templates" / "qwen3.jinja"
# Row outcomes that are not failures (MISMATCH and CRASH are).
STATES = ("exact", "refused", "warned", "float32 noise")
# What a ``padding_noise`` row adds to a second TRL run so that only TRL's padding changes (the difference of the two
# TRL runs is TRL's own float32 noise): padding to 32 (longer than every row of the setup), or none for a row that
# pads already.
PADDING_NOISE_FLAGS = ("--pad_to_multiple_of", "32")
UNPADDED_FLAGS = ("--pad_to_multiple_of", "None")


@dataclass(frozen=True)
class Row:
    """One option set: ``script`` (a key of ``BASE``), extra command-line ``flags`` (added to ``BASE``)."""

    name: str
    script: str
    flags: tuple[str, ...] = ()
    fast: bool = False  # part of the fast test tier: one row per script
    dropout: bool = False  # LoRA dropout stays on: "warned" when the tree run said so (hf_tree.models.dropout)
    dataset: str | None = None  # a dataset of write_setup other than the script's own (e.g. "sft_messages")
    model: str = (
        "model"  # a model of write_setup: "model" (tiny Llama), "moe_model" (tiny Qwen3-MoE), "mla_model" (tiny
        # DeepSeek V3), "llava", "gemma3"
    )
    padding_noise: bool = False  # a difference above EXACT_TOLERANCE is "float32 noise" when it is at most twice
    # TRL's own difference under PADDING_NOISE_FLAGS (ill-conditioned updates, see _reward)


@dataclass
class Outcome:
    row: Row
    state: str  # "exact", "refused", "MISMATCH", "CRASH"
    detail: str = ""
    steps: tuple[int, int] | None = None  # (TRL, swapped) optimizer steps
    error: float | None = None  # largest per-parameter relative update difference
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _sft(name: str, *flags: str, fast: bool = False) -> Row:
    return Row(f"sft {name}", "sft", flags, fast)


def _dpo(name: str, *flags: str, fast: bool = False) -> Row:
    return Row(f"dpo {name}", "dpo", flags, fast)


def _grpo(name: str, *flags: str, fast: bool = False) -> Row:
    return Row(f"grpo {name}", "grpo", flags, fast)


def _rloo(name: str, *flags: str, fast: bool = False) -> Row:
    return Row(f"rloo {name}", "rloo", flags, fast, dataset="grpo")  # RLOO samples groups from GRPO's prompts


def _kto(name: str, *flags: str, fast: bool = False) -> Row:
    return Row(f"kto {name}", "kto", flags, fast)


def _reward(name: str, *flags: str, fast: bool = False) -> Row:
    """The same preference pairs as DPO. The random tiny model scores chosen and rejected within ~1e-4 of each other,
    so the loss gradient is a difference of two nearly equal gradients, which amplifies float32 rounding ~1e4-fold:
    TRL's own updates move by ~6e-4 when only its padding changes (``padding_noise``)."""
    return Row(f"reward {name}", "reward", flags, fast, dataset="dpo", padding_noise=True)


ROWS: tuple[Row, ...] = (
    _sft("defaults"),
    # LoRA dropout draws one mask per packed token: a shared prompt token gets one draw instead of one per branch
    # (same expectation, different samples), so exact comparisons switch it off (GRPO/DPO disable dropout anyway).
    _sft("--use_peft --lora_dropout 0", "--use_peft", "true", "--lora_dropout", "0"),
    Row("sft --use_peft (lora_dropout 0.05, TRL's default)", "sft", ("--use_peft", "true"), dropout=True),
    _sft("--completion_only_loss false", "--completion_only_loss", "false"),
    _sft("--loss_type dft", "--loss_type", "dft"),
    _sft("--label_smoothing_factor 0.1", "--label_smoothing_factor", "0.1"),
    _sft(
        "--loss_type dft --use_peft --lora_dropout 0", "--loss_type", "dft", "--use_peft", "true", "--lora_dropout", "0"
    ),
    _sft(
        "--gradient_accumulation_steps 2 (batch 2)",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
    ),
    _sft("1 epoch, batch 4 (20 rows = 5 prompts x 4)", "--max_steps", "-1", "--num_train_epochs", "1", fast=True),
    Row(
        "sft 1 epoch, batch 4, random order",
        "sft",
        # Rate 0.1: at 0.5 its 5 steps (gradient norms up to 11) amplify float32 rounding to 2.6e-4 (losses equal to
        # 6e-6, the first step's exactly); float64: tests/test_same_rows_as_trl.py.
        (
            "--max_steps",
            "-1",
            "--num_train_epochs",
            "1",
            "--train_sampling_strategy",
            "random",
            "--learning_rate",
            "0.1",
        ),
    ),
    Row(
        "sft 1 epoch, batch 3 (groups of 4)",
        "sft",
        ("--max_steps", "-1", "--num_train_epochs", "1", "--per_device_train_batch_size", "3"),
    ),
    _sft("--packing true", "--packing", "true"),
    _sft("--padding_free true --max_length None", "--padding_free", "true", "--max_length", "None"),
    Row("sft messages (defaults: every token of TRL's rendering)", "sft", dataset="sft_messages"),
    Row(
        "sft messages --assistant_only_loss true (Qwen3 template)",
        "sft",
        ("--assistant_only_loss", "true", "--chat_template_path", str(QWEN3_TEMPLATE)),
        dataset="sft_messages",
    ),
    _dpo("defaults (sigmoid)", fast=True),
    _dpo("--attn_implementation sdpa", "--attn_implementation", "sdpa"),
    _dpo("--loss_type ipo", "--loss_type", "ipo"),
    _dpo("--loss_type hinge", "--loss_type", "hinge"),
    _dpo("--loss_type robust --label_smoothing 0.1", "--loss_type", "robust", "--label_smoothing", "0.1"),
    _dpo("--loss_type apo_zero", "--loss_type", "apo_zero"),
    _dpo("--loss_type sigmoid sft --loss_weights 1 0.5", "--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0.5"),
    _dpo("--ld_alpha 0.5", "--ld_alpha", "0.5"),
    _dpo("--use_weighting true", "--use_weighting", "true"),
    _dpo("--precompute_ref_log_probs true", "--precompute_ref_log_probs", "true"),
    _dpo("--f_divergence_type js_divergence", "--f_divergence_type", "js_divergence"),
    _dpo("--use_peft", "--use_peft", "true"),
    _grpo("defaults", fast=True),
    _grpo("--attn_implementation eager", "--attn_implementation", "eager"),
    *(_grpo(f"--loss_type {t}", "--loss_type", t) for t in ("grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo")),
    _grpo("--loss_type vespo", "--loss_type", "vespo"),
    _grpo("--importance_sampling_level sequence", "--importance_sampling_level", "sequence"),
    _grpo("--scale_rewards batch", "--scale_rewards", "batch"),
    _grpo("--epsilon_high 0.28 --delta 1.5", "--epsilon_high", "0.28", "--delta", "1.5"),
    _grpo("--off_policy_mask_threshold 0.5", "--off_policy_mask_threshold", "0.5"),
    _grpo("--beta 0", "--beta", "0"),
    _grpo("--num_iterations 2", "--num_iterations", "2"),
    _grpo("--steps_per_generation 2", "--steps_per_generation", "2"),
    _grpo(
        "two reward functions, --reward_weights 1 0.5",
        "--reward_funcs",
        f"{REWARDS}.length_reward",
        f"{REWARDS}.vowel_reward",
        "--reward_weights",
        "1",
        "0.5",
    ),
    _grpo("--top_entropy_quantile 0.8", "--top_entropy_quantile", "0.8"),
    _grpo("--top_entropy_quantile 0.5", "--top_entropy_quantile", "0.5"),
    _grpo(
        "--top_entropy_quantile 0.5 --use_peft --lora_dropout 0",
        *("--top_entropy_quantile", "0.5", "--use_peft", "true", "--lora_dropout", "0"),
    ),
    _grpo("--mask_truncated_completions true", "--mask_truncated_completions", "true"),
    _grpo("--use_peft --lora_dropout 0", "--use_peft", "true", "--lora_dropout", "0"),
    Row("grpo --use_peft (lora_dropout 0.05, TRL's default)", "grpo", ("--use_peft", "true"), dropout=True),
    _grpo("--use_peft --disable_dropout true", "--use_peft", "true", "--disable_dropout", "true"),
    # MoE: TRL's defaults turn the router load-balancing loss on with the architecture's coefficient (0.001)
    Row("sft Qwen3-MoE (router loss, TRL's default coefficient)", "sft", model="moe_model"),
    Row("sft Qwen3-MoE --router_aux_loss_coef 0.5", "sft", ("--router_aux_loss_coef", "0.5"), model="moe_model"),
    Row("dpo Qwen3-MoE --router_aux_loss_coef 0.5", "dpo", ("--router_aux_loss_coef", "0.5"), model="moe_model"),
    Row("grpo Qwen3-MoE --router_aux_loss_coef 0.5", "grpo", ("--router_aux_loss_coef", "0.5"), model="moe_model"),
    # MLA (value heads of another size than query/key heads; issue 43): DeepSeek V3 declares no router loss. At
    # COMMON's rate 0.5 float32 rounding of the first step (every update within 4.5e-6 of TRL's after one step) grows
    # to 1.1e-4 in the second step's kv_a_layernorm update; at 0.05 every update is within 1.2e-5 after two.
    Row("sft DeepSeek V3 (MLA, MoE)", "sft", ("--learning_rate", "0.05"), model="mla_model"),
    Row("grpo DeepSeek V3 (MLA, MoE)", "grpo", model="mla_model"),
    _rloo("defaults", fast=True),
    _rloo("--beta 0", "--beta", "0"),
    _rloo("--num_iterations 2", "--num_iterations", "2"),
    _rloo("--normalize_advantages true", "--normalize_advantages", "true"),
    _rloo("--epsilon_high 0.28", "--epsilon_high", "0.28"),
    _rloo("--mask_truncated_completions true", "--mask_truncated_completions", "true"),
    _rloo("--use_peft --lora_dropout 0", "--use_peft", "true", "--lora_dropout", "0"),
    _kto("defaults (KL term on)", fast=True),
    _kto("--loss_type apo_zero_unpaired", "--loss_type", "apo_zero_unpaired"),
    _kto("--desirable_weight 1.33", "--desirable_weight", "1.33"),
    _kto("--precompute_ref_log_probs true", "--precompute_ref_log_probs", "true"),
    _kto("--use_peft", "--use_peft", "true"),  # KTOConfig's disable_dropout=True zeroes LoRA's dropout too
    _kto("--gradient_checkpointing true", "--gradient_checkpointing", "true"),
    _reward("defaults", fast=True),
    _reward("--center_rewards_coefficient 0.01", "--center_rewards_coefficient", "0.01"),
    _reward("--pad_to_multiple_of 8", "--pad_to_multiple_of", "8"),
    # RewardConfig's disable_dropout=True (the default) also zeroes LoRA's dropout
    _reward("--use_peft --lora_task_type SEQ_CLS", "--use_peft", "true", "--lora_task_type", "SEQ_CLS"),
    _reward("--gradient_checkpointing true", "--gradient_checkpointing", "true"),
    _reward("--neftune_noise_alpha 5", "--neftune_noise_alpha", "5"),
    # Vision-language (issue 27): a tiny LLaVA / Gemma 3 saved with a real processor; images decoded by datasets
    Row("sft vision LLaVA (messages + images)", "sft", dataset="sft_vision", model="llava"),
    Row("sft vision Gemma 3 (messages + images)", "sft", dataset="sft_vision", model="gemma3"),
    Row("grpo vision LLaVA (prompt + image)", "grpo", dataset="grpo_vision", model="llava"),
    Row("grpo vision Gemma 3 (prompt + image)", "grpo", dataset="grpo_vision", model="gemma3"),
    Row("dpo vision LLaVA (prompt + image)", "dpo", dataset="dpo_vision", model="llava"),
)

COMMON = (
    "--bf16", "false", "--dtype", "float32", "--use_cpu", "true", "--seed", "0",
    "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
    "--weight_decay", "0", "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
    "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
)  # fmt: skip
BASE = {
    "sft": ("--train_sampling_strategy", "sequential"),
    "dpo": ("--per_device_train_batch_size", "2"),
    "grpo": (
        "--num_generations", "4", "--max_completion_length", "6", "--beta", "0.04",
        "--reward_funcs", f"{REWARDS}.length_reward",
    ),
    # At COMMON's rate 0.5 the first RLOO step collapses the groups (equal rewards: TRL's own later updates are zero,
    # so beta, num_iterations or clipping would change nothing); at 0.02 the second step moves the weights as much as
    # the first and beta changes the updates by 3%.
    "rloo": (
        "--num_generations", "4", "--max_completion_length", "6", "--beta", "0.04",
        "--reward_funcs", f"{REWARDS}.length_reward", "--learning_rate", "0.02",
    ),
    "kto": (),  # KTOConfig samples sequentially, as its KL term needs
    "reward": ("--per_device_train_batch_size", "2"),
}  # fmt: skip


# ----------------------------------------------------------------------------------------------- the swap
def swapped_source(source: str) -> str:
    """``source`` with every ``from trl import`` line's ``SWAP`` names imported from hf_tree under TRL's names.

    Raises:
        ValueError: when no name was swapped (TRL's script changed shape).
    """
    swapped = 0

    def swap(match: re.Match) -> str:
        nonlocal swapped
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",")]
        kept = [n for n in names if n not in SWAP]
        lines = [f"{indent}from trl import {', '.join(kept)}"] if kept else []
        for name in names:
            if name in SWAP:
                module, tree_name = SWAP[name]
                lines.append(f"{indent}from {module} import {tree_name} as {name}")
                swapped += 1
        return "\n".join(lines)

    result = re.sub(r"^([ \t]*)from trl import ([A-Za-z_, ]+)$", swap, source, flags=re.MULTILINE)
    if swapped < 2:
        raise ValueError(f"swapped {swapped} TRL names; expected the trainer and its config")
    return result


def load_script(script: str, swapped: bool, folder: pathlib.Path):
    """TRL's ``trl/scripts/{script}.py`` as a fresh module, as shipped or from a swapped copy in ``folder``."""
    path = SCRIPTS / f"{script}.py"
    if swapped:
        copy_path = folder / f"{script}_swapped.py"
        copy_path.write_text(swapped_source(path.read_text()))
        path = copy_path
    spec = importlib.util.spec_from_file_location(f"trl_parity_{script}_{int(swapped)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------- model and data
def eos_bias(model: torch.nn.Module, eos_id: int, probability: float = 0.2) -> None:
    """Make ``eos_id`` about ``probability`` likely at every position of the random tiny model.

    A constant offset in one embedding channel survives the two layers and the final norm as a positive feature;
    the end-of-sequence row of the head reads it. Without this, sampling from 49152 near-uniform logits never ends
    a completion, so ``mask_truncated_completions`` would mask everything.
    """
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 2.0
        probe = torch.randint(0, model.config.vocab_size, (8, 16))
        hidden = model.model(input_ids=probe).last_hidden_state[..., 0]
        head = model.lm_head.weight
        head[eos_id] = 0.0
        others = torch.logsumexp(model.lm_head(model.model(input_ids=probe).last_hidden_state), dim=-1).mean()
        target = float(others) + torch.log(torch.tensor(probability / (1 - probability)))
        head[eos_id, 0] = target / hidden.mean()


def write_setup(folder: pathlib.Path) -> dict[str, str]:
    """Save the tiny model + SmolLM2 tokenizer and the datasets (one per script, and SFT messages) under ``folder``;
    returns their paths."""
    tokenizer = smollm2_tokenizer_or_skip()
    models = (("model", "llama", {}), ("moe_model", "qwen3_moe", {}), ("mla_model", "deepseek_v3", TINY_DEEPSEEK_V3))
    for name, family, settings in models:
        model = tiny_model(family, vocab_size=len(tokenizer), dtype=torch.float32, attn="sdpa", **settings)
        if not os.environ.get("NO_EOS_BIAS"):
            eos_bias(model, tokenizer.eos_token_id)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    questions = ["The capital of France is", "Two plus two is", "Water boils at", "The sky is", "Cats like to"]
    answers = [" Paris.", " Paris, on the Seine.", " a city.", " Lyon? No, Paris."]
    data = {
        "sft": [{"prompt": q, "completion": f"{a} ({i})"} for q in questions for i, a in enumerate(answers)],
        "dpo": [
            {"prompt": q, "chosen": f" {i} good answer.", "rejected": f" bad answer {i}."}
            for i, q in enumerate(questions[:4])
        ],
        "grpo": [{"prompt": q} for q in questions[:2]],
        # unpaired rows, each prompt's 4 answers listed together (half of them desirable)
        "kto": [
            {"prompt": q, "completion": a, "label": i % 2 == 0} for q in questions[:3] for i, a in enumerate(answers)
        ],
        # conversations (8 rows, two turns in half of them): each row is one branch, TRL's rendering
        "sft_messages": [
            {
                "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                + ([{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}] if i % 2 else [])
            }
            for i, (q, a) in enumerate(zip(questions[:4] * 2, answers * 2))
        ],
    }
    paths = {name: str(folder / name) for name, _, _ in models}
    for script, rows in data.items():
        (folder / script).mkdir()
        (folder / script / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[script] = str(folder / script)
    return paths | write_vision_setup(folder)


def write_vision_setup(folder: pathlib.Path) -> dict[str, str]:
    """Tiny vision-language models saved with their real processors (word-level tokenizers: ``w{i}`` is token ``i``)
    and image datasets (parquet, images decoded by ``datasets``): the same question about two pictures forks at the
    image, two questions about one picture share it."""
    import datasets
    from PIL import Image

    from tests.vision_models import PROCESSORS, tiny_vlm

    paths = {}
    for family, processor in PROCESSORS.items():
        tiny_vlm(family, dtype=torch.float32, attn="sdpa").save_pretrained(folder / family)
        processor().save_pretrained(folder / family)
        paths[family] = str(folder / family)
    red, blue = Image.new("RGB", (8, 8), (200, 30, 30)), Image.new("RGB", (8, 8), (30, 30, 200))
    asked = [(red, "w5 w6", "w7 w8"), (blue, "w5 w6", "w9"), (red, "w10 w11", "w12 w13 w14"), (blue, "w10 w11", "w15")]

    def question(text: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]

    def answer(text: str) -> list[dict]:
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    tables = {
        "sft_vision": {
            "messages": [question(q) + answer(a) for _, q, a in asked],
            "images": [[i] for i, _, _ in asked],
        },
        "grpo_vision": {"prompt": [question(q) for _, q, _ in asked[:2]], "image": [i for i, _, _ in asked[:2]]},
        "dpo_vision": {
            "prompt": [question(q) for _, q, _ in asked],
            "chosen": [answer(a) for _, _, a in asked],
            "rejected": [answer("w16 " + a) for _, _, a in asked],
            "image": [i for i, _, _ in asked],
        },
    }
    for name, columns in tables.items():
        (folder / name).mkdir()
        datasets.Dataset.from_dict(columns).to_parquet(str(folder / name / "train.parquet"))
        paths[name] = str(folder / name)
    return paths


# ----------------------------------------------------------------------------------------------- running a row
@contextlib.contextmanager
def recorded_training(records: list[dict]) -> Iterator[None]:
    """Record, for each ``Trainer.train`` call, the trainer and its trainable parameters before and after."""
    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        before = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        record = {"trainer": self, "before": before}
        records.append(record)
        result = original(self, *args, **kwargs)
        record["updates"] = {n: p.detach() - before[n] for n, p in self.model.named_parameters() if p.requires_grad}
        return result

    transformers.Trainer.train = train
    try:
        yield
    finally:
        transformers.Trainer.train = original


def run_script(row: Row, swapped: bool, paths: dict[str, str], folder: pathlib.Path) -> dict:
    """Run one script; returns the recorded training (``updates``, ``trainer``) or ``{"error": exception}``."""
    out = folder / ("tree" if swapped else "trl")
    argv = [
        "--model_name_or_path", paths[row.model], "--dataset_name", paths[row.dataset or row.script],
        "--output_dir", str(out),
        *COMMON, *BASE[row.script], *row.flags,
    ]  # fmt: skip
    records: list[dict] = []
    warnings = _WarningLog()
    logging.getLogger("hf_tree").addHandler(warnings)
    transformers.set_seed(0)  # LoRA initialisation and sampling draw from the global generators
    try:
        module = load_script(row.script, swapped, folder)
        parser = module.make_parser()
        arguments = parser.parse_args_and_config(args=argv, fail_with_unknown_args=False)
        with recorded_training(records):
            module.main(*arguments)
    except Exception as error:  # noqa: BLE001 -- every outcome is reported, a crash included
        return {"error": error, "trained": bool(records), "traceback": traceback.format_exc()}
    finally:
        logging.getLogger("hf_tree").removeHandler(warnings)
    return {**records[0], "warnings": warnings.messages}


class _WarningLog(logging.Handler):
    """Collects the hf_tree warnings of one run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_row(row: Row, paths: dict[str, str]) -> Outcome:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trl = run_script(row, False, paths, pathlib.Path(tmp))
        if "error" in trl:
            return Outcome(
                row, "CRASH", f"TRL's own script failed: {trl['error']!r}", seconds=time.perf_counter() - start
            )
        tree = run_script(row, True, paths, pathlib.Path(tmp))
    seconds = time.perf_counter() - start
    if "error" in tree:
        error = tree["error"]
        if isinstance(error, ValueError) and not tree["trained"]:
            return Outcome(row, "refused", str(error).split("\n")[0][:160], seconds=seconds)
        return Outcome(row, "CRASH", f"{type(error).__name__}: {str(error)[:200]}", seconds=seconds)
    steps = (trl["trainer"].state.global_step, tree["trainer"].state.global_step)
    theirs, ours = trl["updates"], tree["updates"]
    if theirs.keys() != ours.keys():
        return Outcome(row, "MISMATCH", "different trainable parameters", steps, seconds=seconds)
    if not any(float(u.norm()) > 0 for u in theirs.values()):
        return Outcome(row, "MISMATCH", "TRL's run did not move the weights: nothing compared", steps, seconds=seconds)
    error = update_difference(ours, theirs)
    extra = {"rows_per_step": _last_log(tree["trainer"], "rows_per_step")}
    state = "exact" if steps[0] == steps[1] and error <= EXACT_TOLERANCE else "MISMATCH"
    if state == "MISMATCH" and row.padding_noise and steps[0] == steps[1]:
        noise_flags = UNPADDED_FLAGS if "--pad_to_multiple_of" in row.flags else PADDING_NOISE_FLAGS
        with tempfile.TemporaryDirectory() as tmp:
            other = run_script(dataclasses.replace(row, flags=row.flags + noise_flags), False, paths, pathlib.Path(tmp))
        noise = update_difference(other["updates"], theirs) if "updates" in other else 0.0
        if error <= 2 * noise:
            note = f"TRL itself moves by {noise:.1e} when only its padding changes"
            return Outcome(row, "float32 noise", note, steps, error, time.perf_counter() - start, extra)
    if state == "MISMATCH" and row.dropout and any(DROPOUT_WARNING in m for m in tree["warnings"]):
        note = "dropout: one mask per shared token (hf_tree.models.dropout)"
        return Outcome(row, "warned", note, steps, error, seconds)
    return Outcome(row, state, "", steps, error, seconds, extra)


def update_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Largest per-parameter ``|ours - theirs| / max(|theirs|, UPDATE_FLOOR * largest |theirs|)`` (Frobenius)."""
    floor = UPDATE_FLOOR * max(float(u.norm()) for u in theirs.values())
    return max(float((ours[n] - u).norm()) / max(float(u.norm()), floor) for n, u in theirs.items())


def _last_log(trainer, key: str) -> float | None:
    values = [h[key] for h in trainer.state.log_history if key in h]
    return values[-1] if values else None


def setup_paths(folder: pathlib.Path) -> dict[str, str]:
    return write_setup(folder)


def format_table(outcomes: list[Outcome]) -> str:
    lines = [
        "| script and options | state | optimizer steps TRL / swapped | max rel. update diff | note |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        steps = f"{o.steps[0]} / {o.steps[1]}" if o.steps else ""
        error = f"{o.error:.1e}" if o.error is not None else ""
        lines.append(f"| {o.row.name} | {o.state} | {steps} | {error} | {o.detail} |")
    return "\n".join(lines)


def entropy_threshold_flips(num_batches: int = 300, quantiles: tuple[float, ...] = (0.3, 0.5, 0.8)) -> dict:
    """How often GRPO's high-entropy mask (``top_entropy_quantile``) changes under float32 rounding alone.

    On random GRPO micro-batches (one prompt, G = 8 completions of 1-16 tokens, the tiny float32 model of the tests),
    compares TRL's mask with (a) TRL's own mask when only 3 columns of left padding are added and (b) the tree
    trainer's mask. Returns ``{"batches": n, "trl_with_more_padding": flips, "tree": flips}``.
    """
    import random

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from tests.helpers import TINY, saved_tiny_model, tiny_trl_config, word_tokenizer

    def reward(completions, **_):
        return [0.0] * len(completions)

    with tempfile.TemporaryDirectory() as tmp:
        path = saved_tiny_model(tmp, torch.float32)
        setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
        trl, tree = (
            trainer(path, reward, tiny_trl_config(config, path, torch.float32, num_generations=4), **setup)
            for trainer, config in ((GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig))
        )
        rng, flips, total = random.Random(0), {"trl_with_more_padding": 0, "tree": 0}, 0
        for _ in range(num_batches):
            prompt = [rng.randrange(3, TINY["vocab_size"]) for _ in range(rng.randint(3, 12))]
            completions = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(rng.randint(1, 16))] for _ in range(8)]
            keep = max(map(len, completions))
            ids = torch.zeros(8, len(prompt) + keep, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, completion in enumerate(completions):
                ids[row, : len(prompt)], ids[row, len(prompt) : len(prompt) + len(completion)] = (
                    torch.tensor(prompt),
                    torch.tensor(completion),
                )
                mask[row, : len(prompt) + len(completion)] = 1
            padded_ids, padded_mask = (torch.cat([torch.zeros_like(t[:, :3]), t], 1) for t in (ids, mask))
            runs = {
                "trl": (trl, ids, mask),
                "trl_with_more_padding": (trl, padded_ids, padded_mask),
                "tree": (tree, ids, mask),
            }
            with torch.no_grad():
                entropies = {
                    name: trainer._get_per_token_logps_and_entropies(
                        trainer.model, run_ids, run_mask, keep, compute_entropy=True
                    )[1]
                    for name, (trainer, run_ids, run_mask) in runs.items()
                }
            completion_mask = mask[:, -keep:]
            for quantile in quantiles:
                masks = {k: trl.get_high_entropy_mask(e, completion_mask, 1 - quantile) for k, e in entropies.items()}
                for name in flips:
                    flips[name] += int(bool((masks[name] ^ masks["trl"]).any()))
                total += 1
    return {"batches": total, **flips}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="run the rows whose name starts with this")
    parser.add_argument("--fast", action="store_true", help="only the rows of the unmarked test subset")
    parser.add_argument(
        "--entropy-threshold-flips",
        action="store_true",
        help="instead of the table: how often float32 rounding alone changes GRPO's top_entropy_quantile mask",
    )
    args = parser.parse_args()
    if args.entropy_threshold_flips:
        print(entropy_threshold_flips())
        return 0
    rows = [r for r in ROWS if (args.only is None or r.name.startswith(args.only)) and (r.fast or not args.fast)]
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = setup_paths(pathlib.Path(tmp))
        for row in rows:
            outcome = run_row(row, paths)
            outcomes.append(outcome)
            print(
                f"{row.name}: {outcome.state} {outcome.error} {outcome.steps} {outcome.detail} "
                f"({outcome.seconds:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
    print(format_table(outcomes))
    failures = [o for o in outcomes if o.state not in STATES]
    counts = ", ".join(f"{sum(o.state == s for o in outcomes)} {s}" for s in STATES)
    print(f"\n{len(outcomes)} rows: {counts}; {len(failures)} failures (MISMATCH or CRASH)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
