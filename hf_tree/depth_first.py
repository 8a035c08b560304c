"""Depth-first execution: a tree larger than a row, every shared prefix computed once, at the memory of one path.

The tree is cut into *units* (``plan_units``), each one forward of the model:

- a **group**: consecutive sibling subtrees that fit their depth's budget together (``max_unit_tokens`` minus their
  cached ancestors, at least a quarter of it), run as one packed mini-tree (its own ``kv_end``); a whole tree that
  fits is one group, i.e. today's packed row;
- a **piece**: up to a budget of tokens of one node whose subtree does not fit; its keys/values are kept (the
  *cache*) while the rest of its subtree runs.

Units run in DFS order (``depth_first_backward``). A unit's queries also see its ancestors' cached keys/values
(``hf_tree.attention.prefix``; causal convolutions read their cached inputs the same way, and recurrences (gated
delta rule, Mamba2 scan) start the unit's roots from the state its nearest cached ancestor piece ended with), which
enter its forward as detached leaves, one per cached piece and entry: the unit's backward accumulates their
gradients in ``.grad``. A group is backpropagated right after its forward; a piece once its whole subtree is done,
with ``torch.autograd.backward([hidden, *entries], [dL/dhidden, *entry_leaf.grad])``, so every node's graph is
backpropagated once and the parameters' ``.grad`` add up to the packed (= per-branch) gradient. The loss of a unit
is scored right after its forward on detached hidden states, so neither logits nor head gradients are held while its
subtree runs. Peak activation memory: the pieces of one root-to-leaf path, their caches, and one group. Loss weights
and divisor are the tree's own (docs/design.md).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_tree.attention.prefix import PrefixCache
from hf_tree.loss import checked_tree_model, divide_by_items, score_hidden_states, tree_causal_lm_loss
from hf_tree.models.check import self_check_enabled
from hf_tree.models.head import LogitHead
from hf_tree.models.introspection import capture_last_hidden_state, eval_mode_no_grad, probe_ids
from hf_tree.models.probe import bound, token_difference
from hf_tree.models.router_loss import router_aux_loss_coef
from hf_tree.packing import Normalization, pack_trees, tree_divisor
from hf_tree.tree import Tree

OPTION = "tree_execution='depth_first'"


@dataclass(frozen=True)
class DepthFirstConfig:
    """Options of depth-first execution."""

    max_unit_tokens: int = field(
        default=4096,
        metadata={
            "help": "Tokens of one forward plus its cached ancestors (at least a quarter of this in the forward): "
            "sibling subtrees that fit together run as one packed mini-tree, a node whose subtree does not fit runs "
            "alone, in pieces (the trainers use max_packed_tokens)."
        },
    )
    chunk_size: int | None = field(
        default=None, metadata={"help": "Rows of logits scored at once (None: hf_tree.loss.loss_chunk_rows)."}
    )

    def __post_init__(self) -> None:
        if not isinstance(self.max_unit_tokens, int) or self.max_unit_tokens < 1:
            raise ValueError(f"max_unit_tokens={self.max_unit_tokens!r} must be a positive integer.")


@dataclass(frozen=True)
class Unit:
    """One forward of depth-first execution: the packed token range ``[start, end)`` of a tree."""

    start: int
    end: int
    subtree_end: int
    """Packed index where the tokens that attend to this unit end (``end`` for a group)."""

    @property
    def keeps_cache(self) -> bool:
        """Whether later units attend to this unit's keys/values (a piece with tokens below it)."""
        return self.subtree_end > self.end


