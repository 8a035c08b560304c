"""TRL-facing code: the tree trainers that subclass TRL's (SFT, GRPO, RLOO, DPO, KTO, reward), their configs and
shared glue (fused-head installer, log-prob layout and passes), and ``hf-tree sft|dpo|...`` (``cli``: TRL's CLI with the
tree classes)."""
