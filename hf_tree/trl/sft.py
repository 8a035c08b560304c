"""``TreeSFTTrainer``: ``trl.SFTTrainer`` on trees; an SFT script switches by class names only.

    from hf_tree.trl.sft import TreeSFTConfig as SFTConfig, TreeSFTTrainer as SFTTrainer

The trainer takes TRL's own dataset formats (``messages`` with ``reasoning_content``/``tool_calls``,
``prompt``/``completion``, ``prompt``/``completions``, conversational or text; ``text`` rows, TRL's language modeling,
every token trained, with TRL's EOS; ShareGPT ``conversations`` are converted as TRL does) and builds trees in place of
TRL's dataset preparation, merged by token ids (``hf_tree.builders``): each ``messages`` row is TRL's own branch (the
conversation rendered once, every token or, with ``assistant_only_loss``, the assistant tokens trained;
``messages_branches="per_turn"`` builds one branch per assistant turn instead, for templates that rewrite history),
each ``prompt`` row one completion of its prompt, each ``text`` row one branch. Each micro-batch's trees merge again by
their tokens before packing (``merge_in_batch``, on by default): rows that share a system prompt compute it once, in
TRL's batches, with TRL's objective. Loss, divisor, evaluation and logs are those of ``TreeTrainer``
(``TreeTrainerMixin``). Settings that cannot apply to trees (``packing``, ``padding_free``, ...) raise ``ValueError``
instead of being ignored.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import AutoProcessor, ProcessorMixin, TrainingArguments
from transformers.trainer_utils import seed_worker
from trl import SFTConfig, SFTTrainer
from trl.data_utils import maybe_convert_to_chatml

from hf_tree.builders import GROUP_BY_ROW, MESSAGES_BRANCHES, TRAIN_ON
from hf_tree.builders.dataset import (
    TreeBuildStats,
    build_tree_dataset_with_stats,
    check_messages_options,
    detect_format,
)
from hf_tree.config import TreeArguments, packing_field
from hf_tree.data.sources import is_tree_dataset
from hf_tree.loss import TreeLosses
from hf_tree.models.dropout import warn_if_dropout
from hf_tree.packing import OverlongPolicy
from hf_tree.row_batching import BATCH_UNITS, TreePartDataset, TreeRowBatchSampler
from hf_tree.sft_losses import sft_token_loss
from hf_tree.sft_metrics import MeteredTokenLoss
from hf_tree.trainer import STEP_SUM_KEYS, TreeTrainerMixin
from hf_tree.tree import Tree
from hf_tree.trl.compat import sft_loss_type
from hf_tree.versions import require_tested_trl
from hf_tree.vision.forward import vision_family
from hf_tree.vision.sft import is_vision_dataset, prepare_vision_sft

require_tested_trl("TreeSFTTrainer")  # TreeSFTTrainer overrides SFTTrainer._prepare_dataset
logger = logging.getLogger("hf_tree")


@dataclass
class TreeSFTConfig(TreeArguments, SFTConfig):
    """``trl.SFTConfig`` plus the tree fields of ``hf_tree.config.TreeArguments`` and tree building options.

    TRL's ``max_length`` (per-sample limit) becomes the branch limit: ``max_branch_tokens`` defaults to
    ``min(max_length, max_packed_tokens)`` with ``tree_execution="packed"`` (a branch must fit a row), and to
    ``max_length`` itself with ``"auto"``/``"depth_first"`` (a tree holding a longer branch runs depth-first); longer
    branches follow ``overlong``, which here defaults to ``"truncate"`` (keep their start: TRL's
    ``truncation_mode="keep_start"``, so TRL's rows train as TRL trains them; every truncated branch is counted, warned
    about and logged as ``num_truncated_branches``); ``"error"`` refuses them, ``"keep_end"`` is refused.
    """

    # TRL's SFTTrainer truncates every row to max_length; the one-word swap must train the same rows (reported here)
    overlong: OverlongPolicy = packing_field("overlong", default="truncate")
    group_by: str | None = field(
        default=None,
        metadata={
            "help": "Which rows merge into one tree across the dataset: None or '<row>' (default: one tree per row, so "
            "micro-batches hold exactly TRL's rows; rows of a micro-batch that share a prefix still merge there, "
            "merge_in_batch), a column name (rows with equal values merge) or '<prompt tokens>' (identical prompt "
            "tokens merge). A tree is dealt to one micro-batch whole, so grouping changes which rows train together "
            "(logged at start): batches then differ from TRL's."
        },
    )
    messages_branches: str = field(
        default="conversation",
        metadata={
            "help": f"Branches of a 'messages' row, one of {MESSAGES_BRANCHES}. 'conversation' (default, TRL's SFT "
            "objective): the conversation rendered once by the chat template is one branch, every token trained, or "
            "only the assistant tokens with assistant_only_loss=True. 'per_turn': one branch per assistant turn, "
            "rendered as the template renders the history at that turn, assistant tokens only (train_on decides "
            "which turns); for templates that rewrite history (e.g. drop earlier reasoning), where each turn has "
            "its own context. With a template that does not rewrite history, 'per_turn' trains TRL's "
            "assistant_only_loss=True objective (token normalization).",
            "choices": list(MESSAGES_BRANCHES),
        },
    )
    train_on: str | None = field(
        default=None,
        metadata={
            "help": f"messages_branches='per_turn' only, one of {TRAIN_ON} (default 'last_assistant'): "
            "'last_assistant' trains each assistant turn once, in the context the chat template gives it at its own "
            "turn; 'all_assistant' trains every assistant turn of each per-turn branch.",
            "choices": list(TRAIN_ON),
        },
    )

    batch_unit: str = field(
        default="rows",
        metadata={
            "help": "What per_device_train_batch_size counts. 'rows' (default, TRL's unit): dataset rows (samples, "
            "i.e. branches); each batch holds whole trees adding up to about that many rows, so an epoch has TRL's "
            "number of optimizer steps (hf_tree.row_batching). 'trees': trees per batch (one tree = all rows merged "
            "into it, e.g. a whole GRPO-style group), so a batch holds ~group-size times more rows than TRL's.",
            "choices": list(BATCH_UNITS),
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
        sft_token_loss(sft_loss_type(self.loss_type, self.label_smoothing_factor), self.label_smoothing_factor)
        if self.batch_unit not in BATCH_UNITS:
            raise ValueError(f"batch_unit={self.batch_unit!r} must be one of {BATCH_UNITS}.")
        if self.batch_unit == "rows" and self.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(
                f"train_sampling_strategy={self.train_sampling_strategy!r} cannot apply with batch_unit='rows': "
                "batches are whole trees filled up to per_device_train_batch_size rows, in random or sequential "
                "order. Set train_sampling_strategy='random' or 'sequential', or batch_unit='trees'."
            )
        if self.batch_unit == "rows" and self.dataloader_drop_last:
            raise ValueError(
                "dataloader_drop_last=True cannot apply with batch_unit='rows': batches are whole trees filled up to "
                "per_device_train_batch_size rows, so there is no partial batch of rows to drop as TRL does. Set "
                "dataloader_drop_last=False, or batch_unit='trees' (whole trees per batch; the last partial one is "
                "dropped)."
            )
        if self.truncation_mode != "keep_start" and self.max_length is not None:
            raise ValueError(
                f"truncation_mode={self.truncation_mode!r} cannot apply: a branch longer than max_length follows "
                "overlong ('truncate' by default: keeps its start, TRL's 'keep_start'; 'error'; 'drop'), since a tree "
                "cannot keep a branch's end and still share its prefix. Set truncation_mode='keep_start' (TRL's "
                "default; 'keep_end' is deprecated there), or max_length=None."
            )
        # assistant_only_loss is TRL's under 'conversation'; under 'per_turn' it only picks TRL's training template
        check_messages_options(self.messages_branches, self.train_on, assistant_only_loss=False)
        if self.max_branch_tokens is None and self.max_length is not None:
            self.max_branch_tokens = self._branch_limit_of_max_length()
        super().check_tree_arguments()

    def _branch_limit_of_max_length(self) -> int:
        """``max_branch_tokens`` from TRL's ``max_length``: packed rows hold whole branches, so it is capped at the
        row; depth-first execution forwards a longer branch in pieces, so TRL's limit stands as it is."""
        if self.tree_execution == "packed":
            return min(self.max_length, self.max_packed_tokens)
        if not isinstance(self.max_length, int) or self.max_length < 2:
            raise ValueError(
                f"max_length={self.max_length!r} must be an integer >= 2 (or None) with tree_execution="
                f"{self.tree_execution!r}: it becomes the branch limit max_branch_tokens. Raise max_length, or set "
                "max_branch_tokens explicitly."
            )
        return self.max_length


