"""hf_tree: train causal LMs on tree-structured data (shared prefixes computed once) in the HF stack.

Importing the package registers ``attn_implementation="tree_flash"`` with transformers and the tree-aware mixers of
hybrid models, each at the moment transformers' own code for it is imported (``transformers.modeling_utils``, a
hybrid's modeling module; at once where it already is: ``hf_tree.post_import``). So ``import hf_tree`` itself imports
neither torch nor transformers, and every public name below is imported on first use: ``hf-tree --help`` and
data-only scripts skip the seconds of torch, ``torch._dynamo`` (which ``transformers.modeling_utils`` imports), the
trainers and TRL.
"""

import importlib
from types import ModuleType
from typing import Any

from hf_tree.models.hybrid_modules import TREE_MIXER_MODULES, modeling_module
from hf_tree.post_import import when_imported


def _register_attention(_: ModuleType) -> None:
    from hf_tree.attention.registration import register_tree_attention

    register_tree_attention()


def _install_mixers(module: ModuleType) -> None:
    from hf_tree.models.mixers.install import install_module_mixers

    install_module_mixers(module)  # hybrid models' convolutions and scans read kv_end


when_imported("transformers.modeling_utils", _register_attention)
for _name in TREE_MIXER_MODULES:
    when_imported(modeling_module(_name), _install_mixers)

_LAZY = {
    "TREE_ATTENTION_NAME": "hf_tree.attention.names",
    "Tree": "hf_tree.tree",
    "TreeDataCollator": "hf_tree.collator",
    "PackingStats": "hf_tree.packing",
    "pack_trees": "hf_tree.packing",
    "split_tree": "hf_tree.packing",
    "tree_causal_lm_loss": "hf_tree.loss",
    "TreeTrainer": "hf_tree.trainer",
    "TreeTrainingArguments": "hf_tree.trainer",
    "TreeSFTConfig": "hf_tree.trl.sft",
    "TreeSFTTrainer": "hf_tree.trl.sft",
    "TreeGRPOConfig": "hf_tree.trl.grpo",
    "TreeGRPOTrainer": "hf_tree.trl.grpo",
    "TreeDPOConfig": "hf_tree.trl.dpo",
    "TreeDPOTrainer": "hf_tree.trl.dpo",
    "TreeRLOOConfig": "hf_tree.trl.rloo",
    "TreeRLOOTrainer": "hf_tree.trl.rloo",
    "TreeRewardConfig": "hf_tree.trl.reward",
    "TreeRewardTrainer": "hf_tree.trl.reward",
    "TreeKTOConfig": "hf_tree.trl.kto",
    "TreeKTOTrainer": "hf_tree.trl.kto",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_tree' has no attribute {name!r}")


__all__ = list(_LAZY)
