"""launch/train.py: config parsing, data loading, the check of what the final save wrote, and short runs on a tiny
model (in-process, and under ``accelerate launch`` with ``fsdp_configs/fsdp2_lora.json`` on 2 CPU processes and a
YAML config). The no-argument default (SmolLM2 + LoRA, minutes) is the README's main job and is only parsed here."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tree import Tree
from hf_tree import launcher as train
from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.data.formats import to_builder_rows
from hf_tree.data.sources import AGENT_TEMPLATE, chat_template_file
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from tests.helpers import QWEN3_TEMPLATE, SMOLLM2_VOCAB, launch_command, max_relative_error, tiny_model
from tests.workloads import prompt_completion_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and tied embeddings (as SmolLM2), saved like a hub checkpoint."""
    path = tmp_path_factory.mktemp("tiny-smollm2")
    model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa", tie_word_embeddings=True)
    model.save_pretrained(path)
    load_smollm2_tokenizer().save_pretrained(path)
    return path


def test_no_arguments_is_the_offline_lora_default():
    model, data, lora, config = train.parse_arguments([])
    assert model.model_name_or_path == train.OFFLINE_MODEL and data.dataset_name == train.SYNTHETIC_DATASET
    peft_config = train.peft_config(model, lora, tiny_model())
    assert model.use_peft and peft_config.r == train.DEFAULT_RUN["lora_r"]
    assert peft_config.layers_to_transform == train.DEFAULT_MODEL_RUN["lora_layers_to_transform"]
    assert set(peft_config.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert config.max_steps == train.DEFAULT_RUN["max_steps"] and config.output_dir == train.DEFAULT_RUN["output_dir"]
    # the agent job trains per-turn trees, rendered with the Qwen3 template as is (it drops earlier reasoning)
    assert config.messages_branches == "per_turn" and not config.assistant_only_loss


def test_config_file_then_cli_flags(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"lora_r": 4, "use_peft": True, "max_steps": 7, "normalization": "sequence"}))
    model, _, _, config = train.parse_arguments(["--config", str(path), "--max_steps", "3"])
    assert (model.lora_r, model.use_peft, config.max_steps, config.normalization) == (4, True, 3, "sequence")
    path.write_text(json.dumps({"lora_rank": 4}))
    with pytest.raises(ValueError, match="lora_rank"):
        train.parse_arguments(["--config", str(path)])


def test_flags_refine_the_default_job():
    """`--max_steps 4` is the default job with 4 steps; another model keeps the job but not SmolLM2's LoRA layers,
    other data not the agent data's settings."""
    model, data, lora, config = train.parse_arguments(["--max_steps", "4"])
    default_model, default_data, default_lora, default_config = train.parse_arguments([])
    assert config.max_steps == 4 and default_config.max_steps == train.DEFAULT_RUN["max_steps"]
    assert (model, data, lora) == (default_model, default_data, default_lora)
    assert {**config.to_dict(), "max_steps": 0} == {**default_config.to_dict(), "max_steps": 0}
    model, data, lora, config = train.parse_arguments(["--model_name_or_path", "some/model", "--dataset_name", "x"])
    assert model.use_peft and config.learning_rate == train.DEFAULT_RUN["learning_rate"]
    assert lora.lora_layers_to_transform is None and data.dataset_test_split is None
    assert config.messages_branches != "per_turn"


def test_trl_model_config_flags():
    """TRL's ModelConfig flags (those of `trl sft`) reach the PEFT and bitsandbytes configs through TRL's helpers."""
    from trl import get_quantization_config

    argv = ["--use_dora", "--lora_modules_to_save", "lm_head", "--lora_target_modules", "q_proj", "v_proj"]
    argv += ["--load_in_4bit", "--bnb_4bit_quant_type", "fp4", "--attn_implementation", "eager"]
    model, _, lora, _ = train.parse_arguments(argv)
    peft_config = train.peft_config(model, lora, tiny_model())
    assert peft_config.use_dora and peft_config.modules_to_save == ["lm_head"]
    assert set(peft_config.target_modules) == {"q_proj", "v_proj"}
    assert peft_config.layers_to_transform == [26, 27, 28, 29]
    quantization = get_quantization_config(model)
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "fp4"


