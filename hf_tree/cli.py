"""The ``hf-tree`` command line: ``sft``, ``dpo``, ``grpo``, ``rloo``, ``kto``, ``reward`` (``trl <command>`` with the
tree trainers: same flags, accelerate's included), ``train`` (the tree SFT launcher, = ``launch/train.py``), ``demo``,
``stats`` (what a dataset saves, what packing does) and ``show`` (a picture of one packed row)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import fields

from hf_tree.cli_messages import (
    DEBUG_ENV,
    flags_of,
    one_line_errors,
    plain,
    raise_usage_errors,
    subcommand_parser,
    unknown_flag,
)
from hf_tree.data.names import AGENT_TEMPLATE, BUILTIN_DATASETS
from hf_tree.packing import PackingConfig
from hf_tree.tree import Tree

DEFAULT_TOKENIZER = "smollm2"
# `hf-tree <name>` = `trl <name>` with the tree classes (hf_tree.trl.cli.TREE_COMMANDS, imported when one runs)
TRL_COMMANDS = ("sft", "dpo", "grpo", "rloo", "kto", "reward")


def _demo(args: argparse.Namespace) -> None:
    """Pack an offline GRPO-like group and a multi-turn trajectory and print what tree packing saves."""
    from hf_tree.attention import render_mask
    from hf_tree.collator import TreeDataCollator, pop_packing_stats

    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000) for _ in range(args.prompt_tokens)]
    completions = [[rng.randrange(1000) for _ in range(rng.randint(8, args.completion_tokens))] for _ in range(8)]
    group = Tree.from_sequences(
        [prompt + c for c in completions], [[0] * len(prompt) + [1] * len(c) for c in completions]
    )
    history, turns = [], []
    for _ in range(args.turns):
        history = history + [rng.randrange(1000) for _ in range(rng.randint(20, 60))]
        turns.append(list(history))
    trajectory = Tree.from_sequences(turns)
    for name, tree in (("GRPO-like group", group), ("agent trajectory", trajectory)):
        print(
            f"{name:17s} branches={tree.num_branches:3d} branch tokens={tree.num_branch_tokens:6d} "
            f"tree tokens={tree.num_tokens:6d} dedup ratio={tree.dedup_ratio:5.2f}"
        )
    collator = TreeDataCollator(max_packed_tokens=args.max_packed_tokens)
    batch = collator([group.to_dict(), trajectory.to_dict()])
    stats = pop_packing_stats(batch)
    print(
        f"packed into {stats.num_rows} row(s) of {batch['input_ids'].shape[1]} tokens: "
        f"{int(batch['loss_positions'].numel())} loss edges, padding {stats.padding_fraction:.1%}, "
        f"dedup ratio {stats.dedup_ratio:.2f}"
    )
    small = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7]])
    print("mask of a 3-branch tree (# = query row sees key column):")
    print(render_mask(TreeDataCollator(max_packed_tokens=8)([small.to_dict()])["kv_end"][0].long()))


def _load_tokenizer(name: str):
    """``smollm2``: the offline SmolLM2-135M-Instruct tokenizer (``hf_tree.assets``); else a local tokenizer folder."""
    if name == DEFAULT_TOKENIZER:
        from hf_tree.assets import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _training_config(args: argparse.Namespace):
    """``hf-tree sft``'s ``TreeSFTConfig`` with the flags given (``SFT_DATA_FIELDS``, the packing fields); the
    others, and every default, are the config's own. ``builtin:synthetic-agent`` is the main job's data, which only
    ``hf-tree train`` (``launch/train.py``) trains: its defaults are that job's (``hf_tree.launcher``)."""
    from hf_tree.data.sources import builtin_name
    from hf_tree.sft_stats import sft_config

    names = (*SFT_DATA_FIELDS, *(f.name for f in fields(PackingConfig)))
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if args.data is not None and builtin_name(args.data) == "synthetic-agent":
        from hf_tree.launcher import DEFAULT_DATA_RUN, DEFAULT_RUN

        given = {**{k: v for k, v in {**DEFAULT_RUN, **DEFAULT_DATA_RUN}.items() if k in names}, **given}
    config = sft_config(**given)
    if config.batch_unit == "trees" and args.trees_per_batch is None:  # the trainer deals whole trees
        args.trees_per_batch = config.per_device_train_batch_size
    return config


