"""The tree fields shared by ``TreeTrainingArguments`` and ``TreeSFTConfig``, defined once.

``TreeArguments`` is a dataclass mixin placed *before* a ``TrainingArguments`` subclass in the bases, so its
fields (and its ``remove_unused_columns=False`` default) win and its ``__post_init__`` validates them after the
base class has parsed its own fields.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hf_tree.collator import TreeDataCollator
from hf_tree.distributed import enable_fsdp2_on_cpu
from hf_tree.models.check import tree_self_check_field
from hf_tree.packing import Normalization, OverlongPolicy, PackingConfig, TreeExecution
from hf_tree.parallel.integration import ContextParallelConfig
from hf_tree.training_arguments import refuse_neftune

# ContextParallelConfig fields reachable as ``context_parallel_<name>`` (pad_token_id comes from the tokenizer).
CONTEXT_PARALLEL_FIELDS = ("strategy", "chunks_per_rank", "query_block_size")
CONTEXT_PARALLEL_PREFIX = "context_parallel_"


def config_field(config_class: type, name: str, default: Any = MISSING) -> Any:
    """A flat ``TrainingArguments`` field for ``config_class.<name>``: its default (unless ``default`` is given), help
    and choices (the ``HfArgumentParser`` flag reads them), so each option is described once, in its config
    dataclass."""
    spec = config_class.__dataclass_fields__[name]
    return field(default=spec.default if default is MISSING else default, metadata=dict(spec.metadata))


def packing_field(name: str, default: Any = MISSING) -> Any:
    """The flat field of ``PackingConfig.<name>`` (same name); ``default`` replaces the config's default."""
    return config_field(PackingConfig, name, default)


def context_parallel_field(name: str) -> Any:
    """The flat field ``context_parallel_<name>`` of ``ContextParallelConfig.<name>``."""
    return config_field(ContextParallelConfig, name)


@dataclass
class TreeArguments:
    """Packing and loss options of tree training (mixin for ``TrainingArguments`` subclasses).

    The packing fields mirror ``PackingConfig`` (same names, types, defaults and help); ``packing_config()``
    gathers them. The ``context_parallel_*`` fields mirror ``ContextParallelConfig`` the same way (prefixed);
    ``context_parallel_config()`` gathers them for ``TreeContextParallel`` (used when ``parallelism_config.cp_size``
    is above 1).
    """

    max_packed_tokens: int = packing_field("max_packed_tokens")
    max_branch_tokens: int | None = packing_field("max_branch_tokens")
    overlong: OverlongPolicy = packing_field("overlong")
    normalization: Normalization = packing_field("normalization")
    pad_to_multiple_of: int | None = packing_field("pad_to_multiple_of")
    # Trainers know their setup: "auto" runs depth-first where it can, else packed with one log line (trainer.py)
    tree_execution: TreeExecution = packing_field("tree_execution", default="auto")
    merge_in_batch: bool = packing_field("merge_in_batch")
    context_parallel_strategy: str = context_parallel_field("strategy")
    context_parallel_chunks_per_rank: int = context_parallel_field("chunks_per_rank")
    context_parallel_query_block_size: int = context_parallel_field("query_block_size")
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
        self.packing_config()
        self.context_parallel_config()
        refuse_neftune(self)
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the tree columns (node_tokens, node_parents, ...) before the "
                "tree collator sees them; set remove_unused_columns=False."
            )

    def packing_config(self) -> PackingConfig:
        """The ``PackingConfig`` of these arguments (validated: ``ValueError`` naming the field)."""
        return PackingConfig(**{f.name: getattr(self, f.name) for f in fields(PackingConfig)})

    def context_parallel_config(self, pad_token_id: int = 0) -> ContextParallelConfig:
        """The ``ContextParallelConfig`` of the ``context_parallel_*`` fields (used when
        ``parallelism_config.cp_size > 1``); ``ValueError`` naming the field."""
        for name in CONTEXT_PARALLEL_FIELDS:  # one at a time, so the error names the argument that is wrong
            value = getattr(self, CONTEXT_PARALLEL_PREFIX + name)
            try:
                ContextParallelConfig(**{name: value})
            except ValueError as error:
                raise ValueError(f"{CONTEXT_PARALLEL_PREFIX}{name}={value!r} is invalid: {error}") from error
        options = {name: getattr(self, CONTEXT_PARALLEL_PREFIX + name) for name in CONTEXT_PARALLEL_FIELDS}
        return ContextParallelConfig(pad_token_id=pad_token_id, **options)

    def make_tree_collator(self, pad_token_id: int | None = None) -> TreeDataCollator:
        """The ``TreeDataCollator`` these arguments describe (``pad_token_id`` defaults to 0)."""
        return TreeDataCollator(packing=self.packing_config(), pad_token_id=0 if pad_token_id is None else pad_token_id)
