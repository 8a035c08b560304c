"""Packing: bin packing, splitting, branch limits and the batch layout contract."""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_tree import Tree, TreeDataCollator, split_tree, tree_causal_lm_loss
from hf_tree.attention import dense_tree_mask
from hf_tree.collator import pop_packing_stats
from hf_tree.packing import PackingConfig, best_fit_decreasing


@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(50, 120))
@settings(max_examples=100, deadline=None)
def test_best_fit_decreasing_places_every_item_once_within_capacity(sizes, capacity):
    bins = best_fit_decreasing(sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
    # never worse than the trivial bound of twice the optimum for first/best fit
    assert len(bins) <= max(1, 2 * -(-sum(sizes) // capacity))


def test_best_fit_fills_the_fullest_bin_that_fits():
    assert best_fit_decreasing([6, 5, 4, 3], 9) == [[0, 3], [1, 2]]


def test_split_keeps_every_branch_once_and_fits():
    rng = random.Random(0)
    sequences = [[1, 2, 3] + [rng.randrange(50) for _ in range(rng.randint(1, 8))] for _ in range(30)]
    tree = Tree.from_sequences(sequences, branch_fields={"index": list(range(30))})
    parts = split_tree(tree, 20)
    assert len(parts) > 1
    assert all(p.num_tokens <= 20 for p in parts)
    seen = sorted(i for p in parts for i in p.branch_fields["index"])
    assert seen == list(range(30))
    for p in parts:
        for b, i in enumerate(p.branch_fields["index"]):
            assert p.branch_tokens(b) == sequences[i]
    assert sum(p.num_branch_tokens for p in parts) == tree.num_branch_tokens


def test_split_leaves_out_a_part_that_trains_nothing():
    """A group of untrained branches would be a tree with no trained token (refused by Tree): it adds nothing to the
    loss, so the split leaves it out (found by test_loss_equivalence's random forests: a lone 1-token branch)."""
    tree = Tree.from_sequences([[5, 6, 7, 8, 9, 10, 11, 12], [0, 1]], [[0, 1, 1, 1, 1, 1, 1, 1], [0, 0]])
    parts = split_tree(tree, 8)
    assert [p.branch_tokens(0) for p in parts] == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert sum(p.token_weights.sum() for p in parts) == tree.token_weights.sum()


def test_batch_layout_matches_the_contract():
    trees = [Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]]), Tree.from_sequences([[7, 8]])]
    batch = TreeDataCollator(max_packed_tokens=16, pad_to_multiple_of=8)([t.to_dict() for t in trees])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["kv_end"].dtype == torch.int32
    assert batch["loss_weights"].dtype == torch.float64 and batch["num_loss_items"].dtype == torch.float64
    assert batch["num_loss_items"].ndim == 0
    n = batch["input_ids"].shape[1]
    ids, kv_end = batch["input_ids"][0], batch["kv_end"][0]
    real = int(batch["num_tree_tokens"])
    # padding keys see only themselves, so no real query attends to padding
    assert kv_end[real:].tolist() == list(range(real + 1, n + 1))
    mask = dense_tree_mask(kv_end[None].long())[0]
    assert not mask[:real, real:].any()
    # every loss edge: the predicting position is visible to (an ancestor of) the target position
    targets = batch["loss_targets"]
    for pos, target in zip(batch["loss_positions"].tolist(), targets.tolist()):
        assert ids[pos + 1 :].tolist().count(target) >= 1
    assert int(batch["num_padding_tokens"]) == n - real
    assert int(batch["num_branch_tokens"]) == 3 + 4 + 2