def _load(args: argparse.Namespace):
    """(trees, drop counts by reason, the training config, the trainer's micro-batching or None with
    --trees_per_batch) of the DATA argument: the trees ``hf-tree sft`` trains with the same flags and how it deals
    them (``hf_tree.sft_stats``); the tokenizer is loaded only if DATA needs it."""
    from hf_tree.data.sources import load_tree_rows, tree_rows_summary  # the resolver launch/train.py uses too
    from hf_tree.sft_stats import sft_tree_rows, trainer_batching

    if args.data and args.dataset_name and args.data != args.dataset_name:
        raise ValueError("pass the data once: DATA or --dataset_name.")
    args.data = args.data or args.dataset_name
    if args.data is None:
        raise ValueError("no data: pass DATA (or --dataset_name), e.g. `hf-tree stats train.jsonl`.")
    config = _training_config(args)
    slots: list[list[int] | None] = [None]  # the trainer's tree_row_slots (rows that train nothing keep a slot)

    def build(rows, tokenizer, template):
        trees, stats, slots[0] = sft_tree_rows(rows, tokenizer, template, config)
        return trees, stats

    loaded = load_tree_rows(
        args.data,
        lambda: _load_tokenizer(args.tokenizer),
        chat_template=args.chat_template,
        subset=args.subset,
        limit=args.limit,
        split=args.dataset_train_split,
        dataset_config=args.dataset_config,
        build=build,
    )
    if getattr(args, "save_trees", None):
        loaded.trees.save_to_disk(args.save_trees)
    trees = [Tree.from_dict(row, row=i) for i, row in enumerate(loaded.trees)]
    batching = None if args.trees_per_batch is not None else trainer_batching(config, slots[0])
    return trees, tree_rows_summary(loaded), config, batching


# Fields of TreeSFTConfig that decide which trees train and how they are batched: the flags of `hf-tree stats` (with
# the PackingConfig fields), as `hf-tree sft` spells them: name -> (type, help). Their defaults are TreeSFTConfig's.
SFT_DATA_FIELDS: dict[str, tuple[type, str]] = {
    "group_by": (str, "which rows merge into one tree: a column name, '<prompt tokens>' or '<row>'"),
    "messages_branches": (str, "'conversation' (TRL's rows: one branch per conversation) or 'per_turn'"),
    "train_on": (str, "messages_branches='per_turn' only: 'last_assistant' or 'all_assistant'"),
    "assistant_only_loss": (bool, "train the assistant tokens of 'messages' rows only"),
    "completion_only_loss": (bool, "prompt rows: train the completions only (default: yes)"),
    "dataset_text_field": (str, "the column of text rows"),
    "eos_token": (str, "the tokenizer's EOS token (text rows end with it)"),
    "max_length": (int, "the per-sample limit: the branch limit max_branch_tokens unless that is given"),
    "shuffle_dataset": (bool, "shuffle the trees once before training"),
    "batch_unit": (str, "what per_device_train_batch_size counts: 'rows' (TRL's) or 'trees' (planned in order)"),
    "per_device_train_batch_size": (int, "rows (samples) per micro-batch"),
    "gradient_accumulation_steps": (int, "micro-batches per optimizer step"),
    "train_sampling_strategy": (str, "the order the trainer takes the rows in: 'random' or 'sequential'"),
    "seed": (int, "the trainer's seed (orders the rows with train_sampling_strategy='random')"),
    "data_seed": (int, "the trainer's data_seed (else --seed)"),
    "dataset_num_proc": (int, "tokenizing worker processes"),
}


def _bool(text: str) -> bool:
    """A flag's boolean value, read as transformers' parser (``hf-tree sft``'s) reads it."""
    from transformers.hf_argparser import string_to_bool  # here: the help must not import transformers

    return string_to_bool(text)


def _stats(args: argparse.Namespace) -> None:
    """Print what tree packing saves on DATA and what packing at --max-packed-tokens does in hf-tree sft's
    micro-batches."""
    from hf_tree.stats import ModelShape, compute_stats, format_report

    trees, dropped, config, batching = _load(args)
    if args.tokenizer == DEFAULT_TOKENIZER:
        shape, source = ModelShape(), "SmolLM2-135M-Instruct's shape (the offline default)"
    else:
        from hf_tree.sft_stats import model_shape

        shape, source = model_shape(args.tokenizer)
    try:
        stats = compute_stats(
            trees,
            config.packing_config(),
            batching=batching,
            trees_per_batch=args.trees_per_batch,
            model_shape=shape,
            model_shape_source=source,
            dropped=dropped,
        )
    except ValueError as error:
        raise ValueError(f"training with these packing settings would stop: {error}") from None
    print(json.dumps(stats.to_dict(), indent=2, default=str) if args.json else format_report(stats))
    if args.plot:
        from hf_tree.plots import plot_stats

        plot_stats(stats, args.plot, title=f"{args.data}: {stats.num_trees} trees, {stats.num_branches} branches")
        print(f"wrote {args.plot}", file=sys.stderr)


