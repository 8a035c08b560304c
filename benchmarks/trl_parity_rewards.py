"""Reward functions for the GRPO rows of ``benchmarks/trl_parity.py``.

TRL's ``trl/scripts/grpo.py`` takes reward functions as dotted import paths (``--reward_funcs
benchmarks.trl_parity_rewards.length_reward``); these two give a group of completions different rewards, so the
advantages (and the policy gradient) are not zero.
"""

from __future__ import annotations

from typing import Any


def length_reward(completions: list[Any], **_: Any) -> list[float]:
    """Characters of each completion (text), divided by 10."""
    return [len(str(completion)) / 10 for completion in completions]


def vowel_reward(completions: list[Any], **_: Any) -> list[float]:
    """Fraction of vowels among each completion's characters."""
    return [sum(ch in "aeiou" for ch in str(c)) / max(len(str(c)), 1) for c in completions]
