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
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from accelerate import Accelerator
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

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
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        self._save(output_dir, state_dict=gather_full_state_dict(self.accelerator, self.model))
        self.accelerator.wait_for_everyone()  # the files exist for every rank once save_model returns
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