def _show(args: argparse.Namespace) -> None:
    """Draw packed row --index of DATA (the tree and its mask) to --out."""
    from hf_tree.plots import plot_packed_row
    from hf_tree.stats import plan_batches, plan_rows, trainer_batches

    trees, _, config, batching = _load(args)
    if batching is None:
        plan = plan_rows(trees, config.packing_config(), trees_per_batch=args.trees_per_batch)
    else:
        plan = plan_batches(trainer_batches(trees, batching), config.packing_config())
    if not -len(plan.rows) <= args.index < len(plan.rows):
        raise ValueError(f"--index {args.index} is out of range: DATA packs into {len(plan.rows)} rows.")
    parts = plan.rows[args.index]
    for k, part in enumerate(parts):
        print(
            f"tree part {k}: {part.num_branches} branches, {part.num_nodes} nodes, {part.num_tokens} tokens "
            f"(dedup {part.dedup_ratio:.2f})"
        )
    window = None
    if args.window:
        first, _, last = args.window.partition(":")
        window = (int(first or 0), int(last) if last else sum(p.num_tokens for p in parts))
    plot_packed_row(
        parts,
        args.out,
        title=f"{args.data} row {args.index} of {len(plan.rows)} "
        f"(max_packed_tokens={config.max_packed_tokens}; dark: trained tokens)",
        window=window,
    )
    print(f"wrote {args.out}", file=sys.stderr)


def _flags(name: str, *aliases: str) -> list[str]:
    """``--name`` in both spellings (``--max-packed-tokens``, ``--max_packed_tokens``: the trainers' flags are TRL's
    underscore ones), then ``aliases``."""
    dashed, underscored = "--" + name.replace("_", "-"), "--" + name.replace("-", "_")
    return [dashed, *([underscored] if underscored != dashed else []), *aliases]


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "data",
        nargs="?",
        help="what --dataset_name takes: a saved tree dataset folder (Dataset.save_to_disk), a folder of "
        ".jsonl/.json/.parquet files (a hub-style local dataset), one .jsonl/.json/.parquet file in a user format "
        "(messages; prompt+completions; prompt+completion; prompt/chosen/rejected), or a built-in dataset: "
        + ", ".join(BUILTIN_DATASETS),
    )
    parser.add_argument(*_flags("dataset_name"), dest="dataset_name", default=None, help="= DATA (the trainers' flag)")
    parser.add_argument(
        *_flags("tokenizer", "--model_name_or_path"),
        dest="tokenizer",
        default=DEFAULT_TOKENIZER,
        help="'smollm2' (offline SmolLM2-135M-Instruct, the default), a model folder or hub id (its tokenizer, and "
        "its config's shape for the FLOP estimate) or a tokenizer folder",
    )
    parser.add_argument(
        *_flags("chat_template", "--chat_template_path"),
        dest="chat_template",
        default=None,
        help=f"a .jinja file or a TRL template name (e.g. qwen3); builtin agent data defaults to {AGENT_TEMPLATE}",
    )
    parser.add_argument(
        *_flags("subset"), default=None, help="builtin:champ prompt type (e.g. 0-Shot) or builtin:bfcl category"
    )
    parser.add_argument(
        *_flags("limit"),
        type=int,
        default=None,
        help="builtin sources: CHAMP problems, BFCL tasks or synthetic conversations to read (synthetic-agent: the "
        "main job's data, 24 conversations unless given)",
    )
    parser.add_argument(*_flags("dataset_train_split"), default=None, help="the split to read (default: train)")
    parser.add_argument(*_flags("dataset_config"), default=None, help="the dataset's configuration (its name)")
    training = parser.add_argument_group(
        "training (hf-tree sft's flags)",
        "The trees, micro-batches and packing are hf-tree sft's with the same flags (TreeSFTConfig's defaults, "
        "hf_tree.sft_stats): its dataset preparation, the trees dealt as its sampler deals them (batch_unit='rows', "
        "one process, the first epoch), each micro-batch merged (merge_in_batch) and packed as its collator does, so "
        "'dedup in training' is the dedup_ratio it logs.",
    )
    for name, (kind, help_text) in SFT_DATA_FIELDS.items():
        boolean = dict(type=_bool, nargs="?", const=True) if kind is bool else dict(type=kind)
        aliases = ("--num_proc",) if name == "dataset_num_proc" else ()
        training.add_argument(*_flags(name, *aliases), dest=name, default=argparse.SUPPRESS, help=help_text, **boolean)
    _add_packing_arguments(training)
    training.add_argument(
        *_flags("trees_per_batch"),
        type=int,
        default=None,
        help="instead of the trainer's micro-batches: pack consecutive batches of this many trees (batch_unit='trees' "
        "order: sequential); larger than the dataset: all trees at once, an upper bound of what merging can save",
    )


