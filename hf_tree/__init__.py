"""hf_tree: train causal LMs on tree-structured data (shared prefixes computed once) in the HF stack.

Importing the package registers ``attn_implementation="tree_flash"`` with transformers. The loss and the trainers
are imported lazily (the loss's model checks pull in ``datasets``, the trainers ``transformers.Trainer`` and TRL: a
few seconds that ``hf-tree --help`` or a data-only script need not pay).
"""

import importlib
from typing import Any

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.attention.registration import register_tree_attention
from hf_tree.collator import TreeDataCollator
from hf_tree.models.mixers import install_tree_mixers
from hf_tree.packing import PackingStats, pack_trees, split_tree
from hf_tree.tree import Tree

register_tree_attention()
install_tree_mixers()  # hybrid models' convolutions and scans read kv_end (hf_tree.models.mixers)

_LAZY = {
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


__all__ = [
    "TREE_ATTENTION_NAME",
    "PackingStats",
    "Tree",
    "TreeDataCollator",
    "pack_trees",
    "split_tree",
    *_LAZY,
]
