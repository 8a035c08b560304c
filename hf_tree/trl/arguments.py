"""The tree fields of the TRL tree configs, each declared once: type, default, help and validation.

``TreeGRPOConfig``, ``TreeRLOOConfig``, ``TreeDPOConfig``, ``TreeKTOConfig`` and ``TreeRewardConfig`` are TRL's
configs with these dataclass mixins placed before them in the bases, so the mixins' fields win and their
``__post_init__`` validates after TRL's has parsed its own fields:

- ``TreeTRLArguments`` (all five): the on/off switch ``tree_forward``, ``max_packed_tokens``, ``tree_self_check``;
- ``InBatchMergeArguments`` (DPO, KTO, reward): ``merge_in_batch``, ``PackingConfig``'s field;
- ``TreeLogProbArguments`` (GRPO, RLOO, DPO, KTO) and ``TreeRewardConfig``: the switch's deprecated names;
- ``hf_tree.trl.shared_prompts.TreeRolloutArguments`` (GRPO, RLOO): the options of the online RL trainers.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from hf_tree.config import config_field
from hf_tree.models.check import tree_self_check_field
from hf_tree.packing import PackingConfig, check_max_packed_tokens
from hf_tree.training_arguments import refuse_neftune

SWITCH = "tree_forward"
# Earlier names of tree_forward, each declared by deprecated_switch_field on the configs that had it
DEPRECATED_SWITCH_NAMES = ("tree_logprobs", "tree_rewards")
DEPRECATED_NAMES_REMOVED_IN = "0.3.0"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hf_tree/


def deprecated_switch_field() -> Any:
    """A deprecated name of ``tree_forward`` (one of ``DEPRECATED_SWITCH_NAMES``): ``None`` when not given; a given
    value sets ``tree_forward`` with a ``FutureWarning`` (``TreeTRLArguments.__post_init__``) and stays as given, as
    TRL's own deprecated fields do (read ``tree_forward``)."""
    return field(
        default=None,
        metadata={"help": f"Deprecated, use `{SWITCH}` instead (removed in hf_tree {DEPRECATED_NAMES_REMOVED_IN})."},
    )


def _caller_stacklevel() -> int:
    """The ``warnings`` stack level of the first frame outside hf_tree and the dataclass-generated ``__init__``: the
    user's config call, however many tree ``__post_init__`` run between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR) or frame.f_code.co_filename[0] == "<"
    ):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class TreeTRLArguments:
    """Tree fields of every TRL tree config (a mixin placed before the TRL config in the bases).

    With ``tree_forward=True``, a model given by name is loaded with ``attn_implementation="tree_flash"`` unless
    ``model_init_kwargs`` names another (which is replaced with a warning; ``hf_tree.trl.glue.prepare_trl_args``).
    """

    # One name for the switch of the five TRL tree trainers. It was `tree_logprobs` (GRPO, RLOO, DPO, KTO: what they
    # compute) and `tree_rewards` (reward): each name is wrong for the other trainers, while what all five switch is
    # the same thing, the model forward hf_tree installs (the log-prob trainers' fused head, the reward model's pooled
    # scores) in place of TRL's. Both old names still work, with a FutureWarning (deprecated_switch_field).
    tree_forward: bool = field(
        default=True,
        metadata={
            "help": "Run the trainer's model forwards on packed prompt trees: the log-prob passes (policy and "
            "reference; old policy in GRPO and RLOO) or the reward model's scores. False runs TRL's own forward "
            "unchanged (for comparison)."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Capacity of one packed row in tokens (an integer >= 2). None: the tokens of one TRL forward (rows "
            "x padded length), so no packed row holds more tokens than TRL's own forward. A larger tree is split by "
            "its branches (exact; the prompt is repeated)."
        },
    )
    tree_self_check: bool = tree_self_check_field()

    def __post_init__(self) -> None:
        for old in DEPRECATED_SWITCH_NAMES:
            value = getattr(self, old, None)
            if value is not None:
                warnings.warn(
                    f"`{old}` is deprecated and will be removed in hf_tree {DEPRECATED_NAMES_REMOVED_IN}. Use "
                    f"`{SWITCH}` instead.",
                    FutureWarning,
                    stacklevel=_caller_stacklevel(),
                )
                self.tree_forward = value
        super().__post_init__()  # the TRL config parses its fields first (e.g. JSON model_init_kwargs)
        check_max_packed_tokens(self.max_packed_tokens, none_allowed=True)
        if self.tree_forward:  # TRL's own forward (tree_forward=False) applies NEFTune per row as usual
            refuse_neftune(self)
            refuse_liger_kernel(self)
            refuse_torch_compile(self)


def refuse_torch_compile(args: Any) -> None:
    """``ValueError`` for ``torch_compile=True`` with tree forwards: the tree forward is a callable object bound as
    ``model.forward`` (``hf_tree.trl.tree_forward.TreeForward``), which ``torch.compile(model)`` cannot wrap (dynamo's
    ``getfile`` assertion in accelerate's ``prepare``, at the first step). The packed rows' attention is compiled
    anyway on CUDA (``hf_tree.attention.flex``)."""
    if args.torch_compile:
        raise ValueError(
            "torch_compile=True is not supported with tree_forward=True: the tree forward replaces model.forward, "
            "which torch.compile cannot wrap (it fails at the first step). Set torch_compile=False (on CUDA the tree "
            "attention kernels are compiled anyway), or tree_forward=False to compile TRL's own forward."
        )


def refuse_liger_kernel(args: Any) -> None:
    """``ValueError`` for ``use_liger_kernel=True`` with tree forwards: TRL then swaps the model's RMSNorm, RoPE and
    SwiGLU for Liger's Triton kernels (its fused cross-entropy off). Per token they should equal TRL's, but they need
    CUDA and no run has checked them on packed trees against TRL's step, so they are refused rather than trusted."""
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported with tree_forward=True: Liger's Triton kernels (RMSNorm, RoPE, "
            "SwiGLU) have not been checked on packed trees against TRL's step (TRL also deprecates the option in "
            "favour of Hub kernels). Set use_liger_kernel=False, or tree_forward=False to run TRL's own forward."
        )


@dataclass
class InBatchMergeArguments:
    """``merge_in_batch`` (``PackingConfig``'s field and rule) for the trainers that let it be turned off: DPO, KTO
    and reward merge every row of a call by its tokens unless it is ``False``. GRPO and RLOO always merge."""

    merge_in_batch: bool = config_field(PackingConfig, "merge_in_batch")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.merge_in_batch = PackingConfig(merge_in_batch=self.merge_in_batch).merge_in_batch  # ValueError if bad


@dataclass
class TreeLogProbArguments(TreeTRLArguments):
    """Tree fields of ``TreeGRPOConfig``, ``TreeRLOOConfig`` (through ``TreeRolloutArguments``), ``TreeDPOConfig`` and
    ``TreeKTOConfig``: ``TreeTRLArguments`` and the switch's deprecated name ``tree_logprobs``."""

    tree_logprobs: bool | None = deprecated_switch_field()
