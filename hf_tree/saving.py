"""Saving under FSDP2: the final ``save_model`` writes the model or PEFT adapter a single-process run writes.

``transformers.Trainer.save_model`` writes model files under FSDP only with ``FULL_STATE_DICT``; with
``SHARDED_STATE_DICT`` (every shipped ``fsdp_configs/*.json``) it writes nothing, and even with ``FULL_STATE_DICT``
the all-gathered state dict holds tied weights (``lm_head.weight`` = ``model.embed_tokens.weight``) as two
separate tensors, so ``save_pretrained`` cannot see the tie and writes an extra ``lm_head.weight``.

``FSDPFullSaveMixin.save_model`` instead gathers the full state dict (``accelerator.get_state_dict``: torch's
``get_model_state_dict`` with ``full_state_dict=True, cpu_offload=True``, so only rank 0 holds it, in CPU memory),
re-ties shared parameters, and lets rank 0 write it through ``Trainer._save`` (``save_pretrained`` of the model or
of the PEFT adapter). Intermediate checkpoints under ``SHARDED_STATE_DICT`` stay sharded (the
``torch.distributed.checkpoint`` folder that ``Trainer`` writes next to the optimizer for resuming).

PEFT (0.21) selects an adapter's entries by the model's module names, which keep FSDP's activation-checkpoint wrapper
(``_checkpoint_wrapped_module.``) that ``get_model_state_dict`` drops: without care a LoRA model under
``fsdp_activation_checkpointing`` saves an adapter file with no tensors. The save hands PEFT the model's own names and
drops the wrapper from the written adapter file.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from itertools import chain
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME

logger = logging.getLogger("hf_tree")


def is_sharded_state_dict(accelerator: Accelerator) -> bool:
    """Whether the run's FSDP2 plugin asks for ``SHARDED_STATE_DICT`` checkpoints."""
    return accelerator.is_fsdp2 and "SHARDED_STATE_DICT" in str(accelerator.state.fsdp_plugin.state_dict_type)


def retie_shared_parameters(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """In place: state-dict entries of one shared parameter (tied embeddings) become one tensor again.

    The gather copies every name separately; ``save_pretrained`` recognises tied weights by shared storage, so
    without this it would write ``lm_head.weight`` beside ``model.embed_tokens.weight`` for a tied model.
    ``model`` may be FSDP-wrapped (FSDP2 keeps a shared parameter shared); names lose the activation-checkpoint
    wrapper prefix as in ``get_model_state_dict``.
    """
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of[id(parameter)].append(name.replace(_CHECKPOINT_PREFIX, ""))
    for names in names_of.values():
        present = [name for name in names if name in state_dict]
        for name in present[1:]:
            state_dict[name] = state_dict[present[0]]


def gather_full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of an FSDP2 ``model`` on rank 0 in CPU memory (``{}`` on other ranks).

    Collective: every rank must call it. Shared parameters are re-tied (``retie_shared_parameters``).
    """
    state_dict = accelerator.get_state_dict(model)
    if state_dict:
        retie_shared_parameters(model, state_dict)
    return state_dict


def checkpoint_wrapped_names(model: torch.nn.Module) -> dict[str, str]:
    """``{name without the activation-checkpoint wrapper: the model's own name}`` for the parameters and buffers of
    ``model`` inside an activation-checkpoint wrapper (``{}`` without FSDP activation checkpointing)."""
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return {name.replace(_CHECKPOINT_PREFIX, ""): name for name, _ in named if _CHECKPOINT_PREFIX in name}


def strip_checkpoint_prefix(adapter_file: Path) -> None:
    """Rewrite a safetensors file whose keys carry the activation-checkpoint wrapper without it."""
    tensors = load_file(adapter_file)
    save_file({k.replace(_CHECKPOINT_PREFIX, ""): v for k, v in tensors.items()}, adapter_file, {"format": "pt"})


class FSDPFullSaveMixin:
    """``save_model`` for ``Trainer`` subclasses that writes a complete model or adapter under FSDP2, whatever
    ``fsdp_state_dict_type`` says. Place it before the ``Trainer`` class in the bases."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP2, rank 0 writes the gathered full state dict (every rank must call).

        A checkpoint (``_internal_call``) under ``SHARDED_STATE_DICT`` keeps ``Trainer``'s sharded model folder,
        unless ``save_only_model`` (then ``Trainer`` writes no sharded folder, and the checkpoint gets the full
        model so that it holds one).
        """
        if not (self.is_fsdp_enabled and self.accelerator.is_fsdp2):
            return super().save_model(output_dir, _internal_call)
        sharded = is_sharded_state_dict(self.accelerator)
        if _internal_call and sharded and not self.args.save_only_model:
            if isinstance(self.model, PeftModel) and checkpoint_wrapped_names(self.model):
                logger.warning(
                    "hf_tree: this checkpoint holds no LoRA weights: under fsdp_activation_checkpointing with "
                    "fsdp_state_dict_type SHARDED_STATE_DICT, PEFT finds no adapter in the wrapped modules' state "
                    "dict, so resuming from it would restart the adapter (the final save is complete). For LoRA use "
                    "fsdp2_lora.json (fsdp_activation_checkpointing false, --gradient_checkpointing instead)."
                )
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = gather_full_state_dict(self.accelerator, self.model)
        wrapped = checkpoint_wrapped_names(self.model) if isinstance(self.model, PeftModel) else {}
        if wrapped:  # PEFT finds its entries under the model's own names (see the module docstring)
            state_dict = {wrapped.get(name, name): tensor for name, tensor in state_dict.items()}
        self._save(output_dir, state_dict=state_dict)
        if wrapped and self.args.should_save:
            strip_checkpoint_prefix(Path(output_dir) / ADAPTER_SAFE_WEIGHTS_NAME)
        self.accelerator.wait_for_everyone()  # the files exist for every rank once save_model returns
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