def drop_rows_truncation_leaves_untrained(
    trees: datasets.Dataset, max_length: int, name: str
) -> tuple[datasets.Dataset, int, list[int] | None]:
    """The tree rows without the branches (rows) that keep no trained token within their first ``max_length``
    tokens, as TRL's ``SFTTrainer`` filters its truncated dataset before batching (so the sampler deals the rows TRL
    deals), how many were dropped, and the indices of the trees kept (``None`` when all are); trees left with no
    branch are removed. Warns with the count when any is dropped."""
    spans = trees["branch_loss_spans"][:]
    keeps = [[b for b, span in enumerate(row) if span and span[0] < max_length] for row in spans]
    num_dropped = sum(len(row) - len(keep) for row, keep in zip(spans, keeps))
    if not num_dropped:
        return trees, 0, None
    partial = {i for i, (row, keep) in enumerate(zip(spans, keeps)) if keep and len(keep) < len(row)}

    def select(row: dict, index: int) -> dict:
        return Tree.from_dict(row, row=index).select_branches(keeps[index]).to_dict() if index in partial else row

    if partial:
        trees = trees.map(select, with_indices=True, features=trees.features, desc=f"truncating the {name} dataset")
    logger.warning(
        "hf_tree: %d of %d rows of the %s dataset dropped before batching: no trained token within their first "
        "max_length=%d tokens (TRL's SFTTrainer drops rows that truncation leaves fully masked, the same way).",
        num_dropped,
        sum(len(row) for row in spans),
        name,
        max_length,
    )
    kept = [i for i, keep in enumerate(keeps) if keep]
    return trees.select(kept), num_dropped, kept


