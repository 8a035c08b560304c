"""GRPO training steps with groups cut by ``per_device_train_batch_size``: the policy pass per micro-batch (TRL's
own, hf_tree's packed tree) vs one prompt forward per optimizer step (``tree_share_across_microbatches=True``).

One prompt of ``--prompt-len`` tokens and ``--generations`` fixed completions of ``--completion-len`` tokens
(TRL's ``rollout_func`` hook: no sampling), micro-batches of ``--batch`` rows, ``--accumulation`` of them per
optimizer step, ``num_iterations=1`` and ``beta=0`` (TRL then runs neither an old-policy nor a reference pass: only
the policy pass is timed). Printed per method: tokens the backbone forwarded with gradients per optimizer step
(a forward hook) and the median of TRL's logged ``step_time`` over ``--repeats`` steps after one warm-up step;
with ``--memory``, the peak bytes torch's CPU allocator holds during a separate one-step run (optimizer state
included, the same for every method).

    PYTHONPATH=. python benchmarks/grpo_shared_prompts.py            # 256 + 8 x 32, micro-batches of 2, GA 4
    PYTHONPATH=. python benchmarks/grpo_shared_prompts.py --quick    # smoke test

Under ``accelerate launch --num_processes 2`` (DDP; on CPU with ``ACCELERATE_USE_CPU=true``) each rank trains its own
group of ``--generations`` and prints its own table.

The model is a random float32 Llama (speed does not depend on the weights), one thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from hf_tree.models.introspection import backbone_of
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer

METHODS = ("trl", "packed", "shared")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (TRL's default)")
    parser.add_argument("--memory", action="store_true", help="also a one-step run under the memory profiler")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.completion_len, args.layers, args.hidden, args.vocab, args.repeats = 24, 4, 2, 32, 128, 1
    return args


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, vocab)}}
    inner = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


class Counter:
    """Tokens the policy's backbone forwards with gradients on."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self.handle = backbone_of(model).register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and ids is not None:
            self.tokens += ids.numel()


def run(method: str, path: str, args: argparse.Namespace, steps: int | None = None):
    """The trainer of ``method`` for ``steps`` optimizer steps (default ``1 + --repeats``), not yet trained."""
    generator = torch.Generator().manual_seed(0)
    prompt = " ".join(f"w{int(i)}" for i in torch.randint(3, args.vocab, (args.prompt_len,), generator=generator))
    completions = torch.randint(3, args.vocab, (args.generations, args.completion_len), generator=generator).tolist()

    def rollout(prompts, trainer):
        ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        chosen = [completions[i % len(completions)] for i in range(len(ids))]
        return {"prompt_ids": ids, "completion_ids": chosen, "logprobs": None}

    steps = steps or 1 + args.repeats
    common = dict(
        output_dir=f"{path}/out",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        num_iterations=1,
        beta=0.0,
        max_steps=steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=args.checkpointing,
        model_init_kwargs={"dtype": torch.float32},
    )
    if method == "trl":
        config, trainer_class = GRPOConfig(**common), GRPOTrainer
    else:
        shared = method == "shared"
        config, trainer_class = TreeGRPOConfig(**common, tree_share_across_microbatches=shared), TreeGRPOTrainer
    return trainer_class(
        path,
        lambda completions, **_: [0.0] * len(completions),
        config,
        train_dataset=Dataset.from_dict({"prompt": [prompt] * 4}),
        processing_class=tokenizer(args.vocab),
        rollout_func=rollout,
    )


def measure(method: str, path: str, args: argparse.Namespace) -> tuple[float, float, float | None]:
    """(tokens forwarded with gradients per optimizer step, median step seconds, peak MiB or None)."""
    trainer = run(method, path, args)
    counter = Counter(trainer.model)
    trainer.train()
    counter.handle.remove()
    times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    steps = trainer.state.global_step
    peak = None
    if args.memory:
        from _profiling import cpu_peak_bytes

        peak = cpu_peak_bytes(run(method, path, args, steps=1).train) / 2**20
    return counter.tokens / steps, statistics.median(times[1:] if len(times) > 1 else times), peak


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * (args.prompt_len + args.completion_len),
    )
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(path)
        results = {method: measure(method, path, args) for method in METHODS}
    print(
        f"GRPO shared prompts: prompt {args.prompt_len}, {args.generations} completions of {args.completion_len}, "
        f"micro-batches of {args.batch}, GA {args.accumulation}, checkpointing={args.checkpointing}, "
        f"hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, median of {args.repeats} steps"
    )
    print("| method | tokens forwarded / step | step s (median) | time / shared | peak MiB (one step) |")
    print("|---|---|---|---|---|")
    for method, (tokens, seconds, peak) in results.items():
        memory = "-" if peak is None else f"{peak:.1f}"
        print(f"| {method} | {tokens:.0f} | {seconds:.3f} | {seconds / results['shared'][1]:.2f} | {memory} |")


if __name__ == "__main__":
    main()