def plan_units(tree: Tree, max_unit_tokens: int) -> list[Unit]:
    """The units of ``tree`` in execution (DFS) order; their ranges tile ``[0, tree.num_tokens)``.

    A unit runs beside its cached ancestors, so a node at depth ``d`` gets a budget of ``max_unit_tokens - d`` tokens
    (the unit and its prefix fit a row), but never less than a quarter of ``max_unit_tokens``. Consecutive siblings
    whose subtrees fit the budget together form a group (the roots of a forest are siblings); a node whose subtree
    is larger is cut into pieces of at most the budget, followed by its children's units.
    """
    offsets, ends, depths = tree.node_offsets, tree.node_subtree_ends, tree.node_depths
    children: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]  # index -1: the forest's roots
    for node, parent in enumerate(tree.node_parents):
        children[parent].append(node)
    units: list[Unit] = []
    group: list[int] = []  # [start, end) of the open group
    smallest = -(-max_unit_tokens // 4)

    def close_group() -> None:
        if group:
            units.append(Unit(group[0], group[1], group[1]))
            group.clear()

    pending: list[Iterator[int]] = [iter(children[-1])]
    while pending:
        node = next(pending[-1], None)
        if node is None:
            close_group()
            pending.pop()
            continue
        start, end = int(offsets[node]), int(offsets[ends[node]])
        budget = max(max_unit_tokens - int(depths[node]), smallest)
        if end - start <= budget:
            if group and end - group[0] <= budget:
                group[1] = end
            else:
                close_group()
                group.extend((start, end))
            continue
        close_group()
        node_end = int(offsets[node + 1])
        for piece in range(start, node_end, budget):
            units.append(Unit(piece, min(piece + budget, node_end), end))
        pending.append(iter(children[node]))
    return units


@dataclass
class _TreeArrays:
    """The tensors of one tree that every unit slices (``[num_tokens]`` each; edges ``[M]``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    kv_end: torch.Tensor
    edge_predictors: np.ndarray
    """Packed index of the hidden state that predicts each scored token."""
    edge_targets: torch.Tensor
    edge_weights: torch.Tensor

    @classmethod
    def of(cls, tree: Tree, normalization: Normalization, device: torch.device) -> _TreeArrays:
        weights = tree.token_weights if normalization == "token" else tree.sequence_weights
        trained = np.nonzero(weights)[0]
        order = np.argsort(tree.predictor_index[trained], kind="stable")  # each unit's edges are one slice
        trained = trained[order]
        return cls(
            torch.from_numpy(tree.input_ids).to(device),
            torch.from_numpy(tree.position_ids).to(device),
            torch.from_numpy(tree.kv_end).to(device),
            tree.predictor_index[trained],
            torch.from_numpy(tree.input_ids[trained]).to(device),
            torch.from_numpy(weights[trained].astype(np.float64)).to(device),
        )

    def edges(self, unit: Unit) -> tuple[torch.Tensor, slice]:
        """``[m]`` positions local to ``unit`` of its predicting hidden states, and the slice of its edges."""
        first, last = np.searchsorted(self.edge_predictors, [unit.start, unit.end])
        local = torch.from_numpy(self.edge_predictors[first:last] - unit.start).to(self.input_ids.device)
        return local, slice(int(first), int(last))


@dataclass
class _Pending:
    """A forwarded unit whose backward has not run: its outputs and the gradients they receive."""

    unit: Unit
    outputs: list[torch.Tensor]
    """``[hidden, *entries]``: the scored hidden states and (pieces) the unit's cache entries."""
    output_grads: list[torch.Tensor | None]
    """The hidden states' gradient, then (pieces) ``None`` until ``cache_leaves`` have gradients."""
    cache_keys: list[Hashable] = field(default_factory=list)
    """The ``PrefixCache`` key of each cached entry (pieces)."""
    cache_leaves: list[torch.Tensor] = field(default_factory=list)
    """Detached ``requires_grad`` views of the entries descendants read (keys/values, convolution inputs, recurrent
    states), in the order of ``cache_keys``."""

    def backward(self) -> None:
        grads = self.output_grads[:1] + [leaf.grad for leaf in self.cache_leaves]
        pairs = [(o, g) for o, g in zip(self.outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.outputs, self.output_grads, self.cache_leaves = [], [], []


def refuse_for_depth_first(causal_lm: PreTrainedModel) -> None:
    """``ValueError`` (naming the model and the option) for models depth-first execution would train wrongly.

    An MoE router load-balancing loss is a mean over the whole micro-batch; reentrant gradient checkpointing would cut
    the cache out of the autograd graph. (Hybrids train: convolution inputs and recurrent states are carried between
    units like attention keys/values, ``hf_tree.models.mixers``.)
    """
    coef = router_aux_loss_coef(causal_lm)
    if coef:  # a mean over all the micro-batch's tokens at once; the units run and backpropagate one by one
        raise ValueError(
            f"{OPTION} does not support an MoE router load-balancing loss (router_aux_loss_coef={coef}): it is a "
            "product of means over every token of the micro-batch. Set router_aux_loss_coef=0.0, or "
            "tree_execution='packed'."
        )
    for module in causal_lm.modules():
        checkpoint_func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and isinstance(checkpoint_func, functools.partial):
            if checkpoint_func.keywords.get("use_reentrant", True):
                raise ValueError(
                    f"{OPTION} with reentrant gradient checkpointing (gradient_checkpointing_kwargs="
                    "{'use_reentrant': True} or unset in an old call) would drop the gradient of the cached keys and "
                    "values. Set gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' default)."
                )


def depth_first_backward(
    model: torch.nn.Module,
    trees: Sequence[Tree],
    config: DepthFirstConfig,
    normalization: Normalization = "token",
    num_items_in_batch: torch.Tensor | float | None = None,
    token_loss: Callable[..., torch.Tensor] | None = None,
    self_check: bool | None = None,
) -> torch.Tensor:
    """Forward and backward of ``trees`` unit by unit; the parameters' ``.grad`` receive the gradient of the loss.

    Args:
        model: a causal LM on ``tree_flash`` (may be PEFT-wrapped), in the mode to train in.
        trees: the trees of one micro-batch.
        config: the unit size.
        normalization: ``"token"`` or ``"sequence"`` loss weights (docs/design.md).
        num_items_in_batch: the optimizer step's divisor (all micro-batches); default ``tree_divisor(trees)``.
        token_loss, self_check: as in ``hf_tree.tree_causal_lm_loss``; the self-check adds ``probe_depth_first``.

    Returns:
        The loss, ``sum of weighted CE / divisor`` (0-dim, detached): what ``tree_causal_lm_loss`` returns for the
        same trees packed, whose gradient this call has accumulated.

    Raises:
        ValueError: see ``tree_causal_lm_loss``, ``refuse_for_depth_first`` and ``probe_depth_first``.
    """
    divisor = tree_divisor(trees, normalization) if num_items_in_batch is None else num_items_in_batch
    depths = torch.from_numpy(np.concatenate([t.position_ids for t in trees]))
    causal_lm, logit_head = checked_tree_model(model, depths, self_check)
    check_depth_first(model, causal_lm, logit_head, self_check)
    return _run_trees(model, causal_lm, logit_head, trees, config, normalization, divisor, token_loss)


def _run_trees(
    model: torch.nn.Module,
    causal_lm: PreTrainedModel,
    logit_head: LogitHead,
    trees: Sequence[Tree],
    config: DepthFirstConfig,
    normalization: Normalization,
    divisor: torch.Tensor | float,
    token_loss: Callable[..., torch.Tensor] | None,
) -> torch.Tensor:
    """``depth_first_backward`` after its checks."""
    device = next(causal_lm.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    loss_dtype = total.dtype  # then that of the units' losses (float32, or float64 for a float64 model)
    for tree in trees:
        arrays = _TreeArrays.of(tree, normalization, device)
        stack: list[_Pending] = []
        for unit in plan_units(tree, config.max_unit_tokens):
            while stack and stack[-1].unit.subtree_end <= unit.start:
                stack.pop().backward()
            kv_end = (arrays.kv_end[None, unit.start : unit.end].clamp_max(unit.end) - unit.start).int()
            position_ids = arrays.position_ids[None, unit.start : unit.end]
            prefix = _prefix_of(stack, arrays, kv_end, position_ids)
            with capture_last_hidden_state(causal_lm) as captured:
                model(
                    input_ids=arrays.input_ids[None, unit.start : unit.end],
                    position_ids=position_ids,
                    kv_end=kv_end,
                    kv_prefix=prefix,
                    use_cache=False,
                    logits_to_keep=1,
                )
            local, edges = arrays.edges(unit)
            hidden = captured["hidden"][0].index_select(0, local)
            scored = hidden.detach().requires_grad_(hidden.requires_grad)
            weighted = score_hidden_states(
                causal_lm,
                logit_head,
                scored,
                arrays.edge_targets[edges],
                arrays.edge_weights[edges],
                token_loss,
                config.chunk_size,
            )
            loss = divide_by_items(weighted, divisor)
            if loss.requires_grad:
                loss.backward()  # the head's gradient now; the unit's body once its subtree is done
            total += loss.detach().to(total.dtype)
            loss_dtype = loss.dtype
            pending = _Pending(unit, [hidden], [scored.grad])
            if unit.keeps_cache:
                pending.outputs += prefix.own.values()
                pending.cache_keys = list(prefix.own)
                pending.cache_leaves = [t.detach().requires_grad_(t.requires_grad) for t in prefix.own.values()]
                stack.append(pending)
            else:
                pending.backward()
        while stack:
            stack.pop().backward()
    return total.to(loss_dtype)


def check_depth_first(
    model: torch.nn.Module, causal_lm: PreTrainedModel, logit_head: LogitHead, self_check: bool | None
) -> None:
    """``refuse_for_depth_first``, then (with the self-check on, once per model) ``probe_depth_first``."""
    refuse_for_depth_first(causal_lm)
    if self_check_enabled(self_check) and causal_lm not in _probed:
        probe_depth_first(model, causal_lm, logit_head)
        _probed.add(causal_lm)


_probed: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()
# Units of the probe tree: pieces of the prompt and of an inner node, sibling groups, two levels of cache.
PROBE_UNIT_TOKENS = 4


def probe_depth_first(model: torch.nn.Module, causal_lm: PreTrainedModel, logit_head: LogitHead) -> float:
    """Forward a 4-branch probe tree depth-first (units of ``PROBE_UNIT_TOKENS``) and packed (the packed pass is
    checked against the branches by ``hf_tree.models.check``), in eval mode without gradients; every scored hidden
    state must agree. Returns the largest per-token relative difference.

    Raises:
        ValueError: naming the model and the option when a hidden state differs beyond rounding (e.g. a token mixer
            that reads context outside the attention keys/values, convolution inputs and recurrent states carried
            between units).
    """
    device = next(causal_lm.parameters()).device
    ids = probe_ids(causal_lm.config.get_text_config().vocab_size, 28, seed=3, device=torch.device("cpu")).tolist()
    prompt, inner, leaves = ids[:7], ids[7:12], (ids[12:15], ids[15:19], ids[19:22], ids[22:28])
    tree = Tree.from_sequences(
        [prompt + inner + leaves[0], prompt + inner + leaves[1], prompt + leaves[2]] + [prompt + leaves[3]]
    )
    recorded: dict[str, list[torch.Tensor]] = {"packed": [], "depth_first": []}

    def recorder(name: str) -> Callable[..., torch.Tensor]:
        def token_loss(head, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            recorded[name].append(hidden.detach())
            return hidden.new_zeros(())

        return token_loss

    batch, _ = pack_trees([tree], tree.num_tokens)
    with eval_mode_no_grad(model):
        tree_causal_lm_loss(model, {k: v.to(device) for k, v in batch.items()}, token_loss=recorder("packed"))
        # With gradients on, as in training: a wrapper may handle grad-requiring inputs (the cache leaves) otherwise
        # (FSDP2 rebuilt containers holding them, which lost the cache). No backward runs: the recorded loss is a
        # constant, so no hidden state or cache leaf gets a gradient and no parameter's .grad changes.
        with torch.enable_grad():
            _run_trees(
                model,
                causal_lm,
                logit_head,
                [tree],
                DepthFirstConfig(PROBE_UNIT_TOKENS),
                "token",
                1.0,
                recorder("depth_first"),
            )
    trained = np.nonzero(tree.token_weights)[0]
    order = torch.from_numpy(np.argsort(tree.predictor_index[trained], kind="stable")).to(device)
    packed = torch.cat(recorded["packed"]).index_select(0, order)  # the depth-first order: by predicting position
    difference = token_difference(torch.cat(recorded["depth_first"]), packed)
    dtype = packed.dtype
    allowed = max(bound(0.0, dtype), 1e-4)
    if not difference <= allowed:
        raise ValueError(
            f"{OPTION} is not exact for {type(causal_lm).__name__}: a 4-branch probe tree run depth-first (units of "
            f"{PROBE_UNIT_TOKENS} tokens) differs from the same tree packed by up to {difference:.2e} per token "
            f"(relative; bound {allowed:.1e} for {dtype}): something in the model reads context other than the "
            "attention keys/values, convolution inputs and recurrent states carried between units. Use "
            "tree_execution='packed'. If you know better, opt out with self_check=False / tree_self_check=False / "
            "HF_TREE_SELF_CHECK=0."
        )
    return difference


def _prefix_of(
    stack: Sequence[_Pending], arrays: _TreeArrays, kv_end: torch.Tensor, position_ids: torch.Tensor
) -> PrefixCache:
    """The cache a unit (``kv_end``, ``position_ids`` ``[1, N]``) reads: the entries of every piece on the stack (its
    ancestors), in order."""
    keys = stack[0].cache_keys if stack else []
    cached = {key: PrefixCache.join(key, [p.cache_leaves[i] for p in stack]) for i, key in enumerate(keys)}
    positions = [arrays.position_ids[p.unit.start : p.unit.end] for p in stack]
    prefix_positions = torch.cat([position_ids[0, :0], *positions])[None]
    return PrefixCache.over(cached, prefix_positions, kv_end, position_ids)
