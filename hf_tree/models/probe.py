"""The first-use probe: a small tree through the real model against its branches run alone.

``probe_tree_exactness`` runs a tree of a shared prefix and three sibling branches once packed (``kv_end``, depth
positions) and once branch by branch with the model's own attention (``sdpa``, or ``eager`` where the model refuses
``sdpa``), in the model's dtype, forward only, and compares every decoder layer's output at every branch token.

What it can see (``probe_shape``). A module that reads the packed row ``d`` tokens back instead of the tree (a
convolution, a scan, a window counted in packed positions, a custom mixer) differs from the branches alone as soon
as some token's ``d``-th predecessor in the row is a sibling's token. The first sibling is made longer than the
farthest the model declares it can read (sliding windows, attention chunks, convolution kernels, scan chunks:
``declared_reach``) and than ``DEFAULT_PROBE_REACH`` for what it does not declare, so every reach ``d`` up to that
length lands in a sibling for some token of the second. The probe never exceeds the model's position table
(``max_position_embeddings``) nor a length switch of its RoPE: a reach beyond those is not seen.

The bound (``tolerance``). Exact implementations differ from the branches alone by rounding only, and how much
depends on the dtype, the kernels and the model's activations. The probe measures that floor on the model itself:
the branches run a second time right-padded (other matmul shapes, mathematically the same tokens for a causal model)
and, in a float32 model, a third time with its parameters in float64 (its float32 scans and reductions round more
than a unit: pure Mamba2's SSD scan), and a layer is accepted when its tree difference is within ``FLOOR_FACTOR``
times the larger of the largest floor measured over the layers and the dtype's own unit roundoff (``MIN_FLOOR``).
In a mixture-of-experts model every reference run routes each token as the tree did (``hf_tree.models.
pinned_routing``: a top-k tie flips on rounding alone).

The invariance check. Replacing one sibling's tokens must leave every other branch's tokens unchanged, bit for bit
in an exact model (a masked key contributes an exact zero), whatever the dtype: this sees leaks far below the
dtype's rounding. Mixture-of-experts models regroup tokens by expert, which rounds the others differently; for them
the same replacement in a padded batch of all branches measures how much, and the bound follows.

Differences are measured per token (the largest element difference over the token's largest element), so a leak into
a few tokens is not diluted by the row's largest activations.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_tree.attention import attention_engine_scope
from hf_tree.models.introspection import backbone_of, causal_lm_of, eval_mode_no_grad, own_attention, probe_ids
from hf_tree.models.pinned_routing import recording_routing, replaying_routing
from hf_tree.packing import pack_and_place
from hf_tree.tree import Tree

# Look-back (tokens) the probe covers when the model declares nothing longer: what undeclared mixers (a custom
# block, a dilated convolution) are checked up to. Costs about 2 x (this + 20) tokens of forward, once per model.
DEFAULT_PROBE_REACH = 256
# Cost cap: a declared reach beyond this (e.g. a 32k sliding window) is probed up to here only.
MAX_PROBE_REACH = 8192
# Config keys (at any nesting) that declare how far back a layer reads other than through full attention.
REACH_KEYS = (
    "sliding_window",
    "attention_chunk_size",
    "local_attention",
    "window_size",
    "chunk_size",
    "conv_L_cache",
    "conv_kernel",
    "conv_kernel_size",
    "linear_conv_kernel_dim",
    "mamba_d_conv",
    "d_conv",
)
# Config keys bounding the positions a model can embed: the probe's longest branch stays within them.
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
PROBE_PREFIX = 6
# The siblings after the long first one: short, so a reach beyond the first sibling lands in it from them.
PROBE_SHORT_SUFFIXES = (5, 7)
# Pad tokens after the longest branch of a padded floor batch (other matmul shapes than the branch alone).
PROBE_PADDING = 8

# Accepted ratio of a layer's tree difference to the rounding floor. Measured on the model zoo and SmolLM2 (docs/
# models.md, "What the self-check sees"): exact models stay below 4 x the floor, leaks measured so far sit at 20 x
# and more.
FLOOR_FACTOR = 8.0
# The smallest floor per dtype: its unit roundoff (a floor measured as exactly 0, e.g. when the padded batch rounds
# bit for bit like the branches, must not make the bound 0). Float64 models keep float32 internals (HF's RMSNorm).
MIN_FLOOR = {
    torch.float64: 2.0**-24,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


@dataclass(frozen=True)
class ProbeShape:
    """The probe tree: ``prefix`` shared tokens, then one sibling branch of each length in ``suffixes``.

    ``reach``: the longest look-back (tokens) that the shape turns into a sibling's token for some probed token.
    """

    prefix: int
    suffixes: tuple[int, ...]
    reach: int

    @property
    def longest_branch(self) -> int:
        return self.prefix + max(self.suffixes)


def _config_ints(config: Any, keys: tuple[str, ...]) -> list[int]:
    """Positive int values of ``keys`` anywhere in ``config`` (nested text/vision sub-configs included)."""
    values = config.to_dict() if hasattr(config, "to_dict") else config
    found = []
    for key, value in values.items():
        if isinstance(value, dict):
            found += _config_ints(value, keys)
        elif key in keys and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append(value)
    return found


def declared_reach(config: Any) -> int:
    """The farthest look-back (tokens) ``config`` declares for a layer other than full attention (0 if none)."""
    return max(_config_ints(config, REACH_KEYS), default=0)


def probe_shape(config: Any, length_limit: int | None = None) -> ProbeShape:
    """The probe tree for a model: its first sibling covers ``max(declared_reach, DEFAULT_PROBE_REACH)`` (capped at
    ``MAX_PROBE_REACH``), and no branch is longer than ``length_limit`` or the model's position table."""
    # The padded floor batches run PROBE_PADDING positions past the longest branch: they must fit the table too.
    table = [limit - PROBE_PADDING for limit in _config_ints(config, POSITION_LIMIT_KEYS)]
    limits = [limit for limit in (length_limit, *table) if limit]
    wanted = min(max(declared_reach(config), DEFAULT_PROBE_REACH), MAX_PROBE_REACH)
    longest = min([PROBE_PREFIX + wanted + 1, *limits])
    first = max(longest - PROBE_PREFIX, max(PROBE_SHORT_SUFFIXES) + 1)
    # A look-back d from the second sibling's k-th token lands in the first sibling for k in [d - first, d).
    return ProbeShape(PROBE_PREFIX, (first, *PROBE_SHORT_SUFFIXES), reach=first + PROBE_SHORT_SUFFIXES[0] - 1)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