def test_hf_tree_train_is_the_launcher(capsys):
    """`hf-tree train --help` is the launcher's help: TRL's model flags, the tree flags, the launcher's own."""
    from hf_tree.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: hf-tree train")
    assert all(flag in usage for flag in ("--load_in_4bit", "--use_dora", "--max_packed_tokens", "--max_eval_samples"))


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_syntax_error_names_the_file_and_line(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    path.write_text('{\n  "max_steps": 4,\n  "lora_r" 8\n}\n' if suffix == ".json" else "max_steps: 4\nlora_r: [8\n")
    with pytest.raises(ValueError, match=rf"--config {path}, line [2-4]: .*not valid"):
        train.parse_arguments(["--config", str(path)])


def test_lora_output_loads_with_the_standard_api(tmp_path, tiny_model_dir, capsys, caplog):
    """The saved adapter loads offline with AutoPeftModelForCausalLM (its base is a real checkpoint folder) and
    generates; the run reports the held-out loss before and after and writes the loss curve beside the adapter;
    a run shorter than logging_steps still reports its throughput. The job's defaults raise no warning of hf_tree's,
    each evaluation is announced, and the summary's time is Trainer's train_runtime."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--synthetic_num_conversations", "2"]
    argv += ["--max_steps", "2", "--learning_rate", "1e-2", "--output_dir", str(out)]
    summary = train.main(argv)
    assert summary["tree_tokens_per_second"] > 0  # logging_steps (4) > max_steps
    assert summary["eval_loss"] < summary["eval_loss_before"]
    printed = capsys.readouterr().out
    for when in ("before training", "after training"):
        assert re.search(rf"hf_tree: evaluating the held-out loss on \d+ rows \({when}\) \.\.\.", printed)
    assert f"train_runtime {summary['train_runtime']:.0f} s, {summary['train_eval_seconds']:.0f} s of it" in printed
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("hf_tree") and r.levelname == "WARNING"]
    assert (out / train.LOSS_CURVE).stat().st_size > 0
    model = AutoPeftModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_bad_input_gets_one_line_before_the_model_loads(tmp_path, tiny_model_dir):
    """Preference rows name DPO/reward training; a missing data file or local model folder is named; a branch longer
    than a row stops the run before training (at the packing plan, not inside the first step)."""
    preference = tmp_path / "pairs.jsonl"
    preference.write_text(json.dumps({"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."}) + "\n")
    with pytest.raises(ValueError, match=r"preference rows .* `hf-tree dpo` .* `hf-tree reward`"):
        train.main(["--dataset_name", str(preference)])
    with pytest.raises(ValueError, match=r"data '.*missing.jsonl' does not exist"):
        train.main(["--dataset_name", str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match=r"model_name_or_path='.*no-model' is not a folder"):
        train.main(["--model_name_or_path", str(tmp_path / "no-model"), "--synthetic_num_conversations", "1"])
    data = tmp_path / "data.jsonl"
    prompt_completion_dataset().to_json(data)
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--max_packed_tokens", "16"]
    argv += ["--overlong", "error"]  # TreeSFTConfig's default "truncate" would cut the branch (counted) and train
    with pytest.raises(ValueError, match=r"more than max_branch_tokens=16"):
        train.main([*argv, "--output_dir", str(tmp_path / "out"), "--tree_self_check", "False"])


def test_context_parallel_flags_reach_the_config():
    _, _, _, config = train.parse_arguments(
        ["--context_parallel_strategy", "naive", "--context_parallel_chunks_per_rank", "2"]
    )
    options = config.context_parallel_config()
    assert (options.strategy, options.chunks_per_rank) == ("naive", 2)
    with pytest.raises(ValueError, match="invalid choice: 'ring'"):  # outside ContextParallelConfig's choices
        train.parse_arguments(["--context_parallel_strategy", "ring"])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", "folder"])
def test_local_datasets_load(tmp_path, suffix):
    dataset = prompt_completion_dataset()
    path = tmp_path / f"data{suffix if suffix != 'folder' else ''}"
    if suffix == ".jsonl":
        dataset.to_json(path)
    elif suffix == ".parquet":
        dataset.to_parquet(path)
    else:
        dataset.save_to_disk(path)
    loaded = train.load_split(train.DataArguments(dataset_name=str(path)), "train")
    # files are read as `hf-tree stats` reads them (messages normalised); a saved folder is used as is
    expected = dataset if suffix == "folder" else to_builder_rows(dataset.to_list())[0]
    assert loaded.to_list() == expected.to_list()


def test_full_fine_tuning_run_in_process(tmp_path, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    prompt_completion_dataset().to_json(data)
    out = tmp_path / "out"
    argv = [
        "--model_name_or_path",
        str(tiny_model_dir),
        "--dataset_name",
        str(data),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--dataset_test_split",
        "train",
        "--use_peft",
        "False",  # the default job's LoRA, refined to full fine-tuning
    ]
    summary = train.main(argv)
    # one tree per row (TRL's rows); a micro-batch's rows share their chat template's start at least when merged
    assert summary["dedup_ratio"] == 1.0 and summary["train_dedup_ratio"] > 1.0
    assert summary["tree_tokens_per_second"] > 0
    assert torch.isfinite(torch.tensor([summary["train_loss"], summary["eval_loss"]])).all()
    assert (out / "model.safetensors").exists() and not (out / "adapter_model.safetensors").exists()


def test_missing_saved_files_names_what_a_reload_needs(tmp_path):
    assert train.missing_saved_files(str(tmp_path), peft=True) == ["adapter_config.json", "adapter_model.safetensors"]
    assert train.missing_saved_files(str(tmp_path), peft=False) == ["config.json", "model.safetensors"]
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").touch()  # empty: not a save
    assert train.missing_saved_files(str(tmp_path), peft=True) == ["adapter_model.safetensors"]
    save_file({}, tmp_path / "adapter_model.safetensors")  # a valid file without tensors: not a save either
    assert train.missing_saved_files(str(tmp_path), peft=True) == ["adapter_model.safetensors"]
    save_file({"a": torch.ones(1)}, tmp_path / "adapter_model.safetensors")
    assert train.missing_saved_files(str(tmp_path), peft=True) == []
    (tmp_path / "config.json").write_text("{}")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"a": torch.ones(1)}, tmp_path / "model-00001-of-00002.safetensors")
    assert train.missing_saved_files(str(tmp_path), peft=False) == ["model-00002-of-00002.safetensors"]


def test_check_saved_refuses_an_empty_output_dir(tmp_path):
    args = TreeTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = TreeTrainer(model=tiny_model(dtype=torch.float32), args=args)
    with pytest.raises(ValueError, match=r"no complete LoRA adapter.*adapter_model\.safetensors.*distributed_type=NO"):
        train.check_saved(trainer, str(tmp_path / "empty"), peft=True)
    trainer.save_model(str(tmp_path / "saved"))
    train.check_saved(trainer, str(tmp_path / "saved"), peft=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_run_under_fsdp2_launch_saves_the_single_process_adapter(tmp_path, tiny_model_dir):
    """The documented FSDP2 LoRA command (its SHARDED_STATE_DICT config, 2 CPU processes, a YAML run config) leaves
    an adapter that reloads and equals the adapter of the same global batch trained in one process."""
    config = {
        "model_name_or_path": str(tiny_model_dir),
        "synthetic_num_conversations": 4,
        "synthetic_max_user_turns": 2,
        "synthetic_max_tool_steps": 1,
        "use_peft": True,
        "lora_r": 4,
        "lora_dropout": 0.0,  # ranks would draw other dropout masks than one process
        "chat_template_path": QWEN3_TEMPLATE,
        "max_length": None,
        "max_steps": 5,
        "learning_rate": 1e-3,
        "train_sampling_strategy": "sequential",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    command = [
        *launch_command(REPO / "fsdp_configs" / "fsdp2_lora.json"),
        str(REPO / "launch" / "train.py"),
        "--config",
        str(path),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "1",
        "--output_dir",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "FSDP2 is enabled on CPU" in result.stderr
    assert "dedup ratio" in result.stdout and "trained 2 steps" in result.stdout  # the CLI flag beat the file
    assert f"LoRA adapter saved to {out}" in result.stdout

    single = tmp_path / "single"
    train.main(
        ["--config", str(path), "--max_steps", "2", "--per_device_train_batch_size", "2", "--output_dir", str(single)]
    )
    saved, expected = load_file(out / "adapter_model.safetensors"), load_file(single / "adapter_model.safetensors")
    assert saved.keys() == expected.keys()
    assert max_relative_error(saved, expected) <= 1e-4  # float32 AdamW on gloo vs one process
    # it reloads onto the base as the trained adapter (lora_B starts at zero: training moved it)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    adapter = {n.replace(".default", ""): p.detach() for n, p in reloaded.named_parameters() if "lora_" in n}
    assert max_relative_error(adapter, saved) == 0.0
    assert all(p.abs().sum() > 0 for n, p in adapter.items() if "lora_B" in n)


# Tool-call arguments as objects, one with a non-ASCII value: `formats.normalize_messages` stores them as JSON text
# (`json.dumps`, so "\u00fc"), while the rows `datasets.load_dataset("json")` returns keep the object, which the
# template renders with `tojson` ("ü"); so a loader that skips the normaliser builds other tokens. The first
# assistant turn's content is null (the normaliser makes it "").
TOOL_CALL_RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "Weather in Zürich, then find a cafe."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}],
            },
            {"role": "tool", "content": "sunny"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "cafe"}}}],
            },
            {"role": "tool", "content": "Cafe de Flore"},
            {"role": "assistant", "content": "Sunny; try Cafe de Flore."},
        ]
    },
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]


@pytest.mark.parametrize("data", ["file", "default job"])
def test_launcher_and_hf_tree_stats_build_the_same_trees(tmp_path, capsys, data):
    """The launcher's data path (load_split -> TreeSFTTrainer) and `hf-tree stats --save-trees` give identical
    trees (both read the data through hf_tree.data.sources): on one messages file, and on the main job's data, where
    `hf-tree stats builtin:synthetic-agent` with its defaults reports the dedup and branch count the job trains."""
    from hf_tree.cli import main as cli_main
    from hf_tree.tree import TREE_KEYS
    from hf_tree.trl.sft import TreeSFTTrainer

    saved = tmp_path / "stats-trees"
    argv = ["--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    if data == "file":
        path = tmp_path / "agent.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in TOOL_CALL_RECORDS) + "\n")
        batch = ["--per_device_train_batch_size", "2"]  # the launcher's default 1 merges no rows in training
        cli_main(["stats", str(path), "--chat-template", "qwen3", "--json", "--save-trees", str(saved), *batch])
        argv += ["--dataset_name", str(path), *batch]  # both at TreeSFTConfig's defaults: TRL's rows
    else:
        cli_main(["stats", train.SYNTHETIC_DATASET, "--json", "--save-trees", str(saved)])
    reported = json.loads(capsys.readouterr().out)
    from_stats = datasets.load_from_disk(str(saved)).select_columns(list(TREE_KEYS)).to_list()

    tokenizer = load_smollm2_tokenizer()
    model_args, data_args, _, config = train.parse_arguments(argv)
    config.chat_template_path = train.default_chat_template_path(model_args, data_args)  # as main() does: qwen3
    rows = train.first_rows(train.load_split(data_args, data_args.dataset_train_split), data_args.max_train_samples)
    trainer = TreeSFTTrainer(
        model=tiny_model(vocab_size=len(tokenizer), dtype=torch.float32),
        args=config,
        train_dataset=rows,
        processing_class=copy.deepcopy(tokenizer),
    )
    from_launcher = trainer.train_dataset.select_columns(list(TREE_KEYS)).to_list()
    expected_trees = 2 if data == "file" else train.DEFAULT_DATA_RUN["synthetic_num_conversations"]
    assert len(from_stats) == expected_trees and from_launcher == from_stats
    trees = [Tree.from_dict(row) for row in trainer.train_dataset]  # what main() reports
    assert reported["num_branches"] == sum(t.num_branches for t in trees)
    assert reported["dedup_ratio"] == pytest.approx(
        sum(t.num_branch_tokens for t in trees) / sum(t.num_tokens for t in trees), rel=1e-12
    )
    train.check_and_report_trees(trainer, num_rows=len(rows))  # main()'s start-up line: TRL's micro-batches too
    planned = f"planned dedup in training {reported['training_dedup_ratio']:.2f}"
    assert (planned in capsys.readouterr().out) == (config.batch_unit == "rows")  # the default job deals trees


def test_builtin_datasets_and_their_template_in_the_launcher():
    """The launcher reads the CLI's built-in names (and its old spelling), and gives agent data the template
    `hf-tree stats` gives it, whatever the model."""
    options = [
        "--synthetic_num_conversations",
        "2",
        "--synthetic_max_user_turns",
        "1",
        "--synthetic_max_tool_steps",
        "1",
    ]
    rows = {}
    for name in ("builtin:synthetic-agent", "synthetic:agent"):
        model_args, data_args, _, _ = train.parse_arguments(
            ["--model_name_or_path", "some/model", "--dataset_name", name, *options]
        )
        rows[name] = train.load_split(data_args, "train").to_list()
        assert train.default_chat_template_path(model_args, data_args) == chat_template_file(AGENT_TEMPLATE)
    assert len(rows["synthetic:agent"]) == 2 and rows["synthetic:agent"] == rows["builtin:synthetic-agent"]
    model_args, data_args, _, _ = train.parse_arguments(
        ["--model_name_or_path", "some/model", "--dataset_name", "x.jsonl"]
    )
    assert train.default_chat_template_path(model_args, data_args) is None  # the model's own template


@pytest.mark.slow  # the vision trees' exactness is tests/test_vision_*.py's; this is the launcher's plumbing
def test_vision_language_model_on_builtin_shapes(tmp_path, monkeypatch):
    """A vision-language checkpoint (LLaVA, saved with its processor) on the offline image questions: the launcher
    loads the model and processor, builds one tree per image (``--group_by image_id``), each image stored once,
    trains and saves the adapter. The text builders refuse the image rows instead of dropping their images."""
    pytest.importorskip("PIL.Image")  # hf_tree[vision]
    from hf_tree.data.sources import load_tree_rows
    from hf_tree.vision.media_tree import MediaTree
    from tests.vision_models import llava_processor, tiny_vlm

    path = tmp_path / "llava"
    tiny_vlm("llava", dtype=torch.float32, attn="sdpa").save_pretrained(path)
    llava_processor().save_pretrained(path)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(path), "--dataset_name", "builtin:shapes", "--group_by", "image_id"]
    argv += ["--max_train_samples", "8", "--max_steps", "2", "--per_device_train_batch_size", "1", "--use_peft"]
    argv += ["--output_dir", str(out), "--report_to", "none", "--save_strategy", "no", "--max_packed_tokens", "512"]
    captured = {}
    original = train.TreeSFTTrainer.train

    def keep_trainer(trainer, *args, **kwargs):  # the trainer main() builds, to inspect its dataset
        captured["trainer"] = trainer
        return original(trainer, *args, **kwargs)

    monkeypatch.setattr(train.TreeSFTTrainer, "train", keep_trainer)
    summary = train.main(argv)
    rows = train.load_split(train.parse_arguments(argv)[1], "train").select(range(8))
    trees = [MediaTree.from_dict(row) for row in captured["trainer"].train_dataset]
    assert len(trees) == len(set(rows["image_id"])) and all(len(tree.media) == 1 for tree in trees)
    assert sum(tree.tree.num_branches for tree in trees) == len(rows)  # every row trained
    assert torch.isfinite(torch.tensor(summary["train_loss"]))
    assert PeftModel.from_pretrained(tiny_vlm("llava", dtype=torch.float32), out) is not None
    with pytest.raises(ValueError, match="image rows"):
        load_tree_rows("builtin:shapes", load_smollm2_tokenizer, limit=1)


@pytest.mark.slow  # depth-first's exactness is tests/test_depth_first.py's; this is the launcher's plumbing
def test_trees_larger_than_a_row_run_depth_first_from_the_launcher(tmp_path, tiny_model_dir, monkeypatch):
    """``--tree_execution auto`` reaches the trainer: agent trees longer than ``--max_packed_tokens`` run depth-first
    (every tree is trained, none split), and the run trains and saves."""
    import hf_tree.depth_first_runner

    calls = []
    original = hf_tree.depth_first_runner.depth_first_backward

    def counted(model, trees, *args, **kwargs):  # the real executor, counting the trees it runs
        calls.append(len(trees))
        return original(model, trees, *args, **kwargs)

    monkeypatch.setattr(hf_tree.depth_first_runner, "depth_first_backward", counted)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", "builtin:synthetic-agent"]
    argv += ["--synthetic_num_conversations", "4", "--synthetic_max_user_turns", "2", "--synthetic_max_tool_steps", "1"]
    argv += ["--messages_branches", "per_turn", "--tree_execution", "auto", "--max_packed_tokens", "256"]
    argv += ["--max_steps", "2", "--per_device_train_batch_size", "2", "--output_dir", str(out)]
    argv += ["--report_to", "none", "--save_strategy", "no", "--max_length", "4096", "--use_peft", "False"]
    summary = train.main(argv)
    assert sum(calls) >= 1 and torch.isfinite(torch.tensor(summary["train_loss"]))
    assert (out / "model.safetensors").exists()
