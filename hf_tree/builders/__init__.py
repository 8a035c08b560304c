"""Builders: the data users have (conversations, prompt/completion groups, TRL datasets) -> trees.

All of them merge by token ids after full tokenization, so a tokenizer that merges text across a
prompt/completion or turn boundary can never corrupt a tree.
"""

from hf_tree.builders.chat import (
    MESSAGES_BRANCHES,
    TRAIN_ON,
    conversation_branch,
    conversation_branches,
    conversation_to_branches,
    render_ids,
    render_text,
    tree_from_conversation,
)
from hf_tree.builders.completions import CompletionBranches, completions_to_branches, tree_from_completions
from hf_tree.builders.dataset import (
    GROUP_BY_PROMPT_TOKENS,
    GROUP_BY_ROW,
    TREE_FEATURES,
    TreeBuildStats,
    build_tree_dataset,
    build_tree_dataset_with_stats,
)

__all__ = [
    "GROUP_BY_PROMPT_TOKENS",
    "GROUP_BY_ROW",
    "MESSAGES_BRANCHES",
    "TRAIN_ON",
    "TREE_FEATURES",
    "CompletionBranches",
    "TreeBuildStats",
    "build_tree_dataset",
    "build_tree_dataset_with_stats",
    "completions_to_branches",
    "conversation_branch",
    "conversation_branches",
    "conversation_to_branches",
    "render_ids",
    "render_text",
    "tree_from_completions",
    "tree_from_conversation",
]
