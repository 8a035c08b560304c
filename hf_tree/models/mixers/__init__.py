"""Tree-aware token mixers for hybrid models: causal depthwise convolutions, the gated delta rule (GatedDeltaNet,
Kimi delta attention), the Mamba2 SSD scan and the Mamba-1 selective scan read a packed trie (``kv_end``) instead of
the row as one sequence. See
docs/hybrids.md."""

from hf_tree.models.mixers.conv import tree_causal_conv1d
from hf_tree.models.mixers.delta_rule import tree_chunk_gated_delta_rule
from hf_tree.models.mixers.install import TREE_MIXER_MODULES, install_tree_mixers, uninstall_tree_mixers
from hf_tree.models.mixers.selective_scan import tree_mamba_selective_scan
from hf_tree.models.mixers.ssd import tree_mamba2_chunk_scan
from hf_tree.models.mixers.topology import TreeTopology, build_topology, tree_topology

__all__ = [
    "TREE_MIXER_MODULES",
    "TreeTopology",
    "build_topology",
    "install_tree_mixers",
    "tree_causal_conv1d",
    "tree_chunk_gated_delta_rule",
    "tree_mamba2_chunk_scan",
    "tree_mamba_selective_scan",
    "tree_topology",
    "uninstall_tree_mixers",
]
