"""RoPE whose frequencies depend on the sequence's length: exact on trees below the switch, refused above it.

transformers' ``dynamic_rope_update`` recomputes the rotary frequencies of two rope types from the largest position
id of the *whole batch* (``max(position_ids) + 1``):

- ``longrope`` (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini, PhiMoE): short factors up to
  ``original_max_position_embeddings`` (4096 on those models), long factors beyond it;
- ``dynamic`` NTK scaling: the base grows with the length beyond ``max_position_embeddings`` (and a rotary that
  grew once keeps its grown frequencies until a call shorter than that resets it).

A packed tree batch's largest position is its deepest branch (positions are depths), so while every branch of the
batch is within the switch, each branch gets the frequencies it would get alone: exact. Past it, every branch of the
batch, short ones and other rows' trees included, would get the long-context frequencies: silently wrong. Sharing
cannot be rescued by packing differently either: a prefix shared by branches on both sides of the switch has
different keys for each (its rotary frequencies differ), so its computation is not shared at all. Hence a
``ValueError`` before the forward, naming the rope type, the switch and the longest branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import torch

from hf_tree.packing import PackingConfig

# HunYuan's rotary turns "dynamic" with a fixed ``alpha`` into static NTK-alpha frequencies: no switch.
STATIC_DYNAMIC_WITH_ALPHA = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl"})
# PhiMoE's rotary recomputes its short frequencies every forward and switches only its attention scale
# (``short_mscale``/``long_mscale``) at ``original_max_position_embeddings``.
MSCALE_SWITCH_MODELS = frozenset({"phimoe"})


@dataclass(frozen=True)
class LengthSwitch:
    """One length-dependent rope of a model: ``rope_type`` switches at ``switch`` tokens; branches of at most
    ``longest_exact`` tokens train exactly."""

    rope_type: str
    switch: int
    longest_exact: int
    layer_type: str | None = None

    def describe(self) -> str:
        where = f" ({self.layer_type} layers)" if self.layer_type else ""
        if self.rope_type == "longrope":
            return f"rope_type='longrope'{where} switches to its long factors past original_max_position_embeddings="
        return f"rope_type={self.rope_type!r}{where} rescales its frequencies from max_position_embeddings="


def _rope_dicts(config: Any) -> list[tuple[str | None, dict]]:
    """``(layer type or None, rope parameters)`` of a text config: one dict, or one per layer type."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return []
    if "rope_type" in parameters or "type" in parameters:
        return [(None, parameters)]
    return [(name, value) for name, value in parameters.items() if isinstance(value, dict)]


def length_switches(config: Any) -> list[LengthSwitch]:
    """The length-dependent ropes of ``config`` (its text config), empty for every other rope."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "")
    switches = []
    for layer_type, parameters in _rope_dicts(text):
        rope_type = parameters.get("rope_type", parameters.get("type"))
        if model_type in MSCALE_SWITCH_MODELS:
            mscales = parameters.get("short_mscale"), parameters.get("long_mscale")
            switch = parameters.get("original_max_position_embeddings")
            if rope_type not in (None, "default") and mscales[0] != mscales[1] and switch:
                switches.append(LengthSwitch(f"{rope_type} (attention scale)", int(switch), int(switch), layer_type))
        elif rope_type == "longrope":
            switch = parameters.get("original_max_position_embeddings") or getattr(
                text, "original_max_position_embeddings", None
            )
            if switch:  # long factors iff max(position_ids) + 1 > switch
                switches.append(LengthSwitch(rope_type, int(switch), int(switch), layer_type))
        elif rope_type is not None and "dynamic" in str(rope_type):
            if model_type in STATIC_DYNAMIC_WITH_ALPHA and parameters.get("alpha"):
                continue
            switch = getattr(text, "max_position_embeddings", None)
            if switch:  # a call of exactly ``switch`` tokens keeps frequencies a longer call grew; shorter ones reset
                switches.append(LengthSwitch(str(rope_type), int(switch), int(switch) - 1, layer_type))
    return switches


def longest_exact_branch(config: Any) -> int | None:
    """The longest branch the model trains exactly on trees (``None``: no length-dependent rope)."""
    switches = length_switches(config)
    return min(s.longest_exact for s in switches) if switches else None


def check_rope_lengths(config: Any, position_ids: torch.Tensor, where: str = "this tree batch") -> None:
    """Refuse a tree batch whose longest branch crosses a length switch of the model's rope.

    Args:
        config: the model's config.
        position_ids: ``[B, N]`` depth positions of the packed batch (the whole batch the forward will see).
        where: what holds them, for the message.

    Raises:
        ValueError: naming the rope type, the switch, the longest branch and the fix.
    """
    switches = length_switches(config)
    if not switches or position_ids.numel() == 0:
        return
    longest = int(position_ids.max()) + 1  # depths: the deepest branch of the batch
    for switch in switches:
        if longest > switch.longest_exact:
            raise ValueError(
                f"{switch.describe()}{switch.switch}, and {where}'s longest branch has {longest} tokens: every "
                "branch of the batch would get the frequencies of the longest one (transformers picks them from the "
                "largest position of the whole batch), so shorter branches would train silently wrong, and a prefix "
                "shared across the switch cannot be shared (its keys differ on each side). Keep branches within "
                f"{switch.longest_exact} tokens: max_branch_tokens={switch.longest_exact} with overlong='truncate' or "
                "'drop' (counted and reported), or train this model on flat sequences."
            )


def _longest_dataset_branch(dataset: datasets.Dataset) -> int:
    """The longest branch (tokens) of a dataset of ``Tree.to_dict()`` rows, read column-wise from Arrow."""
    from hf_tree.dataset_drops import branch_lengths_by_row  # a trainer-level module: models sit below it

    return max((max(lengths, default=0) for (lengths,) in branch_lengths_by_row(dataset)), default=0)


def check_dataset_rope_lengths(config: Any, collator: Any, dataset: Any) -> None:
    """Before training: refuse a tree dataset whose longest branch, as ``collator`` passes it on, crosses a length
    switch (the per-batch check would stop only at the first such batch, possibly after many optimizer steps).

    Free unless the model has a switch and the tree collator (a ``TreeDataCollator``: its ``packing``, a
    ``PackingConfig``) lets longer branches through (its ``max_branch_tokens``: "truncate"/"drop" cut longer ones to
    it); then one pass over the tree columns. Other collators and datasets (iterable, not tree rows) are left to the
    per-batch check.

    Raises:
        ValueError: as ``check_rope_lengths``.
    """
    longest_exact = longest_exact_branch(config)
    packing = getattr(collator, "packing", None)
    if longest_exact is None or not isinstance(packing, PackingConfig):
        return
    branch_limit = packing.branch_limit
    if branch_limit <= longest_exact:
        return
    if not isinstance(dataset, datasets.Dataset) or "branch_end_nodes" not in dataset.column_names:
        return
    longest = min(_longest_dataset_branch(dataset), branch_limit)
    check_rope_lengths(config, torch.arange(longest)[None], f"the training dataset (max_branch_tokens={branch_limit})")
