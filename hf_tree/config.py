"""The tree fields shared by ``TreeTrainingArguments`` and ``TreeSFTConfig``, defined once.

``TreeArguments`` is a dataclass mixin placed *before* a ``TrainingArguments`` subclass in the bases, so its
fields (and its ``remove_unused_columns=False`` default) win and its ``__post_init__`` validates them after the
base class has parsed its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_tree.collator import TreeDataCollator
from hf_tree.distributed import enable_fsdp2_on_cpu
from hf_tree.model_check import tree_self_check_field
from hf_tree.packing import NORMALIZATIONS, OVERLONG_POLICIES, check_packing_options


@dataclass
class TreeArguments:
    """Packing and loss options of tree training (mixin for ``TrainingArguments`` subclasses)."""

    max_packed_tokens: int = field(
        default=4096,
        metadata={
            "help": "Capacity of one packed row in tokens. The trees of a micro-batch are bin-packed into rows of at "
            "most this many (deduplicated) tokens; a larger tree is split by its branches (exact, the shared prefix "
            "is repeated). Bounds activation memory the way max_length does for flat sequences."
        },
    )
    max_branch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Longest allowed branch (one sample) in tokens; defaults to max_packed_tokens. Longer branches "
            "follow `overlong`."
        },
    )
    overlong: str = field(
        default="error",
        metadata={
            "help": f"What to do with a branch longer than max_branch_tokens: one of {OVERLONG_POLICIES}. 'truncate' "
            "and 'drop' are counted, warned about and logged (num_truncated_branches / num_dropped_branches).",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    normalization: str = field(
        default="token",
        metadata={
            "help": f"Loss normalization, one of {NORMALIZATIONS}. 'token' (HF/TRL default): mean over all trained "
            "tokens of the optimizer step (all micro-batches and ranks). 'sequence': mean over trained branches of "
            "each branch's mean token loss.",
            "choices": list(NORMALIZATIONS),
        },
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Round each batch's row length up to a multiple of this (e.g. 64 for GPU kernels)."},
    )
    tree_self_check: bool = tree_self_check_field()
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: tree rows are not model inputs by name, the tree collator reads its own columns."
        },
    )

    def __post_init__(self) -> None:
        enable_fsdp2_on_cpu()  # before the TrainingArguments base creates the process state
        super().__post_init__()  # the base parses its fields first (e.g. TRL's "auto" padding)
        self.check_tree_arguments()

    def check_tree_arguments(self) -> None:
        """Raise ``ValueError`` naming the field, the value and the fix."""
        check_packing_options(
            self.max_packed_tokens, self.max_branch_tokens, self.overlong, self.normalization, self.pad_to_multiple_of
        )
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the tree columns (node_tokens, node_parents, ...) before the "
                "tree collator sees them; set remove_unused_columns=False."
            )

    def make_tree_collator(self, pad_token_id: int | None = None) -> TreeDataCollator:
        """The ``TreeDataCollator`` these arguments describe (``pad_token_id`` defaults to 0)."""
        return TreeDataCollator(
            max_packed_tokens=self.max_packed_tokens,
            normalization=self.normalization,
            max_branch_tokens=self.max_branch_tokens,
            overlong=self.overlong,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=0 if pad_token_id is None else pad_token_id,
        )