@contextlib.contextmanager
def _recording(modules: dict[str, torch.nn.Module]) -> Iterator[dict[str, tuple[torch.Tensor | None, torch.Tensor]]]:
    """Record ``name -> (first input tensor, first output tensor)`` of each module's last call."""
    records: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            out = _first_tensor(output)
            if out is not None:
                inp = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
                records[name] = (inp, out)

        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def token_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-token relative difference of ``[T, ...]`` tensors: ``max_t max|got_t - expected_t| /
    max|expected_t|`` (inf when the shapes differ)."""
    if got.shape != expected.shape:
        return float("inf")
    got, expected = got.double().reshape(got.shape[0], -1), expected.double().reshape(expected.shape[0], -1)
    scale = expected.abs().amax(dim=1).clamp_min(1e-30)
    return float(((got - expected).abs().amax(dim=1) / scale).max()) if got.numel() else 0.0


@dataclass
class ProbeRun:
    """Per recorded module: ``(input, output)`` of the packed tree at each branch's tokens, of each branch alone and
    of the branches right-padded, each ``[branch tokens of all branches, ...]``; the autocast dtype the backbone ran
    under (None without autocast); and the invariance measurements."""

    tree: dict[str, tuple[torch.Tensor | None, torch.Tensor]]
    alone: dict[str, tuple[torch.Tensor | None, torch.Tensor]]
    padded: dict[str, tuple[torch.Tensor | None, torch.Tensor]]
    # the branches alone once more with every float32 parameter and buffer in float64 (float32 models only; empty
    # where not measured): how far the model's own float32 run is from its math
    float64: dict[str, tuple[torch.Tensor | None, torch.Tensor]]
    autocast: torch.dtype | None
    # per module: the largest per-token change of the tokens kept when one sibling's tokens are replaced,
    # ``(tree input, tree output, padded-batch input, padded-batch output)``
    invariance: dict[str, tuple[float, ...]]

    def difference(self, name: str, which: int = 1) -> float:
        """Tree vs branches alone for ``name``'s output (``which=1``) or input (``0``)."""
        return _difference(self.tree, self.alone, name, which)

    def floor(self, name: str, which: int = 1) -> float:
        """The rounding two exact runs of ``name`` differ by: padded batch vs branches alone, and (float32 models)
        the branches alone in float64 vs in float32, the larger."""
        padded = _difference(self.padded, self.alone, name, which)
        return _nan_max(padded, _difference(self.float64, self.alone, name, which))


