"""The Axolotl plugin's collator (hf_tree.integrations.axolotl_trainer.AxolotlTreeCollator) without Axolotl: rows as
Axolotl tokenizes them (``input_ids``, ``labels`` with -100 out of the loss, ``attention_mask``) merge into one trie,
and the tree loss equals the loss the same model computes on the padded rows with those labels (HF's shifted loss,
the micro-batch's token mean: what Axolotl trains). Axolotl's own run is tests/test_axolotl.py (.ci/axolotl.sh)."""

from __future__ import annotations

import pytest
import torch

from hf_tree import tree_causal_lm_loss
from hf_tree.collator import pop_packing_stats
from hf_tree.integrations.axolotl_trainer import AxolotlTreeCollator
from hf_tree.packing import PackingConfig
from hf_tree.testing import tiny_model

SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]
# Axolotl's rows of one chat exported per turn: the system prompt and the history repeat; the prompt is masked
ROWS = [
    (SYSTEM + [20, 21, 30, 31, 32], 10),
    (SYSTEM + [20, 21, 30, 31, 32, 22, 23, 33, 34], 15),
    (SYSTEM + [24, 25, 35, 36], 10),
]


def axolotl_row(tokens: list[int], first_trained: int) -> dict[str, list[int]]:
    return {
        "input_ids": tokens,
        "labels": [-100] * first_trained + tokens[first_trained:],
        "attention_mask": [1] * len(tokens),
    }


def collator(**options) -> AxolotlTreeCollator:
    # Axolotl's call: collator(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt", **plugin keywords)
    packing = PackingConfig(max_packed_tokens=64, **options)
    return AxolotlTreeCollator(None, padding=True, pad_to_multiple_of=64, return_tensors="pt", packing=packing)


def test_rows_merge_and_train_axolotls_loss() -> None:
    rows = [axolotl_row(tokens, first) for tokens, first in ROWS]
    batch = collator()(rows)
    assert batch["input_ids"].shape[0] == 1  # one trie
    assert int(batch["num_tree_tokens"]) == len(SYSTEM) + 9 + 4  # the system prompt and turn 1 once
    assert int(batch["num_branch_tokens"]) == sum(len(tokens) for tokens, _ in ROWS)

    model = tiny_model(dtype=torch.float64)
    pop_packing_stats(batch)
    tree_loss = tree_causal_lm_loss(model, batch)
    length = max(len(row["input_ids"]) for row in rows)
    pad = lambda values, fill: [v + [fill] * (length - len(v)) for v in values]  # noqa: E731
    model.set_attn_implementation("sdpa")
    padded = model(
        input_ids=torch.tensor(pad([r["input_ids"] for r in rows], 0)),
        attention_mask=torch.tensor(pad([r["attention_mask"] for r in rows], 0)),
        labels=torch.tensor(pad([r["labels"] for r in rows], -100)),
    )
    # HF's loss upcasts the logits to float32 (a float64 model's loss is float32 there)
    torch.testing.assert_close(tree_loss.float(), padded.loss, rtol=1e-6, atol=0)


def test_untrained_rows_are_counted_and_mismatched_labels_refused() -> None:
    rows = [axolotl_row(ROWS[0][0], 10), axolotl_row(ROWS[2][0], len(ROWS[2][0]))]  # the second trains nothing
    batch = collator()(rows)
    assert int(batch["num_dropped_trees"]) == 1
    assert float(batch["num_loss_items"]) == len(ROWS[0][0]) - 10

    wrong = axolotl_row(ROWS[0][0], 10)
    wrong["labels"][11] = 99
    with pytest.raises(ValueError, match=r"row 1: labels\[11\]=99 differs from input_ids\[11\]=31"):
        collator()([rows[0], wrong])
    padded = axolotl_row(ROWS[0][0], 10)
    padded["attention_mask"][-1] = 0
    with pytest.raises(ValueError, match="row 0 holds padding"):
        collator()([padded])


def test_merge_in_batch_false_packs_rows_apart() -> None:
    batch = collator(merge_in_batch=False)([axolotl_row(tokens, first) for tokens, first in ROWS])
    assert int(batch["num_tree_tokens"]) == int(batch["num_branch_tokens"])
