"""What the first-use check verified and a later step could undo, guarded on every tree pass.

The check (``hf_tree.models.check``) runs once per model and is cached. Two things can change a model underneath it
without any new model object for the check to see:

- bitsandbytes repacks a ``Linear4bit``'s weight, for good, for its bfloat16 CPU inference kernel, which has no
  backward (no gradient flows through the layer), on the layer's first eval-mode forward without gradients on a CPU
  with AVX512-BF16. A trainer's own no-grad passes would do it after the check: DPO's and KTO's reference
  precompute, evaluation (``prediction_step``), GRPO's evaluation generation. From the check on (and from a tree
  trainer's ``__init__``), the model's 4-bit layers are kept off that kernel (``keep_training_kernels``: they compute
  as in training, float32, without the bfloat16 rounding); a repack by any other path is refused at the next tree
  pass.
- Reloading a hybrid model's modeling module (``importlib.reload``) runs it again and binds its mixer ops back to
  the plain ones (siblings mix). ``import hf_tree`` patches a reload again (``hf_tree.post_import``); a module whose
  ops were rebound another way is refused at the next tree pass.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from hf_tree.models.hybrid_modules import TREE_MIXER_MODULES, modeling_module
from hf_tree.models.mixers.install import TREE_OPS, is_tree_dispatch

_MIXER_MODULE_NAMES = frozenset(modeling_module(name) for name in TREE_MIXER_MODULES)


def four_bit_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of every bitsandbytes ``Linear4bit`` in ``model`` (none when bitsandbytes is not imported:
    a model with such layers has imported it)."""
    bitsandbytes = sys.modules.get("bitsandbytes")
    if bitsandbytes is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]


def keep_training_kernels(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Keep ``model``'s 4-bit layers off bitsandbytes' CPU inference repack for good; returns them.

    ``Linear4bit.forward`` repacks when the input is on the CPU, the layer is in eval mode, the input needs no
    gradient and ``layer.support_avx512bf16_for_cpu`` (bitsandbytes' probe of the CPU, set in ``__init__``) holds;
    clearing that flag leaves every forward on the kernel training runs."""
    layers = four_bit_layers(model)
    for _, layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return layers


def repacked_layers(layers: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """Names of the ``layers`` whose weight bitsandbytes has repacked for its CPU inference kernel (its own flag)."""
    return [name for name, layer in layers if getattr(layer.weight.quant_state, "packing_format_for_cpu", False)]


def refuse_inference_packed_weights(model: torch.nn.Module, layers: list | None = None) -> None:
    """``ValueError`` when bitsandbytes has repacked 4-bit weights of ``model`` (``layers``: its ``four_bit_layers``,
    found when ``None``) for its CPU inference kernel, which rounds inputs to bfloat16 and has no backward: training
    forwards keep using it and no gradient flows through these layers (every LoRA gradient below them is wrong), in
    TRL's trainers as in hf_tree's."""
    packed = repacked_layers(four_bit_layers(model) if layers is None else layers)
    if packed:
        raise ValueError(
            f"{type(model).__name__}: bitsandbytes repacked the 4-bit weights of {len(packed)} layers ({packed[0]}, "
            "...) for its bfloat16 CPU inference kernel, which has no backward: no gradient would flow through "
            "them. It does this on an eval-mode forward without gradients (e.g. generate() before training, or in a "
            "callback). Load the model again and call model.train() before any such forward."
        )


def mixer_modules_of(model: torch.nn.Module) -> tuple[ModuleType, ...]:
    """The modeling modules of ``TREE_MIXER_MODULES`` that define some module class of ``model``."""
    names = {type(m).__module__ for m in model.modules()} & _MIXER_MODULE_NAMES
    return tuple(sys.modules[name] for name in sorted(names) if name in sys.modules)


def refuse_plain_mixers(model: torch.nn.Module, modules: tuple[ModuleType, ...]) -> None:
    """``ValueError`` when a mixer op of one of ``modules`` (``mixer_modules_of(model)``) is no longer the tree-aware
    dispatcher of ``hf_tree.models.mixers`` (rebound after ``import hf_tree``)."""
    plain = [
        f"{module.__name__}.{op}"
        for module in modules
        for op in TREE_OPS
        if getattr(module, op, None) is not None and not is_tree_dispatch(getattr(module, op))
    ]
    if plain:
        raise ValueError(
            f"{type(model).__name__}: {', '.join(plain)} is no longer hf_tree's tree-aware mixer op (the module was "
            "re-executed or the name rebound after the model's first-use check): sibling branches would mix. Call "
            "hf_tree.models.mixers.install.install_tree_mixers() after rebinding it."
        )


@dataclass(frozen=True)
class CheckedModel:
    """What ``check_model_for_trees`` verified on a causal LM that a later step could undo, checked on every pass.

    Attributes:
        four_bit_layers: ``(name, layer)`` of its bitsandbytes ``Linear4bit`` layers (kept off the inference repack).
        mixer_modules: the modeling modules whose mixer ops must stay tree-aware.
    """

    four_bit_layers: list[tuple[str, torch.nn.Module]]
    mixer_modules: tuple[ModuleType, ...]

    @classmethod
    def of(cls, causal_lm: torch.nn.Module) -> CheckedModel:
        """Record ``causal_lm`` as checked now, keeping its 4-bit layers off the inference repack."""
        return cls(keep_training_kernels(causal_lm), mixer_modules_of(causal_lm))

    def refuse_changes(self, causal_lm: torch.nn.Module) -> None:
        """``ValueError`` (``refuse_inference_packed_weights``, ``refuse_plain_mixers``) when the model changed."""
        if self.four_bit_layers:
            refuse_inference_packed_weights(causal_lm, self.four_bit_layers)
        if self.mixer_modules:
            refuse_plain_mixers(causal_lm, self.mixer_modules)