def _nan_max(a: float, b: float) -> float:
    """The larger of two measurements; nan (not measured) only when both are."""
    if a != a:
        return b
    return a if b != b else max(a, b)


def _difference(a: dict, b: dict, name: str, which: int) -> float:
    x, y = a.get(name, (None, None))[which], b.get(name, (None, None))[which]
    if x is None or y is None:
        return float("nan")
    return token_difference(x, y)


def probe_branches(config: Any, shape: ProbeShape) -> list[list[int]]:
    """The probe's branches: random ids (a private generator) for the prefix and each sibling."""
    cpu = torch.device("cpu")
    prefix = probe_ids(config.vocab_size, shape.prefix, seed=1, device=cpu).tolist()
    return [
        prefix + probe_ids(config.vocab_size, n, seed=2 + i, device=cpu).tolist() for i, n in enumerate(shape.suffixes)
    ]


def _gather(records: list[dict], picks: list[tuple[int, torch.Tensor]]) -> dict:
    """Concatenate, per module, ``records[r][name][k][0 or row, tokens]`` over ``picks = [(row, tokens), ...]``
    (one record per call: a list of calls; each call's tensors are ``[B, T, ...]``)."""
    names = set.intersection(*(set(r) for r in records)) if records else set()
    out = {}
    for name in names:
        pair = []
        for k in (0, 1):
            parts = []
            for (row, tokens), record in zip(picks, records):
                tensor = record[name][k]
                if tensor is None or tensor.dim() < 2 or tensor.shape[0] <= row or tensor.shape[1] <= int(tokens.max()):
                    parts = None
                    break
                parts.append(tensor[row, tokens.to(tensor.device)])
            pair.append(torch.cat(parts) if parts else None)
        if pair[1] is not None:
            out[name] = (pair[0], pair[1])
    return out


def _invariant(base: dict, variant: dict, name: str, tokens: torch.Tensor, row: int = 0, which: int = 1) -> float:
    """Per-token difference of ``name``'s output (``which=1``) or input (``0``) at ``tokens`` of ``row`` between two
    runs (nan where not recorded or not sequence-shaped)."""
    if name not in base or name not in variant:
        return float("nan")
    x, y = base[name][which], variant[name][which]
    if (
        x is None
        or y is None
        or x.dim() < 2
        or x.shape != y.shape
        or x.shape[0] <= row
        or x.shape[1] <= int(tokens.max())
    ):
        return float("nan")
    tokens = tokens.to(x.device)
    return token_difference(y[row, tokens], x[row, tokens])


