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
(``_checkpoint_wrapped_module.``) that ``state_dict`` and ``get_model_state_dict`` drop: without care a LoRA model under
``fsdp_activation_checkpointing`` saves an adapter file with no tensors. The save hands PEFT the model's own names and
drops the wrapper from the written adapter file. Trainer's sharded checkpoint folder goes through the same PEFT
selection (accelerate's ``save_fsdp_model(adapter_only=True)``) and holds no adapter there, so such a run's
checkpoints also get the complete adapter file, which ``_load_from_checkpoint`` (resume) and ``_load_best_model``
load back into the sharded model.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME


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


def adapter_in_wrapped_modules(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model under FSDP activation checkpointing (PEFT cannot select its adapter from
    the state dict there: see the module docstring)."""
    return isinstance(model, PeftModel) and bool(checkpoint_wrapped_names(model))


def load_adapter_file(model: PeftModel, adapter_file: Path) -> None:
    """Load a saved adapter file (PEFT's key names, full tensors) into the FSDP2-sharded PEFT ``model``.

    Collective: every rank reads the file and keeps its own shards (``set_model_state_dict`` with full tensors).
    PEFT's own key mapping (``_remove_adapter_name_from_key``, the rule its save and load share) links the file's
    names to the model's; a name the model does not have raises.
    """
    adapter = model.active_adapter
    tuner = type(model.base_model)
    own_names = {name.replace(_CHECKPOINT_PREFIX, "") for name, _ in model.named_parameters(remove_duplicate=False)}
    by_file_key = {tuner._remove_adapter_name_from_key(name, adapter): name for name in own_names}
    tensors = load_file(adapter_file)
    unknown = sorted(set(tensors) - set(by_file_key))
    if unknown:
        raise ValueError(
            f"{adapter_file} holds {len(unknown)} tensors that the model's adapter {adapter!r} lacks (e.g. "
            f"{unknown[0]!r}): resume with the LoRA configuration that wrote this checkpoint."
        )
    state_dict = {by_file_key[key]: tensor for key, tensor in tensors.items()}
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))


class FSDPFullSaveMixin:
    """``save_model`` for ``Trainer`` subclasses that writes a complete model or adapter under FSDP2, whatever
    ``fsdp_state_dict_type`` says. Place it before the ``Trainer`` class in the bases."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP2, rank 0 writes the gathered full state dict (every rank must call).

        A checkpoint (``_internal_call``) under ``SHARDED_STATE_DICT`` keeps ``Trainer``'s sharded model folder
        alone, unless ``save_only_model`` (then ``Trainer`` writes no sharded folder, and the checkpoint gets the full
        model so that it holds one) or the adapter sits in activation-checkpointed modules (the sharded folder holds
        no adapter then; the checkpoint also gets the complete adapter file, loaded back on resume).
        """
        if not (self.is_fsdp_enabled and self.accelerator.is_fsdp2):
            return super().save_model(output_dir, _internal_call)
        sharded = is_sharded_state_dict(self.accelerator)
        if _internal_call and sharded and not self.args.save_only_model and not adapter_in_wrapped_modules(self.model):
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

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """``Trainer._load_from_checkpoint``, then the adapter file of a checkpoint whose sharded folder holds none."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_adapter_beside_sharded_folder(resume_from_checkpoint, self.model if model is None else model)

    def _load_best_model(self) -> None:
        """``Trainer._load_best_model``, then the adapter file of a checkpoint whose sharded folder holds none."""
        super()._load_best_model()
        self._load_adapter_beside_sharded_folder(self.state.best_model_checkpoint, self.model)

    def _load_adapter_beside_sharded_folder(self, checkpoint: str, model: torch.nn.Module) -> None:
        """Load ``checkpoint``'s adapter file into ``model`` where ``save_model`` wrote it for want of a sharded one."""
        if not (self.is_fsdp_enabled and self.accelerator.is_fsdp2 and is_sharded_state_dict(self.accelerator)):
            return
        if not adapter_in_wrapped_modules(model):
            return
        adapter_file = Path(checkpoint) / ADAPTER_SAFE_WEIGHTS_NAME
        if not adapter_file.is_file():
            raise ValueError(
                f"{checkpoint} has no {ADAPTER_SAFE_WEIGHTS_NAME}: its sharded folder holds no LoRA weights under "
                "fsdp_activation_checkpointing (checkpoints written before hf_tree saved the adapter beside it), so "
                "resuming would restart the adapter. Resume from a newer checkpoint or start the run again."
            )
        load_adapter_file(model, adapter_file)