def _add_packing_arguments(parser) -> None:
    """One flag per ``PackingConfig`` field (``--max-packed-tokens`` = ``--max_packed_tokens``, ...), with its help
    and choices; unset, the field is ``TreeSFTConfig``'s."""
    for f in fields(PackingConfig):
        choices = f.metadata.get("choices")
        kind = dict(type=_bool, nargs="?", const=True) if f.type == "bool" else dict(type=str if choices else int)
        parser.add_argument(
            *_flags(f.name),
            dest=f.name,
            choices=choices,
            default=argparse.SUPPRESS,
            help=plain(f.metadata["help"]),
            **kind,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-tree",
        description=plain(__doc__),
        epilog=f"A failure ends with one line; --debug (or {DEBUG_ENV}=1) shows the traceback instead.",
    )
    parser.add_argument("--debug", action="store_true", help=f"show the full traceback of a failure (= {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in TRL_COMMANDS:  # their flags are TRL's script's: parsed by it (`hf-tree sft --help` lists them)
        commands.add_parser(name, add_help=False, help=f"`trl {name}` with hf_tree's tree trainer (the same flags)")
    commands.add_parser("train", add_help=False, help="the tree SFT launcher (= python launch/train.py; --help)")
    demo = commands.add_parser("demo", help="pack offline example trees and print their statistics")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(*_flags("prompt_tokens"), type=int, default=512)
    demo.add_argument(*_flags("completion_tokens"), type=int, default=256)
    demo.add_argument("--turns", type=int, default=10)
    demo.add_argument(*_flags("max_packed_tokens"), type=int, default=4096)
    demo.set_defaults(run=_demo)

    stats = commands.add_parser("stats", help="what tree packing saves on a dataset, and what packing does")
    _add_data_arguments(stats)
    stats.add_argument("--plot", default=None, help="write a PNG of the distributions here")
    stats.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the report")
    stats.add_argument(*_flags("save_trees"), default=None, help="also save the tree rows here (Dataset.save_to_disk)")
    stats.set_defaults(run=_stats)

    show = commands.add_parser("show", help="draw one packed row (its trees and attention mask) to a PNG")
    _add_data_arguments(show)
    show.add_argument("--index", type=int, default=0, help="the packed row to draw (negative counts from the end)")
    show.add_argument("--out", default="row.png", help="PNG file to write")
    show.add_argument("--window", default=None, help="START:END packed positions to draw (zoom), e.g. 6000:7400")
    show.set_defaults(run=_show)
    return raise_usage_errors(parser)


def main(argv: Sequence[str] | None = None) -> None:
    """``hf-tree [--debug] <command> ...``: every failure ends with one line (``hf_tree.cli_messages``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    with one_line_errors("hf-tree"):
        args, rest = parser.parse_known_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # launched training processes inherit it
    with one_line_errors(f"hf-tree {args.command}"):
        if args.command in TRL_COMMANDS:
            from hf_tree.trl.cli import CommandContext, TreeTrainingCommand  # hf_tree.trl names the fix without TRL

            raise SystemExit(TreeTrainingCommand(args.command).run(args, CommandContext(argv=argv)))
        if args.command == "train":
            from hf_tree.launcher import main as train

            train(rest)  # inside this command's one_line_errors
            return
        if rest:  # the other commands' flags are strict
            raise unknown_flag(rest[0], flags_of(subcommand_parser(parser, args.command)), f"hf-tree {args.command}")
        args.run(args)


if __name__ == "__main__":
    main()