@contextlib.contextmanager
def _float64_parameters(model: torch.nn.Module) -> Iterator[bool]:
    """Every parameter and floating buffer of ``model`` in float64 for the block, then back to the very same float32
    tensors; yields whether it did. It does not (yields False) unless every floating parameter is a plain, local
    float32 ``Parameter``: not sharded (FSDP, ZeRO-3), quantized or partly in another dtype. Costs a float64 copy
    of the weights (twice a float32 model, less than the gradients and optimizer states training adds)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    plain = all(
        type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor and p.dtype == torch.float32 and p.numel()
        for p in params
    )  # a DTensor (FSDP2), a flat or 4-bit parameter class, an empty ZeRO-3 placeholder: left alone
    if not params or not plain:
        yield False
        return
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    buffers = [(m, n, b) for m, n, b in buffers if b.dtype == torch.float32]
    originals = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.double()
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.double()
        yield True
    finally:
        for p, original in zip(params, originals):
            p.data = original
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


def run_probe(
    model, causal_lm: PreTrainedModel, modules: dict[str, torch.nn.Module], shape: ProbeShape, routed: bool
) -> ProbeRun:
    """Forward the probe tree packed, its branches alone and right-padded, recording ``modules`` (see
    ``ProbeRun``); then the tree again with the first, then the second sibling's tokens replaced (the invariance
    check). ``model``: what to call (the possibly wrapped model, or its forward). ``routed``: a mixture-of-experts
    model, whose batch rows round each other (``routes_tokens``): its padded batch holds every branch and runs again
    with each replacement, to measure that; other models' rows cannot change each other, so their floor is 0."""
    config = causal_lm.config.get_text_config()
    device = causal_lm.get_input_embeddings().weight.device
    branches = probe_branches(config, shape)
    tree = Tree.from_sequences(branches)
    batch, _, parts, _ = pack_and_place([tree], max_packed_tokens=tree.num_tokens)
    flat = [torch.as_tensor(parts[0].branch_flat_indices(b)) for b in range(len(branches))]
    tokens = [torch.arange(len(b)) for b in branches]
    # Right padding is invisible to a causal model's real tokens: the same tokens in other matmul shapes. The long
    # first sibling gets a batch of its own (cheap) unless the rows must share one batch (routed).
    groups = [list(range(len(branches)))] if routed else [[0], list(range(1, len(branches)))]
    pad = probe_ids(config.vocab_size, 1, seed=0, device=torch.device("cpu")).item()

    def padded_ids(group: list[int], rows: list[list[int]]) -> torch.Tensor:
        width = max(len(rows[b]) for b in group) + PROBE_PADDING
        return torch.tensor([rows[b] + [pad] * (width - len(rows[b])) for b in group])

    def record_precision(module, args):  # a trainer's autocast may be entered inside the (wrapped) forward
        if torch.is_autocast_enabled(device.type):
            precision.append(torch.get_autocast_dtype(device.type))

    def tree_forward(input_ids: torch.Tensor) -> dict:
        with _recording(modules) as records:
            model(
                input_ids=input_ids.to(device),
                position_ids=batch["position_ids"].to(device),
                kv_end=batch["kv_end"].to(device),
                use_cache=False,
            )
        return records

    def own_forward(input_ids: torch.Tensor, rows: torch.Tensor) -> dict:
        """The model's own attention on ``input_ids``, each token routed as the tree's row ``rows[t]`` (-1: its
        own routing; ``hf_tree.models.pinned_routing``) in a mixture-of-experts model."""
        pinned = replaying_routing(experts, routing, rows) if routed else contextlib.nullcontext()
        with _recording(modules) as records, own_attention(causal_lm), pinned:
            model(input_ids=input_ids.to(device), use_cache=False)
        return records

    def padded_rows(group: list[int], kept: dict[int, int]) -> torch.Tensor:
        """The tree row of each token of ``padded_ids(group, ...)``: branch ``b``'s first ``kept[b]`` tokens are
        the tree's, the rest (padding, replaced tokens) route on their own."""
        width = max(len(branches[b]) for b in group) + PROBE_PADDING
        rows = torch.full((len(group), width), -1)
        for row, b in enumerate(group):
            rows[row, : kept[b]] = flat[b][: kept[b]]
        return rows.reshape(-1)

    precision: list[torch.dtype] = []
    hook = backbone_of(causal_lm).register_forward_pre_hook(record_precision)
    # [tree input, tree output, padded input, padded output]: the largest change of the kept tokens.
    invariance = {name: [float("nan"), float("nan"), 0.0, 0.0] for name in modules}
    # mixture-of-experts: the tree's routing, replayed in the reference runs (hf_tree.models.pinned_routing)
    experts = {n for n in _config_ints(config, EXPERT_KEYS) if n > 1}
    whole = {b: len(branch) for b, branch in enumerate(branches)}
    try:
        with recording_routing(experts) if routed else contextlib.nullcontext([]) as routing:
            tree_records = tree_forward(batch["input_ids"])
        alone = [own_forward(torch.tensor([branch]), flat[b]) for b, branch in enumerate(branches)]
        padded = [own_forward(padded_ids(group, branches), padded_rows(group, whole)) for group in groups]
        float64 = []
        if not precision:  # a float32 model's own rounding: its scans and norms round more than a unit
            try:
                with _float64_parameters(causal_lm) as upcast:
                    if upcast:
                        float64 = [own_forward(torch.tensor([branch]), flat[b]) for b, branch in enumerate(branches)]
            except (RuntimeError, TypeError, NotImplementedError, ValueError):
                float64 = []  # a kernel without float64 (grouped_mm experts): the padded batch's floor alone
        for sibling in (0, 1):
            suffix = shape.suffixes[sibling]
            fresh = probe_ids(config.vocab_size, suffix, seed=100 + sibling, device=torch.device("cpu")).tolist()
            changed = batch["input_ids"].clone()
            changed[0, flat[sibling][-suffix:]] = torch.tensor(fresh)
            others = [b for b in range(len(branches)) if b != sibling]
            kept = torch.cat([flat[0][: shape.prefix], *(flat[b][-shape.suffixes[b] :] for b in others)])
            variant = tree_forward(changed)
            padded_variant = None
            if routed:
                rows = [branch if b != sibling else branch[: shape.prefix] + fresh for b, branch in enumerate(branches)]
                kept_tokens = whole | {sibling: shape.prefix}  # the replaced sibling keeps the prefix's routing
                padded_variant = own_forward(padded_ids(groups[0], rows), padded_rows(groups[0], kept_tokens))
            for name, which in itertools.product(modules, (0, 1)):
                change = _invariant(tree_records, variant, name, kept, which=which)
                invariance[name][which] = _nan_max(invariance[name][which], change)
                if padded_variant is not None:
                    for b in others:
                        change = _invariant(padded[0], padded_variant, name, tokens[b], row=b, which=which)
                        invariance[name][2 + which] = _nan_max(invariance[name][2 + which], change)
    finally:
        hook.remove()
    where = {b: (g, row) for g, group in enumerate(groups) for row, b in enumerate(group)}
    return ProbeRun(
        tree=_gather([tree_records] * len(branches), [(0, f) for f in flat]),
        alone=_gather(alone, [(0, t) for t in tokens]),
        padded=_gather(
            [padded[where[b][0]] for b in range(len(branches))], [(where[b][1], t) for b, t in enumerate(tokens)]
        ),
        float64=_gather(float64, [(0, t) for t in tokens]) if float64 else {},
        autocast=precision[0] if precision else None,
        invariance={name: tuple(values) for name, values in invariance.items()},
    )


