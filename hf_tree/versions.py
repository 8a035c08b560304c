"""The library versions whose private behaviour hf_tree relies on, and the checks that enforce them.

The core (trees, collator, ``tree_flash`` attention, ``TreeTrainer``) needs no TRL. The TRL trainers subclass TRL's and
override private methods: ``TreeSFTTrainer`` ``_prepare_dataset``, ``TreeRewardTrainer`` the model's forward under
``RewardTrainer.compute_loss``, ``TreeGRPOTrainer``/``TreeRLOOTrainer`` ``_get_per_token_logps_and_entropies``,
``TreeDPOTrainer``/``TreeKTOTrainer`` ``_precompute_ref_logps``; the last four replace TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, ``FusedCausalLMOutput``, ``trl.kernels.ChunkedLogProbFunction``), which TRL
1.9 does not have (``FUSED_HEAD_TRL``): there they compute the same values without it (``hf_tree.trl.compat``). Each
TRL-based module refuses to import outside the range its trainer was tested with (``TRAINER_TRL``; ``TESTED_TRL`` is
the ``trl`` extra of ``pyproject.toml``), naming the trainer and the fix. ``TESTED_ACCELERATE`` bounds the accelerate
versions whose ``AcceleratorState`` set-up ``hf_tree.distributed`` adjusts for FSDP2 on CPU.
"""

from __future__ import annotations

from packaging.version import Version

# [low, high): the versions these overrides were read from and tested against (TRL: at both ends, 1.9 and 1.16).
TESTED_ACCELERATE = (Version("1.10.0"), Version("2.0.0"))
TESTED_TRL = (Version("1.9.0"), Version("1.17.0"))
# TRL's fused LM head, which TRL added after 1.9 (hf_tree.trl.compat.has_fused_lm_head): tested with 1.16.
FUSED_HEAD_TRL = (Version("1.16.0"), Version("1.17.0"))
TRAINER_TRL = {
    "TreeSFTTrainer": TESTED_TRL,
    "TreeRewardTrainer": TESTED_TRL,
    "TreeGRPOTrainer": TESTED_TRL,
    "TreeRLOOTrainer": TESTED_TRL,
    "TreeDPOTrainer": TESTED_TRL,
    "TreeKTOTrainer": TESTED_TRL,
}


def is_tested(version: str, tested: tuple[Version, Version]) -> bool:
    """Whether ``version`` lies in the tested ``[low, high)`` range."""
    return tested[0] <= Version(version) < tested[1]


def pip_range(tested: tuple[Version, Version]) -> str:
    """``tested`` as a pip requirement: ``trl>=1.9.0,<1.17.0``."""
    return f"trl>={tested[0]},<{tested[1]}"


def require_tested_trl(user: str | None = None) -> None:
    """Raise ``ImportError`` unless TRL is installed in the range ``user`` (a key of ``TRAINER_TRL``; ``None``: the
    package's ``TESTED_TRL``) was tested with; called at import of the TRL-based modules, before an overridden
    private method could silently diverge from TRL's. The message names ``user``, the installed version and the
    pip command that fixes it."""
    tested = TESTED_TRL if user is None else TRAINER_TRL[user]
    who = "hf_tree's TRL trainers" if user is None else user
    try:
        import trl
    except ImportError:
        raise ImportError(
            f"{who} cannot run without TRL, which is not installed. Install it: pip install 'hf_tree[trl]' (or "
            f"pip install '{pip_range(tested)}'). The core (Tree, TreeDataCollator, tree_flash, TreeTrainer) needs "
            "no TRL."
        ) from None
    if is_tested(trl.__version__, tested):
        return
    why = "override private TRL methods and were" if user is None else "overrides private TRL methods and was"
    raise ImportError(
        f"{who} {why} tested with {pip_range(tested)}, but trl {trl.__version__} is installed. Install a "
        f"tested version: pip install '{pip_range(tested)}'."
    )
