"""``TreeSFTTrainer``: ``trl.SFTTrainer`` on trees; an SFT script switches by class names only.

    from hf_tree.sft import TreeSFTConfig as SFTConfig, TreeSFTTrainer as SFTTrainer

The trainer takes TRL's own dataset formats (``messages`` with ``reasoning_content``/``tool_calls``,
``prompt``/``completion``, ``prompt``/``completions``, conversational or text; ShareGPT ``conversations`` are
converted as TRL does) and builds trees in place of TRL's dataset preparation: per-turn branches of each
conversation, or the completions of one prompt, merged by token ids (``hf_tree.builders``). Loss, divisor,
evaluation and logs are those of ``TreeTrainer`` (``TreeTrainerMixin``). Settings that cannot apply to trees
(``packing``, ``padding_free``, ...) raise ``ValueError`` instead of being ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import datasets
from transformers import ProcessorMixin
from trl import SFTConfig, SFTTrainer
from trl.data_utils import maybe_convert_to_chatml

from hf_tree.attention.registration import TREE_ATTENTION_NAME
from hf_tree.builders import TRAIN_ON, build_tree_dataset
from hf_tree.builders.dataset import detect_format
from hf_tree.config import TreeArguments
from hf_tree.distributed import enable_fsdp2_on_cpu
from hf_tree.trainer import TreeTrainerMixin, pad_token_id_of, use_tree_attention
from hf_tree.tree import TREE_KEYS

logger = logging.getLogger("hf_tree")


@dataclass
class TreeSFTConfig(TreeArguments, SFTConfig):
    """``trl.SFTConfig`` plus the tree fields of ``hf_tree.config.TreeArguments`` and tree building options.

    TRL's ``max_length`` (per-sample limit) becomes the branch limit: ``max_branch_tokens`` defaults to
    ``min(max_length, max_packed_tokens)``; longer branches follow ``overlong`` instead of being cut silently.
    """

    group_by: str | None = field(
        default=None,
        metadata={
            "help": "Which rows merge into one tree: a column name (rows with equal values merge), '<prompt tokens>' "
            "(identical prompt tokens merge), '<row>' (one tree per row), or None: by prompt tokens for prompt rows, "
            "one tree per conversation for 'messages' rows."
        },
    )
    train_on: str = field(
        default="last_assistant",
        metadata={
            "help": f"For 'messages' rows, one of {TRAIN_ON}: 'last_assistant' trains each assistant turn once, in "
            "the context the chat template gives it at its own turn; 'all_assistant' trains every assistant turn "
            "of each per-turn branch (TRL's assistant_only_loss applied to each turn's sample).",
            "choices": list(TRAIN_ON),
        },
    )

    def check_tree_arguments(self) -> None:
        why = "trees are packed by hf_tree (best-fit rows with a tree attention mask), which replaces TRL's"
        if self.packing:
            raise ValueError(f"packing=True cannot apply: {why} packing; set packing=False (rows are packed anyway).")
        if self.eval_packing:
            raise ValueError(f"eval_packing=True cannot apply: {why} packing; set eval_packing=False or None.")
        if self.padding_free:
            raise ValueError(
                f"padding_free=True cannot apply: {why} padding-free batches (whose flattened sequences cannot "
                "share prefixes); set padding_free=False."
            )
        if self.loss_type != "nll":
            raise ValueError(
                f"loss_type={self.loss_type!r} cannot apply: tree trainers compute the exact negative log-likelihood "
                "of every branch (hf_tree.tree_causal_lm_loss); set loss_type='nll'."
            )
        if self.label_smoothing_factor:
            raise ValueError(
                f"label_smoothing_factor={self.label_smoothing_factor} cannot apply: the tree loss is plain "
                "cross-entropy; set label_smoothing_factor=0.0."
            )
        if self.completion_only_loss is False:
            raise ValueError(
                "completion_only_loss=False cannot apply: tree builders train completions (and assistant turns) "
                "only, the shared prompt is context; set completion_only_loss=None or True."
            )
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"train_on={self.train_on!r} must be one of {TRAIN_ON}.")
        if self.max_branch_tokens is None and self.max_length is not None:
            self.max_branch_tokens = min(self.max_length, self.max_packed_tokens)
        super().check_tree_arguments()


def is_tree_dataset(dataset: datasets.Dataset | datasets.IterableDataset) -> bool:
    """Whether the rows are already ``Tree.to_dict()`` rows."""
    return set(TREE_KEYS) <= set(dataset.column_names or ())


class TreeSFTTrainer(TreeTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` that builds trees from TRL datasets and trains with the exact tree loss.

    Same arguments as ``SFTTrainer``; ``args`` must be a ``TreeSFTConfig``. A model given by name is loaded
    with ``attn_implementation="tree_flash"``; a model instance is switched to it.
    """

    def __init__(
        self,
        model,
        args: TreeSFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        **kwargs,
    ) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = TreeSFTConfig(output_dir=f"{str(name).split('/')[-1]}-TreeSFT")
        if not isinstance(args, TreeSFTConfig):
            raise ValueError(
                f"args is a {type(args).__name__}; TreeSFTTrainer needs hf_tree.sft.TreeSFTConfig (SFTConfig plus "
                "the tree fields). Swap the class name: `from hf_tree.sft import TreeSFTConfig as SFTConfig`."
            )
        if kwargs.get("formatting_func") is not None:
            raise ValueError(
                "formatting_func cannot apply: trees are built from 'messages' or 'prompt'/'completion(s)' columns; "
                "map your dataset into one of those formats first."
            )
        if isinstance(model, str):
            init_kwargs = dict(args.model_init_kwargs or {})
            if init_kwargs.get("attn_implementation", TREE_ATTENTION_NAME) != TREE_ATTENTION_NAME:
                logger.warning(
                    "hf_tree: model_init_kwargs attn_implementation=%r replaced by %r (trees need it).",
                    init_kwargs["attn_implementation"],
                    TREE_ATTENTION_NAME,
                )
            args.model_init_kwargs = {**init_kwargs, "attn_implementation": TREE_ATTENTION_NAME}
        else:
            use_tree_attention(model)
        if data_collator is None:
            data_collator = args.make_tree_collator(pad_token_id_of(processing_class))
        enable_fsdp2_on_cpu()  # before Trainer creates the Accelerator
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        pad_token_id = pad_token_id_of(self.processing_class)
        if pad_token_id is not None and hasattr(self.data_collator, "pad_token_id"):
            self.data_collator.pad_token_id = pad_token_id  # cosmetic: padding is never attended to nor scored
        self._init_tree_training()

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL rows -> tree rows (``hf_tree.builders.build_tree_dataset``); tree rows pass through unchanged."""
        if is_tree_dataset(dataset):
            return dataset
        if not isinstance(dataset, datasets.Dataset):
            raise ValueError(
                f"the {dataset_name} dataset is a {type(dataset).__name__}: building trees groups rows, which needs a "
                "map-style datasets.Dataset. Materialize it, or build trees yourself with "
                "hf_tree.builders.build_tree_dataset and pass those rows."
            )
        if "conversations" in dataset.column_names:  # ShareGPT from/value -> role/content, as TRL does
            dataset = dataset.map(maybe_convert_to_chatml, remove_columns="conversations")
        data_format = detect_format(dataset.column_names)
        if data_format == "messages" and not args.assistant_only_loss:
            logger.info("hf_tree: 'messages' rows train their assistant turns only (one branch per turn).")
        tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
        with args.main_process_first(desc=f"building trees of the {dataset_name} dataset"):
            trees = build_tree_dataset(
                dataset,
                tokenizer,
                group_by=args.group_by,
                num_proc=args.dataset_num_proc,
                chat_template=self.chat_template,
                train_on=args.train_on,
            )
        return trees.shuffle(seed=args.seed) if args.shuffle_dataset else trees