def bound(floor: float, dtype: torch.dtype, fraction: float = 1.0) -> float:
    """The largest accepted difference given a measured rounding ``floor`` in ``dtype``: ``FLOOR_FACTOR`` times the
    larger of the floor and ``fraction`` of the dtype's ``MIN_FLOOR`` (a nan floor, not measured, counts as 0)."""
    minimum = MIN_FLOOR.get(dtype, 2.0**-8) * fraction
    return FLOOR_FACTOR * max(floor if floor == floor else 0.0, minimum)


# The invariance check's floor is usually exactly 0 (a sibling's tokens cannot change another branch's computation
# by a single bit); its minimum is this fraction of ``MIN_FLOOR``, so the bound stays at half a unit in the last
# place of a token's largest element.
INVARIANCE_FRACTION = 1 / 16
# Config keys of mixture-of-experts models. Their routers group tokens by expert, so replacing a sibling's tokens
# regroups the others and rounds them differently (flex_olmo in float32: 1.2 units in the last place, where the
# padded batch happened to measure 0): their invariance minimum is a whole ``MIN_FLOOR``.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routes_tokens(config: Any) -> bool:
    """Whether ``config`` declares more than one expert (a mixture-of-experts model)."""
    return any(n > 1 for n in _config_ints(config, EXPERT_KEYS))