def untrained_row_slots(stats: TreeBuildStats, kept_trees: list[int] | None) -> list[int] | None:
    """TRL's rows in order, one tree per row: the tree of each row, or -1 for a row that trains no token
    (``stats.untrained_rows``: TRL keeps it, so it takes a slot in a batch); ``None`` when there is no such row.
    ``kept_trees``: the trees left after TRL's truncation filter (their rows only), or ``None`` for all of them."""
    if not stats.untrained_rows:
        return None
    untrained = set(stats.untrained_rows)
    skipped = set(stats.dropped_rows) - untrained
    trees = iter(range(stats.num_trees))  # one tree per row: the k-th kept row is tree k
    slots = [-1 if row in untrained else next(trees) for row in range(stats.num_rows) if row not in skipped]
    if kept_trees is None:
        return slots
    renumbered = {tree: index for index, tree in enumerate(kept_trees)}
    return [renumbered[tree] if tree >= 0 else -1 for tree in slots if tree < 0 or tree in renumbered]


def eos_for_empty_completions(dataset: datasets.Dataset, eos_token: str | None, name: str) -> datasets.Dataset:
    """Plain-text completions ``""`` replaced by ``eos_token``: TRL's ``SFTTrainer`` appends its EOS to every
    completion and so trains a row whose completion is empty on the EOS alone (the builders would drop it)."""
    if not eos_token or "" not in set(dataset["completion"][:]):
        return dataset
    return dataset.map(
        lambda rows: {"completion": [eos_token if c == "" else c for c in rows["completion"]]},
        batched=True,
        desc=f"TRL's EOS for the empty completions of the {name} dataset",
    )


def train_every_token(row: dict) -> dict:
    """A tree row whose branches train every token after their first (TRL's ``completion_only_loss=False``): a
    shared prompt token is then trained with the weight of the branches that contain it."""
    tree = Tree.from_dict(dict(row))
    sequences = [tree.branch_tokens(b) for b in range(tree.num_branches)]
    return Tree.from_sequences(sequences, None, tree.branch_fields or None).to_dict()


