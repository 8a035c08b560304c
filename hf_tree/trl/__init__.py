"""TRL-facing code: the tree trainers that subclass TRL's (SFT, GRPO, RLOO, DPO, KTO, reward), their configs and
shared glue (fused-head installer, log-prob layout and passes), and ``hf-tree sft|dpo|...`` (``cli``: TRL's CLI with the
tree classes).

Importing it checks that TRL is installed in the package's tested range (``hf_tree.versions.TESTED_TRL``; the ``trl``
extra), naming the fix otherwise; each trainer's module checks its own range (``TRAINER_TRL``). The core (``hf_tree``'s
other modules) imports no TRL."""

from hf_tree.versions import require_tested_trl

require_tested_trl()
