"""The library versions whose private behaviour hf_tree relies on, and the checks that enforce them.

``TreeSFTTrainer`` (``_prepare_dataset``), ``TreeGRPOTrainer`` and ``TreeRLOOTrainer``
(``_get_per_token_logps_and_entropies``), ``TreeDPOTrainer`` and ``TreeKTOTrainer`` (``_precompute_ref_logps``) override
private TRL methods, and the fused log-prob head they use (and ``TreeRewardTrainer``'s shared glue, hf_tree.trl.glue)
reuses TRL internals (``trl.kernels``, ``trl.trainer.utils``), whose signatures change between TRL minor releases:
the TRL-based modules refuse to import outside the range they were tested with (the pin of ``pyproject.toml``).
``TESTED_ACCELERATE`` bounds the accelerate versions whose ``AcceleratorState`` set-up ``hf_tree.distributed``
adjusts for FSDP2 on CPU.
"""

from __future__ import annotations

from packaging.version import Version

# [low, high): the versions these overrides were read from and tested against.
TESTED_ACCELERATE = (Version("1.10.0"), Version("2.0.0"))
TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))


def is_tested(version: str, tested: tuple[Version, Version]) -> bool:
    """Whether ``version`` lies in the tested ``[low, high)`` range."""
    return tested[0] <= Version(version) < tested[1]


def require_tested_trl() -> None:
    """Raise ``ImportError`` unless the installed TRL is in ``TESTED_TRL`` (called at import of the TRL-based
    modules, before an overridden private method could silently diverge from TRL's)."""
    import trl

    if not is_tested(trl.__version__, TESTED_TRL):
        low, high = TESTED_TRL
        raise ImportError(
            f"hf_tree's TRL trainers override private TRL methods and were tested with trl>={low},<{high}, but "
            f"trl {trl.__version__} is installed. Install a tested version: pip install 'trl>={low},<{high}'."
        )
