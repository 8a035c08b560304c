"""Checks of untrusted tree input: every problem is a ``ValueError`` saying what is wrong and where.

A ``Tree.to_dict()`` row read back from disk may be corrupted or hand-made; nothing in it may reach
indexing code unchecked, so that users see "row 17: node 3: parent 9 does not precede its child"
instead of an ``IndexError`` from deep inside packing.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

# The tree class is passed in (``Tree.from_dict`` calls ``validate_tree_dict(cls, ...)``): ``hf_tree.tree``
# imports this module, so this one must not import it back.
TreeT = TypeVar("TreeT")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(values: Sequence[Any], where: str) -> list[int]:
    """Return ``values`` as a list of Python ints, or raise naming the first non-integer/negative id."""
    array = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if array.ndim != 1:
        raise ValueError(f"{where}: token ids must be a flat list of integers, got shape {array.shape}.")
    if array.dtype.kind not in "iu":
        for i, v in enumerate(values):
            if not _is_int(v):
                raise ValueError(f"{where}: token id at index {i} is {v!r}; token ids must be integers >= 0.")
        array = array.astype(np.int64)
    if array.size and array.min() < 0:
        i = int(np.argmax(array < 0))
        raise ValueError(f"{where}: token id at index {i} is {int(array[i])}; token ids must be >= 0.")
    return array.tolist()


def _check_int(value: Any, where: str) -> int:
    if not _is_int(value):
        raise ValueError(f"{where} is {value!r}; expected an integer.")
    return int(value)


def _check_list(data: dict[str, Any], key: str, where: str) -> list[Any]:
    if key not in data:
        raise ValueError(f"{where}: missing key {key!r}; rows must come from Tree.to_dict().")
    value = data[key]
    if not isinstance(value, Sequence | np.ndarray) or isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a list, got {type(value).__name__}.")
    return list(value)


def _check_stored(stored: Any, expected: np.ndarray, key: str, where: str, tree: Any) -> None:
    """Stored derived values must match what the structure implies (stale or edited rows are rejected)."""
    if stored is None:
        return
    nodes = list(stored)
    if len(nodes) != tree.num_nodes:
        raise ValueError(f"{where}: {key!r} has {len(nodes)} nodes but node_tokens has {tree.num_nodes}.")
    for i, values in enumerate(nodes):
        if len(values) != tree.node_lengths[i]:
            raise ValueError(f"{where}: node {i}: {key!r} has {len(values)} values for {tree.node_lengths[i]} tokens.")
    flat = np.asarray([v for node in nodes for v in node], dtype=np.float64)
    if not np.allclose(flat, expected, rtol=1e-12, atol=0.0):
        index = int(np.argmax(~np.isclose(flat, expected, rtol=1e-12, atol=0.0)))
        raise ValueError(
            f"{where}: {key!r} at packed token {index} is {flat[index]} but the branches' loss spans give "
            f"{expected[index]}; the row is stale or was edited. Rebuild it with Tree.to_dict()."
        )


def validate_tree_dict(cls: type[TreeT], data: dict[str, Any], where: str) -> TreeT:
    """Validate a ``Tree.to_dict()`` row and build the tree. See ``Tree.from_dict``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a dict from Tree.to_dict(), got {type(data).__name__}.")
    node_tokens_raw = _check_list(data, "node_tokens", where)
    if not node_tokens_raw:
        raise ValueError(f"{where}: node_tokens is empty; a tree needs at least one node.")
    node_tokens = []
    for i, tokens in enumerate(node_tokens_raw):
        if tokens is None or len(tokens) == 0:
            raise ValueError(f"{where}: node {i} is empty; every node holds at least one token.")
        node_tokens.append(check_token_ids(tokens, where=f"{where}: node {i}"))
    num_nodes = len(node_tokens)

    parents = _check_list(data, "node_parents", where)
    if len(parents) != num_nodes:
        raise ValueError(f"{where}: node_parents has {len(parents)} entries for {num_nodes} nodes.")
    ancestors: list[int] = []  # the current root-to-node path while walking in preorder
    for i, parent in enumerate(parents):
        parent = _check_int(parent, f"{where}: node {i}: parent")
        if parent < -1 or parent >= num_nodes:
            raise ValueError(f"{where}: node {i}: parent {parent} is out of range [-1, {num_nodes}).")
        if parent >= i:
            raise ValueError(
                f"{where}: node {i}: parent {parent} does not precede its child (a cycle or a wrong order); "
                "nodes must be in DFS preorder."
            )
        while ancestors and ancestors[-1] != parent:
            ancestors.pop()
        if parent != -1 and not ancestors:
            raise ValueError(
                f"{where}: node {i}: parent {parent} is not on the current root path, so the nodes are not "
                "in DFS preorder (a subtree would not be contiguous)."
            )
        ancestors.append(i)
    parents = [int(p) for p in parents]

    end_nodes = _check_list(data, "branch_end_nodes", where)
    if not end_nodes:
        raise ValueError(f"{where}: branch_end_nodes is empty; a tree needs at least one branch.")
    for b, node in enumerate(end_nodes):
        node = _check_int(node, f"{where}: branch {b}: end node")
        if not 0 <= node < num_nodes:
            raise ValueError(f"{where}: branch {b}: end node {node} is out of range [0, {num_nodes}).")
    end_nodes = [int(n) for n in end_nodes]

    on_a_branch = np.zeros(num_nodes, dtype=bool)
    on_a_branch[end_nodes] = True
    for i in range(num_nodes - 1, -1, -1):
        if on_a_branch[i] and parents[i] >= 0:
            on_a_branch[parents[i]] = True
    if not on_a_branch.all():
        node = int(np.argmin(on_a_branch))
        raise ValueError(f"{where}: node {node} lies on no branch (no branch ends in its subtree).")

    spans_raw = _check_list(data, "branch_loss_spans", where)
    if len(spans_raw) != len(end_nodes):
        raise ValueError(f"{where}: branch_loss_spans has {len(spans_raw)} entries for {len(end_nodes)} branches.")
    lengths = np.asarray([len(t) for t in node_tokens])
    depth_end = np.zeros(num_nodes, dtype=np.int64)  # depth after each node's last token
    for i, p in enumerate(parents):
        depth_end[i] = (depth_end[p] if p >= 0 else 0) + lengths[i]
    spans = []
    for b, branch_spans in enumerate(spans_raw):
        branch_spans = [_check_int(v, f"{where}: branch {b}: loss span value") for v in branch_spans]
        if len(branch_spans) % 2:
            raise ValueError(
                f"{where}: branch {b}: loss spans have odd length {len(branch_spans)}; "
                "expected [start, end, start, end, ...]."
            )
        length, previous_end = int(depth_end[end_nodes[b]]), 1
        for s, e in zip(branch_spans[0::2], branch_spans[1::2]):
            if not previous_end <= s < e <= length:
                raise ValueError(
                    f"{where}: branch {b}: loss span [{s}, {e}) is invalid for a branch of {length} tokens "
                    "(spans must be sorted, non-empty, start at position >= 1 and end <= the length)."
                )
            previous_end = e
        spans.append(branch_spans)
    if not any(spans):
        raise ValueError(f"{where}: no token is trained (every branch's loss spans are empty).")

    fields = data.get("branch_fields") or {}
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: branch_fields must be a dict of per-branch lists.")
    for name, values in fields.items():
        if len(values) != len(end_nodes):
            raise ValueError(
                f"{where}: branch_fields[{name!r}] has {len(values)} values for {len(end_nodes)} branches."
            )

    tree = cls(node_tokens, parents, end_nodes, spans, {k: list(v) for k, v in fields.items()})
    if data.get("branch_num_trained") is not None:
        stored = np.asarray(list(data["branch_num_trained"]), dtype=np.float64)
        if stored.shape != tree.branch_num_trained.shape or not np.array_equal(stored, tree.branch_num_trained):
            raise ValueError(f"{where}: branch_num_trained does not match the loss spans; the row is stale.")
    _check_stored(
        data.get("node_token_weights"), tree.token_weights.astype(np.float64), "node_token_weights", where, tree
    )
    _check_stored(data.get("node_sequence_weights"), tree.sequence_weights, "node_sequence_weights", where, tree)
    return tree