def test_rows_hold_at_most_max_packed_tokens_and_report_padding():
    trees = [Tree.from_sequences([list(range(1, k + 2))]) for k in (9, 7, 5, 3, 3, 2)]
    collator = TreeDataCollator(max_packed_tokens=12, merge_in_batch=False)  # the trees as they are, bin-packed
    batch = collator([t.to_dict() for t in trees])
    lengths = (batch["kv_end"] != torch.arange(1, batch["kv_end"].shape[1] + 1)).sum(1)
    assert batch["input_ids"].shape[1] <= 12
    stats = pop_packing_stats(batch)
    assert stats.num_tree_tokens == sum(t.num_tokens for t in trees)
    assert stats.padding_fraction == pytest.approx(stats.num_padding_tokens / batch["input_ids"].numel())
    assert stats.num_padding_tokens == batch["input_ids"].numel() - stats.num_tree_tokens
    assert lengths.sum() <= stats.num_tree_tokens


def overlong_trees():
    long_branch = list(range(1, 21))
    return [
        Tree.from_sequences([long_branch, [1, 2, 3]]),
        Tree.from_sequences([[5, 6, 7]]),
        Tree.from_sequences([[9] + list(range(30, 45))], [[0] * 12 + [1] * 4]),  # trains only after the cut
    ]


def test_overlong_error_names_the_branch_and_the_fix():
    with pytest.raises(ValueError, match=r"batch row 0: branch 0 has 20 tokens.*overlong='truncate' or 'drop'"):
        TreeDataCollator(max_packed_tokens=32, max_branch_tokens=10)([t.to_dict() for t in overlong_trees()])


def test_overlong_drop_and_truncate_are_counted_and_logged(caplog):
    trees = [t.to_dict() for t in overlong_trees()]
    with caplog.at_level(logging.WARNING, logger="hf_tree"):
        dropped = TreeDataCollator(max_packed_tokens=32, max_branch_tokens=10, overlong="drop")(trees)
    assert int(dropped["num_dropped_branches"]) == 2 and int(dropped["num_dropped_trees"]) == 1
    assert int(dropped["num_branch_tokens"]) == 3 + 3
    assert "dropped" in caplog.text

    collator = TreeDataCollator(max_packed_tokens=32, max_branch_tokens=10, overlong="truncate")
    truncated = collator(trees)
    assert int(truncated["num_truncated_branches"]) == 2
    assert int(truncated["num_dropped_trees"]) == 1  # its trained tokens all lay past the cut
    assert int(truncated["num_branch_tokens"]) == 10 + 3 + 3
    assert pop_packing_stats(truncated).num_truncated_branches == 2 and "num_truncated_branches" not in truncated


def test_all_trees_dropped_gives_an_empty_but_valid_batch():
    tree = Tree.from_sequences([list(range(1, 12))])
    batch = TreeDataCollator(max_packed_tokens=8, overlong="drop")([tree.to_dict()])
    assert batch["loss_positions"].numel() == 0 and float(batch["num_loss_items"]) == 0.0
    assert batch["input_ids"].shape[0] == 1


def test_sequence_normalization_counts_trained_branches():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5]], [[0, 1, 1], [0, 0, 0], [0, 1]])
    batch = TreeDataCollator(max_packed_tokens=16, normalization="sequence")([tree.to_dict()])
    assert float(batch["num_loss_items"]) == 2.0
    assert float(batch["loss_weights"].sum()) == pytest.approx(2.0)
    token = TreeDataCollator(max_packed_tokens=16)([tree.to_dict()])
    assert float(token["num_loss_items"]) == 3.0
    np.testing.assert_array_equal(np.sort(token["loss_weights"].numpy()), [1.0, 1.0, 1.0])


def test_collator_keywords_and_packing_config_are_the_same_options():
    """The keyword construction (the public contract) builds the same ``PackingConfig`` as passing it."""
    options = dict(max_packed_tokens=16, normalization="sequence", max_branch_tokens=8, overlong="drop")
    collator = TreeDataCollator(**options, pad_to_multiple_of=4)
    assert collator.packing == PackingConfig(**options, pad_to_multiple_of=4)
    assert (collator.max_packed_tokens, collator.max_branch_tokens, collator.pad_to_multiple_of) == (16, 8, 4)
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]]).to_dict()
    a, b = collator([tree]), TreeDataCollator(packing=collator.packing)([tree])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["input_ids"].shape[1] == 8  # 5 tokens rounded up to a multiple of 4


