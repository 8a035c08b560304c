"""The attention name hf_tree registers with transformers, in a leaf module: code that only compares or
passes the name imports it from here, not from ``registration`` (which pulls in transformers' interfaces)."""

TREE_ATTENTION_NAME = "tree_flash"
