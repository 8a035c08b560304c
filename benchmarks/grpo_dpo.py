"""Side-by-side benchmark of the GRPO and DPO log-prob passes: TRL's own vs hf_tree's packed prompt trees.

GRPO: ``GRPOTrainer._get_per_token_logps_and_entropies`` of TRL and of ``TreeGRPOTrainer`` on the same padded
batch (``--groups`` prompts x ``--generations`` completions), both as the trainers call it: the old-policy /
reference pass (no grad, ``batch_size`` = one group per TRL forward) and the policy pass (log-probs and entropies,
forward + backward). DPO: the fused-head forward TRL's ``DPOTrainer`` runs on ``[chosen; rejected]`` (``--pairs``
pairs) vs the tree head of ``TreeDPOTrainer``, reference pass (no grad) and policy pass (forward + backward).

Times are medians over ``--repeats`` runs taken round-robin (TRL, tree, TRL, tree, ...) so machine noise hits both
alike. Printed beside them: the token dedup ratio (tokens TRL computes / tokens the tree computes, padding
included) and the target speedup, 0.8 x that ratio.

    python benchmarks/grpo_dpo.py            # G=8, prompt 1024, completions 256; DPO prompt 1024, responses 256
    python benchmarks/grpo_dpo.py --quick    # tiny sizes, a few seconds (smoke test)

The model is a small Llama built from a config (random weights: speed does not depend on them). On CPU, TRL's
fused head scores every position of the padded batch (its compact path needs Triton), prompt positions included;
the tree head scores only completion tokens. Both are what the trainers do on this device.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from hf_tree.attention import select_backend
from hf_tree.trl.dpo import POLICY_OUTPUTS
from hf_tree.trl.glue import TreeHeadSettings, add_tree_fused_lm_head
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer

KINDS = ("trl", "tree")  # TRL's own passes and the tree trainers'


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--groups", type=int, default=1, help="GRPO prompts in the batch")
    parser.add_argument("--generations", type=int, default=8, help="GRPO completions per prompt (G)")
    parser.add_argument("--pairs", type=int, default=2, help="DPO preference pairs in the batch")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--completion-len", type=int, default=256, help="GRPO completion / DPO response length")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-dpo", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.generations, args.pairs, args.prompt_len, args.completion_len = 4, 2, 48, 12
        args.layers, args.hidden, args.vocab, args.repeats = 2, 64, 512, 1
    return args


def build_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random small Llama twice: ``sdpa`` for TRL, ``tree_flash`` for the tree trainers."""
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64 or 1,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=4 * (args.prompt_len + 2 * args.completion_len),
    )
    torch.manual_seed(0)
    trl_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    tree_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flash")
    tree_model.load_state_dict(trl_model.state_dict())
    return trl_model, tree_model


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab_size`` ids (GRPOTrainer needs one; nothing is tokenized here)."""
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def zero_reward(completions: list, **_: object) -> list[float]:
    return [0.0] * len(completions)


def padded_rows(prompts: list[torch.Tensor], completions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P + C]`` ids and mask: prompts left-padded, completions right-padded (TRL's GRPO layout)."""
    width_p, width_c = max(len(p) for p in prompts), max(len(c) for c in completions)
    ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, width_p - len(p) : width_p], mask[row, width_p - len(p) : width_p] = p, 1
        ids[row, width_p : width_p + len(c)], mask[row, width_p : width_p + len(c)] = c, 1
    return ids, mask


