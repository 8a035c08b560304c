"""hf_tree: train causal LMs on tree-structured data (shared prefixes computed once) in the HF stack.

Importing the package registers ``attn_implementation="tree_flash"`` with transformers.
"""

from hf_tree.attention.registration import TREE_ATTENTION_NAME, register_tree_attention
from hf_tree.collator import TreeDataCollator
from hf_tree.loss import tree_causal_lm_loss
from hf_tree.packing import PackingStats, pack_trees, split_tree
from hf_tree.tree import Tree

register_tree_attention()

__all__ = [
    "TREE_ATTENTION_NAME",
    "PackingStats",
    "Tree",
    "TreeDataCollator",
    "pack_trees",
    "split_tree",
    "tree_causal_lm_loss",
]
