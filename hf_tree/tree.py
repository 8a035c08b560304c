"""The tree data model: token sequences merged into a trie compressed into nodes.

A *branch* is one input sample (tokens ``t_0..t_{L-1}`` and a loss mask). A ``Tree`` is the trie of its
branches with runs of single-child tokens compressed into nodes, numbered in DFS preorder, so every
node's ancestors precede it and every subtree is one contiguous range of packed tokens.

Loss masks are stored per branch as half-open spans of trained positions (``[s0, e0, s1, e1, ...]``,
positions ``>= 1`` because ``t_0`` is never predicted). Spans keep per-branch semantics exact (weights
are sums over branches, also after a tree is split) at a cost far below one mask bit per branch token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hf_tree.validation import check_token_ids

# Keys written by ``Tree.to_dict``; ``from_dict`` ignores other keys (a dataset row has other columns).
TREE_KEYS = (
    "node_tokens",
    "node_parents",
    "branch_end_nodes",
    "branch_loss_spans",
    "branch_num_trained",
    "node_token_weights",
    "node_sequence_weights",
)


@dataclass(eq=False)
class _BuildNode:
    """A mutable trie node used only while merging sequences."""

    tokens: list[int]
    children: list[_BuildNode] = field(default_factory=list)
    children_by_first_token: dict[int, _BuildNode] = field(default_factory=dict)
    end_branches: list[int] = field(default_factory=list)

    def add_child(self, child: _BuildNode) -> None:
        self.children.append(child)
        self.children_by_first_token[child.tokens[0]] = child

    def split(self, at: int) -> None:
        """Keep ``tokens[:at]`` here and move the rest, with children and branch ends, to a new child."""
        tail = _BuildNode(self.tokens[at:], self.children, self.children_by_first_token, self.end_branches)
        self.tokens = self.tokens[:at]
        self.children, self.children_by_first_token, self.end_branches = [], {}, []
        self.add_child(tail)


def dedup_ratio(num_branch_tokens: float, num_tree_tokens: float) -> float:
    """Branch tokens (per-branch training) over tree tokens (after deduplication); 1.0 when there are none.

    The one definition behind every reported dedup ratio (trees, datasets, packing counters, training logs).
    """
    return num_branch_tokens / num_tree_tokens if num_tree_tokens else 1.0


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0])


def mask_to_spans(mask: Sequence[int]) -> list[int]:
    """Half-open spans ``[s0, e0, s1, e1, ...]`` of positions ``k >= 1`` with ``mask[k]`` set."""
    trained = np.asarray(mask, dtype=bool).copy()
    if trained.size:
        trained[0] = False  # t_0 is never predicted
    edges = np.diff(np.concatenate([[False], trained, [False]]).astype(np.int8))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    return np.stack([starts, ends], axis=1).reshape(-1).tolist()


def spans_to_mask(spans: Sequence[int], length: int) -> list[int]:
    mask = np.zeros(length, dtype=np.int64)
    for start, end in zip(spans[0::2], spans[1::2]):
        mask[start:end] = 1
    return mask.tolist()


@dataclass(frozen=True, eq=False)
class Tree:
    """A trie of token sequences (branches), compressed into nodes in DFS preorder.

    Attributes:
        node_tokens: token ids of each node's segment, nodes in DFS preorder.
        node_parents: parent node of each node, ``-1`` for a root (a forest has several roots).
        branch_end_nodes: the node each branch ends in (the branch is the root-to-node path).
        branch_loss_spans: per branch, half-open spans of trained positions (positions ``>= 1``).
        branch_fields: per-branch values carried along (e.g. ``reward``, ``advantage``), each a list
            with one entry per branch; splitting and truncation keep them attached to their branch.
    """

    node_tokens: list[list[int]]
    node_parents: list[int]
    branch_end_nodes: list[int]
    branch_loss_spans: list[list[int]]
    branch_fields: dict[str, list[Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[int]] | None = None,
        branch_fields: dict[str, Sequence[Any]] | None = None,
    ) -> Tree:
        """Merge token sequences into a tree.

        Args:
            sequences: one list of token ids per branch; identical sequences stay two branches and a
                sequence that is a prefix of another ends at an internal node.
            loss_masks: per branch, one 0/1 per token (``1`` = trained); ``None`` trains every token
                after the first. ``mask[0]`` is ignored: the first token is never predicted.
            branch_fields: optional per-branch values (one list entry per sequence) to keep attached.

        Raises:
            ValueError: on an empty input or sequence, a non-integer or negative id, a mask whose
                length differs from its sequence or holds values other than 0/1, a field list of the
                wrong length, or when no token is trained at all.
        """
        if len(sequences) == 0:
            raise ValueError("sequences is empty: a tree needs at least one branch.")
        if loss_masks is not None and len(loss_masks) != len(sequences):
            raise ValueError(
                f"loss_masks has {len(loss_masks)} entries but sequences has {len(sequences)}: "
                "pass one mask per sequence."
            )
        fields = {k: list(v) for k, v in (branch_fields or {}).items()}
        for name, values in fields.items():
            if len(values) != len(sequences):
                raise ValueError(
                    f"branch_fields[{name!r}] has {len(values)} entries but there are {len(sequences)} "
                    "sequences: pass one value per sequence."
                )

        spans: list[list[int]] = []
        token_lists: list[list[int]] = []
        for b, seq in enumerate(sequences):
            tokens = check_token_ids(seq, where=f"sequence {b}")
            if not tokens:
                raise ValueError(f"sequence {b} is empty: every branch needs at least one token.")
            if loss_masks is None:
                spans.append([1, len(tokens)] if len(tokens) > 1 else [])
            else:
                mask = list(loss_masks[b])
                if len(mask) != len(tokens):
                    raise ValueError(
                        f"loss_masks[{b}] has {len(mask)} values but sequence {b} has {len(tokens)} "
                        "tokens: a mask needs one 0/1 per token."
                    )
                bad = [i for i, m in enumerate(mask) if m not in (0, 1)]
                if bad:
                    raise ValueError(f"loss_masks[{b}][{bad[0]}] = {mask[bad[0]]!r}: mask values must be 0 or 1.")
                spans.append(mask_to_spans(mask))
            token_lists.append(tokens)

        if not any(spans):
            raise ValueError(
                "no token of any sequence is trained (all loss masks are 0 after the first token): "
                "such a tree would contribute nothing; drop it or fix the masks."
            )

        roots = _BuildNode([])  # virtual parent of the forest's roots
        for b, tokens in enumerate(token_lists):
            node, pos = roots, 0
            while True:
                child = node.children_by_first_token.get(tokens[pos])
                if child is None:
                    child = _BuildNode(tokens[pos:])
                    node.add_child(child)
                    child.end_branches.append(b)
                    break
                shared = common_prefix_length(child.tokens, tokens[pos : pos + len(child.tokens)])
                if shared < len(child.tokens):
                    child.split(shared)
                pos += shared
                node = child
                if pos == len(tokens):
                    node.end_branches.append(b)
                    break

        node_tokens: list[list[int]] = []
        node_parents: list[int] = []
        branch_end_nodes = [0] * len(token_lists)
        stack = [(child, -1) for child in reversed(roots.children)]
        while stack:  # DFS preorder, siblings in order of first appearance
            node, parent = stack.pop()
            index = len(node_tokens)
            node_tokens.append(node.tokens)
            node_parents.append(parent)
            for b in node.end_branches:
                branch_end_nodes[b] = index
            stack.extend((child, index) for child in reversed(node.children))
        return cls(node_tokens, node_parents, branch_end_nodes, spans, fields)

    # ------------------------------------------------------------------ derived structure
    @cached_property
    def node_lengths(self) -> np.ndarray:
        """``[num_nodes]`` int64: tokens per node."""
        return np.fromiter((len(t) for t in self.node_tokens), dtype=np.int64, count=len(self.node_tokens))

    @cached_property
    def node_offsets(self) -> np.ndarray:
        """``[num_nodes + 1]`` int64: packed index where each node starts (last entry = num_tokens)."""
        return np.concatenate([[0], np.cumsum(self.node_lengths)])

    @cached_property
    def node_depths(self) -> np.ndarray:
        """``[num_nodes]`` int64: depth (position id) of each node's first token."""
        depths = np.zeros(len(self.node_tokens), dtype=np.int64)
        for i, p in enumerate(self.node_parents):
            if p >= 0:
                depths[i] = depths[p] + self.node_lengths[p]
        return depths

    @cached_property
    def node_subtree_ends(self) -> np.ndarray:
        """``[num_nodes]`` int64: one past the last node of each node's subtree (preorder)."""
        ends = np.arange(1, len(self.node_tokens) + 1, dtype=np.int64)
        for i in range(len(self.node_tokens) - 1, -1, -1):
            p = self.node_parents[i]
            if p >= 0:
                ends[p] = max(ends[p], ends[i])
        return ends

    def branch_path(self, branch: int) -> list[int]:
        """Nodes from the root to the branch's end node."""
        path, node = [], self.branch_end_nodes[branch]
        while node >= 0:
            path.append(node)
            node = self.node_parents[node]
        return path[::-1]

    def branch_flat_indices(self, branch: int) -> np.ndarray:
        """``[branch_length]`` int64: the packed index of each of the branch's tokens."""
        offsets = self.node_offsets
        return np.concatenate([np.arange(offsets[n], offsets[n + 1]) for n in self.branch_path(branch)])

    @cached_property
    def branch_lengths(self) -> np.ndarray:
        """``[num_branches]`` int64."""
        ends = np.asarray(self.branch_end_nodes, dtype=np.int64)
        return self.node_depths[ends] + self.node_lengths[ends]

    @cached_property
    def branch_num_trained(self) -> np.ndarray:
        """``[num_branches]`` int64: trained tokens ``n_b`` of each branch."""
        return np.asarray(
            [sum(e - s for s, e in zip(spans[0::2], spans[1::2])) for spans in self.branch_loss_spans],
            dtype=np.int64,
        )

    @cached_property
    def _weights(self) -> tuple[np.ndarray, np.ndarray]:
        token_w = np.zeros(self.num_tokens, dtype=np.int64)
        seq_w = np.zeros(self.num_tokens, dtype=np.float64)
        for b, spans in enumerate(self.branch_loss_spans):
            if not spans:
                continue
            flat = self.branch_flat_indices(b)
            trained = flat[np.concatenate([np.arange(s, e) for s, e in zip(spans[0::2], spans[1::2])])]
            token_w[trained] += 1  # indices are unique within one branch
            seq_w[trained] += 1.0 / self.branch_num_trained[b]
        return token_w, seq_w

    @property
    def token_weights(self) -> np.ndarray:
        """``[num_tokens]`` int64: ``w_c = sum_b m_{b,c}`` (normalization ``"token"``)."""
        return self._weights[0]

    @property
    def sequence_weights(self) -> np.ndarray:
        """``[num_tokens]`` float64: ``w_c = sum_b m_{b,c} / n_b`` (normalization ``"sequence"``)."""
        return self._weights[1]

    @cached_property
    def token_multiplicity(self) -> np.ndarray:
        """``[num_tokens]`` int64: branches that contain each token (a per-branch batch holds it this many times)."""
        counts = np.bincount(np.asarray(self.branch_end_nodes, dtype=np.int64), minlength=self.num_nodes)
        for i in range(self.num_nodes - 1, -1, -1):  # preorder: every child comes after its parent
            if self.node_parents[i] >= 0:
                counts[self.node_parents[i]] += counts[i]
        return np.repeat(counts, self.node_lengths)

    @cached_property
    def input_ids(self) -> np.ndarray:
        """``[num_tokens]`` int64: tokens in DFS order."""
        return np.fromiter((t for seg in self.node_tokens for t in seg), dtype=np.int64, count=self.num_tokens)

    @cached_property
    def position_ids(self) -> np.ndarray:
        """``[num_tokens]`` int64: depth of each token (the position the branch alone would use)."""
        return np.repeat(self.node_depths - self.node_offsets[:-1], self.node_lengths) + np.arange(self.num_tokens)

    @cached_property
    def kv_end(self) -> np.ndarray:
        """``[num_tokens]`` int64: packed index where the subtree of each token's node ends."""
        return np.repeat(self.node_offsets[self.node_subtree_ends], self.node_lengths)

    @cached_property
    def predictor_index(self) -> np.ndarray:
        """``[num_tokens]`` int64: ``pred(c)``, the token whose hidden state predicts c; ``-1`` for roots."""
        pred = np.arange(-1, self.num_tokens - 1, dtype=np.int64)
        offsets = self.node_offsets
        for i, p in enumerate(self.node_parents):
            pred[offsets[i]] = offsets[p + 1] - 1 if p >= 0 else -1
        return pred

    # ------------------------------------------------------------------ sizes
    @property
    def num_nodes(self) -> int:
        return len(self.node_tokens)

    @property
    def num_branches(self) -> int:
        return len(self.branch_end_nodes)

    @property
    def num_tokens(self) -> int:
        """Tokens after deduplication (the packed length)."""
        return int(self.node_offsets[-1])

    @property
    def num_branch_tokens(self) -> int:
        """Sum of branch lengths (what per-branch training would process)."""
        return int(self.branch_lengths.sum())

    @property
    def dedup_ratio(self) -> float:
        """``num_branch_tokens / num_tokens``: how many times fewer tokens the tree computes."""
        return dedup_ratio(self.num_branch_tokens, self.num_tokens)

    @property
    def num_trained_branches(self) -> int:
        """Branches with at least one trained token (the divisor unit of ``"sequence"``)."""
        return int(np.count_nonzero(self.branch_num_trained))

    # ------------------------------------------------------------------ branches back out
    def branch_tokens(self, branch: int) -> list[int]:
        return [t for n in self.branch_path(branch) for t in self.node_tokens[n]]

    def branch_loss_mask(self, branch: int) -> list[int]:
        return spans_to_mask(self.branch_loss_spans[branch], int(self.branch_lengths[branch]))

    def select_branches(self, branches: Sequence[int], max_tokens: int | None = None) -> Tree:
        """A new tree of the given branches (optionally truncated to ``max_tokens`` each).

        Weights of the new tree are computed from its own branches only, which keeps them exact.
        """
        sequences, masks = [], []
        for b in branches:
            tokens, mask = self.branch_tokens(b), self.branch_loss_mask(b)
            sequences.append(tokens[:max_tokens])
            masks.append(mask[:max_tokens])
        fields = {k: [v[b] for b in branches] for k, v in self.branch_fields.items()}
        return Tree.from_sequences(sequences, masks, fields)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain lists (Arrow-friendly) holding everything packing, splitting and both
        normalizations need; per-branch fields go under ``branch_fields``."""
        node_token_weights = np.split(self.token_weights, self.node_offsets[1:-1])
        node_sequence_weights = np.split(self.sequence_weights, self.node_offsets[1:-1])
        out: dict[str, Any] = {
            "node_tokens": [list(t) for t in self.node_tokens],
            "node_parents": list(self.node_parents),
            "branch_end_nodes": list(self.branch_end_nodes),
            "branch_loss_spans": [list(s) for s in self.branch_loss_spans],
            "branch_num_trained": self.branch_num_trained.tolist(),
            "node_token_weights": [w.tolist() for w in node_token_weights],
            "node_sequence_weights": [w.tolist() for w in node_sequence_weights],
        }
        if self.branch_fields:
            out["branch_fields"] = {k: list(v) for k, v in self.branch_fields.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], row: int | None = None) -> Tree:
        """Rebuild a tree from ``to_dict`` output, treating ``data`` as untrusted.

        Args:
            data: a ``to_dict()`` row (extra keys are ignored).
            row: the row's index in its dataset, used only in error messages.

        Raises:
            ValueError: naming the row, node/branch and index of the first problem found.
        """
        from hf_tree.validation import validate_tree_dict

        return validate_tree_dict(cls, data, where=f"row {row}" if row is not None else "tree")