@dataclass
class Verdict:
    """One recorded module's measurements against its bounds (relative per-token differences)."""

    name: str
    difference: float  # tree vs each branch alone
    difference_bound: float
    invariance: float  # change of other branches' tokens when one sibling's tokens are replaced, in the tree
    invariance_bound: float

    @property
    def exact(self) -> bool:
        """Both measurements within their bounds (an unmeasured one, nan, does not fail)."""
        return not (self.difference > self.difference_bound or self.invariance > self.invariance_bound)


def verdicts(
    run: ProbeRun,
    names: list[str],
    dtype: torch.dtype,
    routed: bool,
    which: int = 1,
    rounding: torch.dtype | None = None,
) -> dict[str, Verdict]:
    """The ``Verdict`` of each module's output (``which=1``) or input (``0``). The difference floor is the largest
    measured over ``names`` (rounding accumulates through the layers, and one layer's floor is a noisy sample of
    it); ``routed``: a mixture-of-experts model (see ``EXPERT_KEYS``). ``rounding``: the coarsest dtype some part of
    the model rounds to (default ``dtype``), whose unit roundoff is the difference check's minimum floor: a part
    that rounds its inputs to it turns the attention engines' float32 rounding into a flip of its own last place,
    which the padded batch (bit for bit the same inputs in row-independent kernels) does not measure. The
    invariance check keeps ``dtype``: the kept tokens' inputs stay bit for bit the same, whatever a part rounds to."""
    floor = functools.reduce(_nan_max, [run.floor(name, which) for name in names], float("nan"))
    fraction = 1.0 if routed else INVARIANCE_FRACTION
    result = {}
    for name in names:
        tree_change, padded_change = run.invariance.get(name, (float("nan"),) * 4)[which::2]
        result[name] = Verdict(
            name,
            run.difference(name, which),
            bound(floor, rounding or dtype),
            tree_change,
            bound(padded_change, dtype, fraction),
        )
    return result


def probe_modules(causal_lm: PreTrainedModel) -> dict[str, torch.nn.Module]:
    """``{"layer i": decoder layer i, ..., "backbone": the backbone}``: what the probe compares."""
    lists = [m for m in backbone_of(causal_lm).modules() if isinstance(m, torch.nn.ModuleList)]
    layers = list(max(lists, key=len)) if lists else []
    modules = {f"layer {i}": layer for i, layer in enumerate(layers)}
    modules["backbone"] = backbone_of(causal_lm)
    return modules


def measure(model: torch.nn.Module, modules: dict[str, torch.nn.Module], shape: ProbeShape, forward=None) -> ProbeRun:
    """``run_probe`` in eval mode, without gradients, autocast or context parallel, leaving RNG state untouched."""
    causal_lm = causal_lm_of(model)
    # the probe runs whole on every rank: no scoped engine (tree context parallel's), the automatic one
    with eval_mode_no_grad(model), attention_engine_scope(None):
        return run_probe(forward or model, causal_lm, modules, shape, routes_tokens(causal_lm.config))