def test_collator_needs_a_row_capacity():
    with pytest.raises(TypeError, match="needs max_packed_tokens"):
        TreeDataCollator(overlong="drop")
    with pytest.raises(ValueError, match="either packing=PackingConfig"):
        TreeDataCollator(max_packed_tokens=8, packing=PackingConfig(8))


def test_tree_arguments_take_their_packing_fields_from_packing_config():
    """``TreeArguments``' flat fields (HfArgumentParser flags) are ``PackingConfig``'s: names, types, defaults, help;
    but for the trainers' default ``tree_execution="auto"`` (they know their setup and fall back to packed)."""
    from typing import get_type_hints

    from transformers import HfArgumentParser

    from hf_tree.config import TreeArguments
    from hf_tree.trainer import TreeTrainingArguments

    mine = {f.name: f for f in dataclasses.fields(TreeArguments)}
    config_hints, argument_hints = get_type_hints(PackingConfig), get_type_hints(TreeArguments)
    for f in dataclasses.fields(PackingConfig):
        default = "auto" if f.name == "tree_execution" else f.default
        assert (mine[f.name].default, dict(mine[f.name].metadata)) == (default, dict(f.metadata)), f.name
        assert argument_hints[f.name] == config_hints[f.name], f.name
    flags = {a.dest: a for a in HfArgumentParser(TreeTrainingArguments)._actions}
    assert tuple(flags["overlong"].choices) == ("error", "drop", "truncate")
    assert tuple(flags["normalization"].choices) == ("token", "sequence")
    assert flags["max_branch_tokens"].help == PackingConfig.__dataclass_fields__["max_branch_tokens"].metadata["help"]


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_auto_execution_leaves_trees_larger_than_a_row_whole(normalization):
    """``tree_execution="auto"``: a tree over ``max_packed_tokens`` is not split but handed on whole (its branch
    may be longer than a row); the divisor and the counters include it, the rows hold the others."""
    small = Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    large = Tree.from_sequences([list(range(3, 40)), list(range(3, 20)) + [50, 51]], [[0] * 5 + [1] * 32, [1] * 19])
    collator = TreeDataCollator(
        max_packed_tokens=16, max_branch_tokens=40, normalization=normalization, tree_execution="auto"
    )
    batch = collator([small.to_dict(), large.to_dict()])
    stats = pop_packing_stats(batch)
    assert [t.num_tokens for t in batch["depth_first_trees"]] == [large.num_tokens]
    assert batch["input_ids"].shape == (1, small.num_tokens)
    packed_alone = TreeDataCollator(max_packed_tokens=64, normalization=normalization)([small, large])
    assert float(batch["num_loss_items"]) == float(packed_alone["num_loss_items"])
    assert stats.num_split_trees == 0 and stats.num_tree_tokens == small.num_tokens + large.num_tokens
    assert "depth_first_trees" not in TreeDataCollator(max_packed_tokens=64, tree_execution="auto")([small])
    with pytest.raises(ValueError, match="depth-first execution"):
        tree_causal_lm_loss(None, batch)


def test_branches_longer_than_a_row_need_depth_first_execution():
    with pytest.raises(ValueError, match=r"max_branch_tokens=40 .*tree_execution='auto'"):
        PackingConfig(max_packed_tokens=16, max_branch_tokens=40)
    assert PackingConfig(max_packed_tokens=16, max_branch_tokens=40, tree_execution="depth_first").branch_limit == 40
    with pytest.raises(ValueError, match="tree_execution='dfs' must be one of"):
        PackingConfig(tree_execution="dfs")
