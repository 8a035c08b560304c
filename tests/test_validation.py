"""Every malformed input gets a ValueError that says what is wrong and where."""

from __future__ import annotations

import copy

import pytest

from hf_tree import Tree, TreeDataCollator


def good_row() -> dict:
    return Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]], [[0, 1, 1], [0, 0, 1, 1]]).to_dict()


def edited(**changes) -> dict:
    row = copy.deepcopy(good_row())
    row.update(changes)
    return row


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (edited(node_parents=[-1, 5, 0]), r"node 1: parent 5 is out of range"),
        (edited(node_parents=[-1, 2, 0]), r"node 1: parent 2 does not precede its child"),
        (edited(node_parents=[-1, 1, 0]), r"node 1: parent 1 does not precede its child \(a cycle"),
        (edited(node_parents=[-1, 0]), r"node_parents has 2 entries for 3 nodes"),
        (edited(node_tokens=[[1, 2], [], [4, 5]]), r"node 1 is empty"),
        (edited(node_tokens=[[1, -2], [3], [4, 5]]), r"node 0: token id at index 1 is -2"),
        (edited(node_tokens=[[1, 2.5], [3], [4, 5]]), r"node 0: token id at index 1 is 2.5"),
        (edited(node_tokens=[[1, "a"], [3], [4, 5]]), r"node 0: token id at index 1 is 'a'"),
        (edited(branch_end_nodes=[1, 7]), r"branch 1: end node 7 is out of range"),
        (edited(branch_loss_spans=[[1, 3], [2, 9]]), r"branch 1: loss span \[2, 9\) is invalid"),
        (edited(branch_loss_spans=[[0, 3], [2, 4]]), r"branch 0: loss span \[0, 3\) is invalid"),
        (edited(branch_loss_spans=[[1], [2, 4]]), r"branch 0: loss spans have odd length"),
        (
            edited(
                branch_loss_spans=[[], []], branch_num_trained=None, node_token_weights=None, node_sequence_weights=None
            ),
            r"no token is trained",
        ),
        (edited(node_token_weights=[[0, 1], [1], [2, 2]]), r"'node_token_weights' at packed token .* stale"),
        (edited(node_token_weights=[[0, 1], [1, 1], [1, 1]]), r"node 1: 'node_token_weights' has 2 values"),
        (edited(branch_num_trained=[2, 3]), r"branch_num_trained does not match"),
        ({k: v for k, v in good_row().items() if k != "node_parents"}, r"missing key 'node_parents'"),
        (edited(branch_fields={"reward": [1.0]}), r"branch_fields\['reward'\] has 1 values for 2 branches"),
    ],
)
def test_malformed_rows_raise_value_error_naming_the_place(row, message):
    with pytest.raises(ValueError, match=r"row 3: " + message):
        Tree.from_dict(row, row=3)


def test_non_preorder_nodes_are_rejected():
    row = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [9]]).to_dict()
    # nodes: 0=[1,2], 1=[3], 2=[4], 3=[9]; make node 3 a child of node 1 after its sibling 2
    row["node_parents"] = [-1, 0, 0, 1]
    row["branch_end_nodes"] = [1, 2, 3]
    with pytest.raises(ValueError, match="not in DFS preorder"):
        Tree.from_dict(row, row=0)


def test_node_on_no_branch_is_rejected():
    row = good_row()
    row["branch_end_nodes"] = [1, 1]
    row["branch_loss_spans"] = [[1, 3], [1, 3]]
    with pytest.raises(ValueError, match="node 2 lies on no branch"):
        Tree.from_dict(row)


@pytest.mark.parametrize(
    ("sequences", "masks", "message"),
    [
        ([], None, "sequences is empty"),
        ([[1, 2], []], None, "sequence 1 is empty"),
        ([[1, -1]], None, "sequence 0: token id at index 1 is -1"),
        ([[1, 2.0]], None, "sequence 0: token id at index 1 is 2.0"),
        ([[1, 2, 3]], [[0, 1]], r"loss_masks\[0\] has 2 values but sequence 0 has 3 tokens"),
        ([[1, 2, 3]], [[0, 1, 2]], r"loss_masks\[0\]\[2\] = 2"),
        ([[1, 2, 3]], [[1, 0, 0]], "no token of any sequence is trained"),
        ([[1]], None, "no token of any sequence is trained"),
        ([[1, 2]], [[0, 1], [0, 1]], "loss_masks has 2 entries but sequences has 1"),
    ],
)
def test_malformed_sequences_raise_value_error(sequences, masks, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_sequences(sequences, masks)


def test_collator_reports_the_batch_row_of_a_bad_feature():
    bad = edited(node_parents=[-1, 9, 0])
    with pytest.raises(ValueError, match="row 1: node 1: parent 9"):
        TreeDataCollator(max_packed_tokens=16)([good_row(), bad])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_packed_tokens=1), "max_packed_tokens=1"),
        (dict(max_packed_tokens=8, max_branch_tokens=9), "max_branch_tokens=9"),
        (dict(max_packed_tokens=8, overlong="skip"), "overlong='skip'"),
        (dict(max_packed_tokens=8, normalization="mean"), "normalization='mean'"),
        (dict(max_packed_tokens=8, pad_to_multiple_of=0), "pad_to_multiple_of=0"),
    ],
)
def test_collator_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeDataCollator(**kwargs)


def test_every_max_packed_tokens_follows_one_rule(tmp_path):
    """The collator's, the TRL log-prob configs' and the reward config's ``max_packed_tokens`` share one rule
    (``hf_tree.packing.check_max_packed_tokens``: an integer >= 2; ``None`` where TRL's forward sizes the rows):
    the reward config used to accept 1."""
    from hf_tree.trl.dpo import TreeDPOConfig
    from hf_tree.trl.reward import TreeRewardConfig

    cpu = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    for config in (TreeDPOConfig, TreeRewardConfig):
        assert config(**cpu, max_packed_tokens=None).max_packed_tokens is None
        for bad in (1, 2.5):
            with pytest.raises(ValueError, match=rf"max_packed_tokens={bad} must be an integer >= 2, or None"):
                config(**cpu, max_packed_tokens=bad)
    with pytest.raises(ValueError, match=r"max_packed_tokens=None must be an integer >= 2\.$"):
        TreeDataCollator(max_packed_tokens=None)
