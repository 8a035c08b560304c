"""Would TRL's KTO and on-policy distillation trainers gain from trees? Token dedup ratios of their real batches.

A tree trainer saves what the rows of one model call share (``dedup ratio`` = tokens of the unpadded rows / tokens
of their tries, as ``tree/dedup_ratio`` logs it). This script builds the batches those trainers would run and measures
that ratio per call, on real data that ships offline: CHAMP (``hf_tree.data.champ``; 4 models' answers to each
prompt) rendered with SmolLM2's tokenizer and chat template (``hf_tree.assets``).

- **KTO** (``trl.KTOTrainer``'s own dataset preparation and collator, batches of 8, ``train_sampling_strategy=
  "sequential"`` as its KL estimate requires): rows are (prompt, completion, label); the KL term runs a second, no-grad
  call on mismatched pairs (each prompt with the previous row's completion). Measured per call (the policy call and
  the KL call, as TRL runs them) and for both calls merged into one tree pass (each prompt then serves its own row
  and its KL row). Two row orders: ``grouped`` (the 4 answers of a prompt adjacent, as CHAMP lists them) and
  ``shuffled`` (a prompt's answers far apart, as in unpaired preference datasets such as TRL's
  ``unpair_preference_dataset`` output, which lists all chosen rows of a chunk before its rejected ones). The labels
  (GPT-4 and GPT-4 Turbo answers desirable) do not change the ratios.
- **Distillation** (``trl.DistillationTrainer``: one student completion per prompt, ``n=1``, prompts shuffled):
  rows are a prompt and one completion (a CHAMP answer standing in for the sampled one), batches of 8.

    python benchmarks/kto_distill_dedup.py                      # 0-Shot (short prompts) and 5-Shot (long prompts)
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: this checkout's hf_tree first
    sys.path.insert(0, str(REPO))

from hf_tree.assets import load_smollm2_tokenizer  # noqa: E402
from hf_tree.data.champ import champ_dataset  # noqa: E402
from hf_tree.testing import tiny_model  # noqa: E402
from hf_tree.trl.logprobs import pack_rows  # noqa: E402

BATCH_SIZE = 8  # TRL's per_device_train_batch_size default
DESIRABLE = ("GPT-4", "GPT-4 Turbo")


def tree_tokens(rows: list[list[int]]) -> tuple[int, int]:
    """(tokens of the rows, tokens of their tries) of one call."""
    capacity = sum(map(len, rows))
    _, stats, _ = pack_rows(dict(enumerate(rows)), capacity)
    return stats.num_branch_tokens, stats.num_tree_tokens


def real_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]


def champ_rows(prompt_type: str) -> list[dict]:
    rows, _ = champ_dataset(prompt_types=[prompt_type])
    return [
        {
            "prompt": r["prompt"],
            "completion": [r["completion"]],
            "label": r["model"] in DESIRABLE,
            "id": r["problem_id"],
        }
        for r in rows
    ]


def kto_ratios(rows: list[dict], tokenizer, folder: pathlib.Path) -> dict[str, float]:
    """Dedup ratios of TRL's KTO batches: the policy call, the KL call, and both merged (token-weighted)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    model = str(folder / "model")  # by path: KTO builds its reference model from it
    tiny_model(vocab_size=len(tokenizer), dtype=torch.float32, attn="sdpa").save_pretrained(model)
    args = KTOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=BATCH_SIZE,
        train_sampling_strategy="sequential",
        max_length=None,  # keep the long few-shot prompts whole (the default 1024 would drop every 5-Shot row)
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "completion", "label")} for r in rows])
    trainer = KTOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    totals = {"policy call": [0, 0], "KL call": [0, 0], "policy + KL merged": [0, 0]}
    for batch in trainer.get_train_dataloader():
        main = real_rows(batch["input_ids"], batch["attention_mask"])
        kl = real_rows(batch["KL_input_ids"], batch["KL_attention_mask"])
        for name, call in (("policy call", main), ("KL call", kl), ("policy + KL merged", main + kl)):
            branch, tree = tree_tokens(call)
            totals[name][0] += branch
            totals[name][1] += tree
    return {name: branch / tree for name, (branch, tree) in totals.items()}


def distillation_ratio(rows: list[dict], tokenizer, seed: int = 0) -> float:
    """Dedup ratio of distillation batches: one completion per prompt (the first answer of each problem), shuffled."""
    first = {}
    for r in rows:
        first.setdefault(r["id"], r)
    sequences = [
        list(tokenizer.apply_chat_template(r["prompt"] + r["completion"], return_dict=False)) for r in first.values()
    ]
    random.Random(seed).shuffle(sequences)
    branch = tree = 0
    for start in range(0, len(sequences) - BATCH_SIZE + 1, BATCH_SIZE):
        b, t = tree_tokens(sequences[start : start + BATCH_SIZE])
        branch, tree = branch + b, tree + t
    return branch / tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-types", nargs="+", default=["0-Shot", "5-Shot"])
    args = parser.parse_args()
    tokenizer = load_smollm2_tokenizer()
    print("| data | trainer, rows | call | dedup ratio |")
    print("|---|---|---|---|")
    for prompt_type in args.prompt_types:
        rows = champ_rows(prompt_type)
        prompt_lengths = [
            len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False)) for r in rows
        ]
        data = f"CHAMP {prompt_type} ({len(rows)} rows, prompts {int(np.median(prompt_lengths))} tokens median)"
        for order in ("grouped", "shuffled"):
            ordered = list(rows)
            if order == "shuffled":
                random.Random(0).shuffle(ordered)
            with tempfile.TemporaryDirectory() as tmp:
                ratios = kto_ratios(ordered, tokenizer, pathlib.Path(tmp))
            for call, ratio in ratios.items():
                print(f"| {data} | KTO, {order} | {call} | {ratio:.2f} |", flush=True)
        ratio = distillation_ratio(rows, tokenizer)
        print(f"| {data} | distillation, n=1, shuffled | student/teacher call | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
