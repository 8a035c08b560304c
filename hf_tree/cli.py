"""The ``hf-tree`` command line."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from hf_tree.attention import render_mask
from hf_tree.collator import TreeDataCollator
from hf_tree.tree import Tree


def _demo(args: argparse.Namespace) -> None:
    """Pack an offline GRPO-like group and a multi-turn trajectory and print what tree packing saves."""
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
    stats = collator.stats
    print(
        f"packed into {stats.num_rows} row(s) of {batch['input_ids'].shape[1]} tokens: "
        f"{int(batch['loss_positions'].numel())} loss edges, padding {stats.padding_fraction:.1%}, "
        f"dedup ratio {stats.dedup_ratio:.2f}"
    )
    small = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7]])
    print("mask of a 3-branch tree (# = query row sees key column):")
    print(render_mask(TreeDataCollator(max_packed_tokens=8)([small.to_dict()])["kv_end"][0].long()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-tree", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="pack offline example trees and print their statistics")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt-tokens", type=int, default=512)
    demo.add_argument("--completion-tokens", type=int, default=256)
    demo.add_argument("--turns", type=int, default=10)
    demo.add_argument("--max-packed-tokens", type=int, default=4096)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
