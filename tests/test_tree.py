"""The trie model: structure, sizes, weights and (de)serialisation, checked against branch-by-branch facts."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_tree import Tree


@st.composite
def branch_sets(draw, max_branches: int = 12, vocab: int = 6):
    """Sequences over a tiny vocabulary (so prefixes collide a lot) with random loss masks."""
    num = draw(st.integers(1, max_branches))
    sequences = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10)) for _ in range(num)]
    if draw(st.booleans()) and num > 1:  # duplicates and prefixes of other branches
        sequences.append(list(sequences[0]))
        sequences.append(sequences[1][: max(1, len(sequences[1]) // 2)])
    masks = [draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in sequences]
    masks[0] = [0] + [1] * (len(sequences[0]) - 1)
    if len(sequences[0]) == 1:
        sequences[0].append(0)
        masks[0].append(1)
    return sequences, masks


@given(branch_sets())
@settings(max_examples=150, deadline=None)
def test_branches_round_trip_and_weights_are_sums_over_branches(data):
    sequences, masks = data
    tree = Tree.from_sequences(sequences, masks)
    assert tree.num_branches == len(sequences)
    assert tree.num_branch_tokens == sum(len(s) for s in sequences)
    token_w = np.zeros(tree.num_tokens)
    seq_w = np.zeros(tree.num_tokens)
    for b, (seq, mask) in enumerate(zip(sequences, masks)):
        assert tree.branch_tokens(b) == list(seq)
        expected_mask = [0] + list(mask[1:])
        assert tree.branch_loss_mask(b) == expected_mask
        flat = tree.branch_flat_indices(b)
        assert tree.input_ids[flat].tolist() == list(seq)
        assert tree.position_ids[flat].tolist() == list(range(len(seq)))  # depth = own position
        # every token sees exactly its branch prefix: kv_end of ancestors covers it
        for k, c in enumerate(flat):
            assert all(flat[j] <= c < tree.kv_end[flat[j]] for j in range(k + 1))
            if k:
                assert tree.predictor_index[c] == flat[k - 1]
        n_b = sum(expected_mask)
        token_w[flat] += expected_mask
        if n_b:
            seq_w[flat] += np.asarray(expected_mask) / n_b
    np.testing.assert_array_equal(tree.token_weights, token_w)
    np.testing.assert_allclose(tree.sequence_weights, seq_w, rtol=1e-13, atol=0)
    # the trie is minimal: no two siblings start with the same token, so no token is duplicated
    distinct_prefixes = {tuple(s[: k + 1]) for s in sequences for k in range(len(s))}
    assert tree.num_tokens == len(distinct_prefixes)


def test_structure_of_a_small_forest():
    tree = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7], [1, 2, 3, 4], [9, 8]])
    assert tree.node_tokens == [[1, 2], [3, 4], [5, 6], [7], [9, 8]]
    assert tree.node_parents == [-1, 0, 1, 0, -1]
    assert tree.branch_end_nodes == [1, 2, 3, 1, 4]  # identical branches end at the same internal node
    assert tree.kv_end.tolist() == [7, 7, 6, 6, 6, 6, 7, 9, 9]
    assert tree.num_tokens == 9 and tree.num_branch_tokens == 19
    assert tree.dedup_ratio == pytest.approx(19 / 9)


def test_children_follow_first_appearance_order():
    tree = Tree.from_sequences([[1, 5], [1, 3], [1, 4], [1, 3, 9]])
    assert [tree.node_tokens[i] for i in range(1, tree.num_nodes)] == [[5], [3], [9], [4]]


def test_deep_and_wide_trees():
    wide = Tree.from_sequences([[0, 1, i + 2] for i in range(40)])
    assert wide.num_nodes == 41 and wide.num_tokens == 42
    deep_sequences = [list(range(k + 2)) for k in range(15)]  # each a prefix of the next: depth 15
    deep = Tree.from_sequences(deep_sequences)
    assert deep.num_nodes == 15 and all(len(t) == 1 for t in deep.node_tokens[1:])


def test_to_dict_round_trips_through_arrow():
    tree = Tree.from_sequences(
        [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8]],
        [[0, 1, 1, 1], [0, 0, 1], [0, 0, 0, 1]],
        branch_fields={"reward": [1.0, -0.5, 0.25]},
    )
    ds = datasets.Dataset.from_list([tree.to_dict(), tree.to_dict()])
    back = Tree.from_dict(ds[1], row=1)
    assert back.to_dict() == tree.to_dict()
    assert back.branch_fields == {"reward": [1.0, -0.5, 0.25]}
    np.testing.assert_array_equal(back.sequence_weights, tree.sequence_weights)


def test_select_branches_recomputes_weights_from_its_own_branches():
    tree = Tree.from_sequences(
        [[1, 2, 3], [1, 2, 4], [1, 2, 5]], [[0, 1, 1], [0, 0, 1], [0, 1, 1]], branch_fields={"id": ["a", "b", "c"]}
    )
    part = tree.select_branches([1, 2])
    assert part.token_weights.tolist() == [0, 1, 1, 1]
    assert part.branch_fields == {"id": ["b", "c"]}
