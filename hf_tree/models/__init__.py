"""Model-facing code: how hf_tree reads a model (logit-head detection), the first-use self-check and its probe,
tree-aware mixers of hybrid models, MoE router losses and length-dependent RoPE checks."""