class TreeSFTTrainer(TreeTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` that builds trees from TRL datasets and trains with the exact tree loss.

    Same arguments as ``SFTTrainer``; ``args`` must be a ``TreeSFTConfig``. A model given by name is loaded
    with ``attn_implementation="tree_flash"``; a model instance is switched to it. Vision datasets (``messages`` with
    ``images``/``image`` columns) become image trees (``hf_tree.vision.sft``), packed by ``MediaTreeCollator``.

    Attributes:
        tree_row_slots: TRL's training rows in order when some train no token (``untrained_row_slots``: the tree of
            each, -1 for those), so that the row sampler deals TRL's batches; ``None`` when every row is a tree.
    """

    tree_row_slots: list[int] | None = None

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        vision = is_vision_dataset(train_dataset) or is_vision_dataset(eval_dataset)
        if vision:  # TRL would skip its dataset preparation: build image trees here (hf_tree.vision.sft)
            args = self._tree_training_arguments(model, args, data_collator, kwargs)
            if processing_class is None:  # as TRL's __init__ loads it (the trees need it before TRL runs)
                model_id = model if isinstance(model, str) else model.config._name_or_path
                revision = (args.model_init_kwargs or {}).get("revision") if isinstance(model, str) else None
                processing_class = AutoProcessor.from_pretrained(
                    model_id, revision=revision, trust_remote_code=args.trust_remote_code
                )
            named = {"train": train_dataset, "eval": eval_dataset}
            built, data_collator = prepare_vision_sft(args, processing_class, data_collator, named)
            train_dataset, eval_dataset = built["train"], built["eval"]
        # TRL checks assistant_only_loss against the rows it is given: image trees, which already carry its masks
        hidden = vision and args.assistant_only_loss
        if hidden:
            args.assistant_only_loss = False
        try:
            super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
        finally:
            if hidden:
                args.assistant_only_loss = True
        if vision:
            vision_family(self.model)  # refuse an unsupported model before the first step

    def _tree_training_arguments(
        self, model: Any, args: TrainingArguments | None, data_collator: Any, kwargs: dict[str, Any]
    ) -> TreeSFTConfig:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            return TreeSFTConfig(output_dir=f"{str(name).split('/')[-1]}-TreeSFT")
        if not isinstance(args, TreeSFTConfig):
            raise ValueError(
                f"args is a {type(args).__name__}; TreeSFTTrainer needs hf_tree.trl.sft.TreeSFTConfig (SFTConfig plus "
                "the tree fields). Swap the class name: `from hf_tree.trl.sft import TreeSFTConfig as SFTConfig`."
            )
        if kwargs.get("formatting_func") is not None:
            raise ValueError(
                "formatting_func cannot apply: trees are built from 'messages' or 'prompt'/'completion(s)' columns; "
                "map your dataset into one of those formats first."
            )
        return args

    def _init_tree_training(self) -> None:
        loss_type = sft_loss_type(self.args.loss_type, self.args.label_smoothing_factor)  # TRL 1.9's: compat
        self.tree_token_loss = sft_token_loss(loss_type, self.args.label_smoothing_factor)
        # TRL's entropy / mean_token_accuracy count each branch's trained tokens: the edge weights under "token"
        self.tree_token_metrics = None
        if self.args.normalization == "token":
            self.tree_token_metrics = MeteredTokenLoss(self.tree_token_loss)
            self.tree_token_loss = self.tree_token_metrics
        else:
            logger.info(
                "hf_tree: normalization='sequence': entropy and mean_token_accuracy are not logged (their per-token "
                "counts are TRL's 'token' weights); num_tokens is."
            )
        warn_if_dropout(self.model, "set lora_dropout=0 (LoRA) and the model's dropout probabilities to 0")
        super()._init_tree_training()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The tree step (packed rows and depth-first trees), then TRL's per-micro-batch metrics of its branches."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._log_token_metrics("train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        output = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        self._log_token_metrics("eval")
        return output

    def _log_token_metrics(self, mode: str) -> None:
        """TRL's ``entropy`` and ``mean_token_accuracy`` of the micro-batch's branches (means over their trained
        tokens, summed over the processes) and ``num_tokens`` (branch tokens of training so far, all processes)."""
        if self.tree_token_metrics is not None:
            sums = self.tree_token_metrics.take().to(self.args.device)
            # over the processes (context parallel ranks scored disjoint shards of one batch: they add up too)
            sums = self.accelerator.gather_for_metrics(sums[None]).sum(0)
            count = float(sums[2])
            self._metrics[mode]["entropy"].append(float(sums[0]) / count if count > 0 else 0.0)
            self._metrics[mode]["mean_token_accuracy"].append(float(sums[1]) / count if count > 0 else 0.0)
        self._metrics[mode]["num_tokens"] = [int(self._tree_total_sums[STEP_SUM_KEYS.index("num_branch_tokens")])]

    def _tree_step_loss(self, losses: TreeLosses, num_items_in_batch: Any) -> torch.Tensor:
        """TRL's SFT loss: the token loss times the processes (divided by the global divisor), plus
        ``router_aux_loss_coef`` times the micro-batch's router loss averaged over the accumulation steps (DDP averages
        it over the processes), which TRL also logs as ``aux_loss``."""
        if num_items_in_batch is None:
            return losses.model_loss()
        loss = losses.token * self.accelerator.num_processes
        if losses.router is None:
            return loss
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["aux_loss"].append(
            self.accelerator.gather_for_metrics(losses.router.detach()).mean().item()
        )
        return loss + losses.router_coef * losses.router / self.current_gradient_accumulation_steps

    def get_train_dataloader(self) -> DataLoader:
        """Trainer's loader; with ``batch_unit="rows"`` each optimizer step holds whole trees adding up to about
        ``per_device_train_batch_size x gradient_accumulation_steps x ranks`` rows (``TreeRowBatchSampler``):
        TRL's batch and step count."""
        if self.args.batch_unit == "trees" or not isinstance(self.train_dataset, datasets.Dataset):
            return super().get_train_dataloader()
        sampler = TreeRowBatchSampler(
            [len(ends) for ends in self.train_dataset["branch_end_nodes"]],
            rows_per_batch=self.args.per_device_train_batch_size,
            batches_per_step=self.args.gradient_accumulation_steps * self.args.world_size,
            shuffle=self.args.train_sampling_strategy == "random",
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            ranks=self.args.world_size,
            slot_trees=self.tree_row_slots,
        )
        num_rows, num_batches = int(sampler.num_rows.sum()), len(sampler)
        trl_batches = -(-num_rows // self.args.per_device_train_batch_size)  # ceil: TRL's micro-batches per epoch
        (logger.warning if num_batches != trl_batches else logger.info)(
            "hf_tree: batch_unit='rows': %d rows in %d trees -> %d micro-batches per epoch (TRL: %d for %d rows at "
            "per_device_train_batch_size=%d)%s",
            num_rows,
            len(self.train_dataset),
            num_batches,
            trl_batches,
            num_rows,
            self.args.per_device_train_batch_size,
            ""
            if num_batches == trl_batches
            else "; groups are never cut across optimizer steps, so groups larger "
            "than a step's rows make fewer, larger steps (batch_unit='trees' counts trees instead).",
        )
        loader = DataLoader(
            TreePartDataset(self._remove_unused_columns(self.train_dataset, description="Training")),
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            multiprocessing_context=self.args.dataloader_multiprocessing_context,
            in_order=self.args.dataloader_in_order,
            worker_init_fn=functools.partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        )
        return self.accelerator.prepare(loader)

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
        data_format = detect_format(dataset.column_names, args.dataset_text_field)
        per_turn = data_format == "messages" and args.messages_branches == "per_turn"
        if per_turn:
            logger.info(
                "hf_tree: messages_branches='per_turn': one branch per assistant turn, assistant tokens trained "
                "(train_on=%r) whatever assistant_only_loss says; rendered with %s.",
                args.train_on or "last_assistant",
                "TRL's training template (assistant_only_loss=True)" if self.chat_template else "the chat template",
            )
        if args.group_by not in (None, GROUP_BY_ROW):
            logger.warning(
                "hf_tree: group_by=%r merges rows of the %s dataset into trees before batching, and a tree is dealt to "
                "one micro-batch whole: micro-batches then hold other rows than TRL's (the objective of each is still "
                "exact). group_by=None keeps TRL's batches; rows of a batch that share a prefix merge there anyway "
                "(merge_in_batch).",
                args.group_by,
                dataset_name,
            )
        tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
        if data_format == "prompt/completion" and dataset.features["completion"] == datasets.Value("string"):
            dataset = eos_for_empty_completions(dataset, tokenizer.eos_token, dataset_name)
        with args.main_process_first(desc=f"building trees of the {dataset_name} dataset"):
            trees, stats = build_tree_dataset_with_stats(
                dataset,
                tokenizer,
                group_by=GROUP_BY_ROW if args.group_by is None else args.group_by,
                num_proc=args.dataset_num_proc,
                chat_template=self.chat_template,  # TRL's: its training template when assistant_only_loss needs one
                train_on=args.train_on,
                messages_branches=args.messages_branches,
                assistant_only_loss=args.assistant_only_loss and args.messages_branches == "conversation",
                text_field=args.dataset_text_field,
            )
        self.tree_build_stats = stats  # hf_tree.sft_stats reports them
        if args.completion_only_loss is False:
            if per_turn:
                raise ValueError(
                    "completion_only_loss=False cannot apply to messages_branches='per_turn' (TRL ignores it on "
                    "'messages' rows): per-turn branches train assistant turns only. Leave completion_only_loss unset, "
                    "or use messages_branches='conversation' with assistant_only_loss=False to train every token."
                )
            if data_format not in ("messages", "text"):  # TRL ignores it on 'messages' rows; text trains every token
                trees = trees.map(train_every_token, desc=f"training the prompts of the {dataset_name} dataset")
        num_truncated, kept_trees = 0, None
        if args.max_length is not None:
            trees, num_truncated, kept_trees = drop_rows_truncation_leaves_untrained(
                trees, args.max_length, dataset_name
            )
        if len(trees) == 0:
            raise ValueError(
                f"the {dataset_name} dataset has no row left to train: of its {stats.num_rows} rows, "
                f"{sum(stats.num_dropped_rows.values())} were dropped when the trees were built "
                f"({stats.num_dropped_rows or 'no reason'}) and {num_truncated} keep no trained token within their "
                f"first max_length={args.max_length} tokens (TRL drops those too), so training would run on nothing. "
                "Raise max_length (or set max_length=None) when truncation dropped them, else fix the rows."
            )
        # rows TRL trains every token of: one of a single token trains nothing, and TRL keeps it in its batches
        every_token = data_format == "text" or (
            data_format == "messages" and not (per_turn or args.assistant_only_loss)
        )
        slots = None
        if dataset_name == "train" and every_token and args.group_by in (None, GROUP_BY_ROW):
            slots = untrained_row_slots(stats, kept_trees)
        if slots is None:
            return trees.shuffle(seed=args.seed) if args.shuffle_dataset else trees
        trees, self.tree_row_slots = self._rows_with_untrained_slots(trees, slots, args)
        return trees

    def _rows_with_untrained_slots(
        self, trees: datasets.Dataset, slots: list[int], args: TreeSFTConfig
    ) -> tuple[datasets.Dataset, list[int]]:
        """The training trees and ``tree_row_slots`` in TRL's row order (``shuffle_dataset``: TRL shuffles its rows,
        the untrained ones included, so the same permutation of as many rows orders the slots)."""
        logger.warning(
            "hf_tree: %d rows of the train dataset train no token (one token each, e.g. a text row '' is TRL's "
            "[EOS]): no tree holds them, but each keeps its slot in TRL's batches, as TRL keeps such rows.",
            slots.count(-1),
        )
        if not args.shuffle_dataset:
            return trees, slots
        order = datasets.Dataset.from_dict({"slot": range(len(slots))}).shuffle(seed=args.seed)["slot"][:]
        slots = [slots[i] for i in order]
        trees = trees.select([tree for tree in slots if tree >= 0])
        renumber = itertools.count()
        return trees, [next(renumber) if tree >= 0 else -1 for tree in slots]