def median_times(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for call in calls.values():  # warm-up (allocator, first-call setup)
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def time_step_passes(
    no_grad_pass: Callable[[str], Callable[[], None]],
    policy_pass: Callable[[str], Callable[[], None]],
    no_grad_name: str,
    step_name: str,
    no_grad_passes_per_step: int,
    repeats: int,
) -> dict[str, float]:
    """Median seconds, per kind (``trl``, ``tree``), of the no-grad pass, of the policy pass (forward + backward)
    and of the step they make up: ``no_grad_passes_per_step`` no-grad passes and one policy pass."""
    no_grad, policy = f"{no_grad_name} (no grad)", "policy pass (fwd+bwd)"
    calls = {}
    for kind in KINDS:
        calls[f"{no_grad}:{kind}"] = no_grad_pass(kind)
        calls[f"{policy}:{kind}"] = policy_pass(kind)
    results = median_times(calls, repeats)
    for kind in KINDS:
        no_grad_s, policy_s = results[f"{no_grad}:{kind}"], results[f"{policy}:{kind}"]
        results[f"{step_name}:{kind}"] = no_grad_passes_per_step * no_grad_s + policy_s
    return results


@contextlib.contextmanager
def timed_attention(totals: dict[str, float]) -> Iterator[None]:
    """Add the wall time spent inside the ``sdpa`` and ``tree_flash`` attention functions (forwards) to ``totals``."""
    originals = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ("sdpa", "tree_flash")}

    def timed(function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = function(*args, **kwargs)
            totals["attention"] = totals.get("attention", 0.0) + time.perf_counter() - start
            return out

        return wrapper

    for name, function in originals.items():
        AttentionInterface.register(name, timed(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            AttentionInterface.register(name, function)


def attention_breakdown(calls: dict[str, Callable[[], None]]) -> None:
    """One more run of each no-grad pass, split into attention (forward) and everything else."""
    print(f"{'  no-grad pass, one run':<34}{'attention s':>12}{'rest s':>10}")
    for name, call in calls.items():
        totals: dict[str, float] = {}
        with timed_attention(totals):
            start = time.perf_counter()
            call()
            total = time.perf_counter() - start
        print(f"{'  ' + name:<34}{totals['attention']:>12.3f}{total - totals['attention']:>10.3f}")


def report(title: str, times: dict[str, float], dedup: float) -> None:
    print(f"\n{title}  (token dedup ratio {dedup:.2f}x, target speedup >= {0.8 * dedup:.2f}x)")
    print(f"{'pass':<34}{'TRL s':>10}{'tree s':>10}{'speedup':>10}")
    for name in sorted({key.rsplit(":", 1)[0] for key in times}):
        trl_s, tree_s = times[f"{name}:trl"], times[f"{name}:tree"]
        print(f"{name:<34}{trl_s:>10.3f}{tree_s:>10.3f}{trl_s / tree_s:>9.2f}x")


def grpo(args: argparse.Namespace, trl_model: torch.nn.Module, tree_model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    prompts, completions = [], []
    for _ in range(args.groups):
        prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=generator)
        prompts += [prompt] * args.generations
        completions += [
            torch.randint(3, args.vocab, (args.completion_len,), generator=generator) for _ in range(args.generations)
        ]
    ids, mask = padded_rows(prompts, completions)
    keep = args.completion_len
    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out,
            report_to="none",
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=args.generations,
            num_generations=args.generations,
            max_completion_length=args.completion_len,
        )
        setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer(args.vocab))
        trainers = {
            "trl": GRPOTrainer(trl_model, zero_reward, GRPOConfig(**common), **setup),
            "tree": TreeGRPOTrainer(tree_model, zero_reward, TreeGRPOConfig(**common), **setup),
        }

    def no_grad_pass(kind: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                trainers[kind]._get_per_token_logps_and_entropies(
                    trainers[kind].model, ids, mask, keep, batch_size=args.generations
                )

        return call

    def policy_pass(kind: str) -> Callable[[], None]:
        def call() -> None:
            model = trainers[kind].model
            logps, entropies, _ = trainers[kind]._get_per_token_logps_and_entropies(
                model, ids, mask, keep, compute_entropy=True
            )
            (logps.sum() + entropies.sum()).backward()
            model.zero_grad(set_to_none=True)

        return call

    results = time_step_passes(
        no_grad_pass,
        policy_pass,
        no_grad_name="old/ref pass",
        step_name="step total (old+ref+policy)",
        no_grad_passes_per_step=2,  # the old policy's and the reference's
        repeats=args.repeats,
    )
    stats = trainers["tree"].tree_head.layout_stats
    dedup = ids.numel() / stats.num_tree_tokens
    print(
        f"\nGRPO: {args.groups} prompt(s) x G={args.generations}, prompt {args.prompt_len}, completions "
        f"{args.completion_len}: TRL computes {ids.numel()} tokens, the tree {stats.num_tree_tokens} "
        f"({stats.num_rows} packed row(s))"
    )
    report("GRPO log-prob passes", results, dedup)
    attention_breakdown({kind: no_grad_pass(kind) for kind in KINDS})


def dpo(args: argparse.Namespace, trl_model: torch.nn.Module, tree_model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=generator) for _ in range(args.pairs)]
    responses = [
        torch.randint(3, args.vocab, (args.completion_len,), generator=generator) for _ in range(2 * args.pairs)
    ]
    rows = [torch.cat([prompts[i % args.pairs], responses[i]]) for i in range(2 * args.pairs)]  # [chosen; rejected]
    ids = torch.stack(rows)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, : args.prompt_len] = -100
    add_fused_lm_head(trl_model, outputs=POLICY_OUTPUTS)
    add_fused_lm_head(tree_model, outputs=POLICY_OUTPUTS)
    tree_head = add_tree_fused_lm_head(tree_model, TreeHeadSettings(outputs=POLICY_OUTPUTS))
    models_by_kind = {"trl": trl_model, "tree": tree_model}

    def ref_pass(kind: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                models_by_kind[kind](input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)

        return call

    def policy_pass(kind: str) -> Callable[[], None]:
        def call() -> None:
            model = models_by_kind[kind]
            model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs.sum().backward()
            model.zero_grad(set_to_none=True)

        return call

    results = time_step_passes(
        ref_pass,
        policy_pass,
        no_grad_name="reference pass",
        step_name="step total (ref+policy)",
        no_grad_passes_per_step=1,
        repeats=args.repeats,
    )
    stats = tree_head.layout_stats
    print(
        f"\nDPO: {args.pairs} pair(s), prompt {args.prompt_len}, responses {args.completion_len}: TRL computes "
        f"{ids.numel()} tokens, the tree {stats.num_tree_tokens} ({stats.num_rows} packed row(s))"
    )
    report("DPO log-prob passes", results, ids.numel() / stats.num_tree_tokens)
    attention_breakdown({kind: ref_pass(kind) for kind in KINDS})


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; tree attention engine: "
        f"{select_backend(torch.device('cpu'))}; model: Llama {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}, float32"
    )
    trl_model, tree_model = build_models(args)
    grpo(args, trl_model, tree_model)
    if not args.skip_dpo:
        dpo(args, *build_models(args))


if __name__ == "__main__":
    main()
