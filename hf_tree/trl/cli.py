"""``hf-tree sft|dpo|grpo|rloo|kto|reward``: TRL's CLI with the tree trainers.

``trl <command> ARGS`` parses ``ARGS`` with its installed script's parser (``trl/scripts/<command>.py``:
``make_parser()``), hands the flags that parser does not know to ``accelerate launch`` (``--num_processes``,
``--config_file``, ``--accelerate_config``) and launches the script. ``hf-tree <command> ARGS`` does the same with
TRL's own code (its command class, config resolution and subsequence split), except that the script's ``trl`` names
``<X>Config``/``<X>Trainer`` are hf_tree's ``Tree<X>Config``/``Tree<X>Trainer``: in this process (so the parser knows
the tree flags, e.g. ``--max_packed_tokens``, and ``--help`` lists them) and in every launched process, which runs
``python -m hf_tree.trl.cli <command> ARGS`` = TRL's installed script (``runpy``) after the same swap. No copy of
TRL's scripts lives here: a TRL upgrade changes both CLIs alike.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from argparse import Namespace

import trl
from accelerate.commands.launch import launch_command, launch_command_parser
from trl.cli.accelerate_config import resolve_accelerate_config_argument
from trl.cli.commands.base import CommandContext
from trl.cli.commands.training import TrainingCommand, _subtract_subsequence

# command -> (TRL class-name stem, hf_tree module defining Tree<stem>Config and Tree<stem>Trainer)
TREE_COMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("SFT", "hf_tree.trl.sft"),
    "dpo": ("DPO", "hf_tree.trl.dpo"),
    "grpo": ("GRPO", "hf_tree.trl.grpo"),
    "rloo": ("RLOO", "hf_tree.trl.rloo"),
    "kto": ("KTO", "hf_tree.trl.kto"),
    "reward": ("Reward", "hf_tree.trl.reward"),
}


def swap_tree_classes(command: str) -> None:
    """Make ``from trl import <X>Config, <X>Trainer`` (how TRL's scripts import them, inside ``make_parser`` and
    ``main``) return hf_tree's tree classes for ``command``. TRL's own modules keep their references to TRL's classes
    (the tree classes subclass them)."""
    stem, module_name = TREE_COMMANDS[command]
    module = importlib.import_module(module_name)
    for kind in ("Config", "Trainer"):
        setattr(trl, stem + kind, getattr(module, f"Tree{stem}{kind}"))


class TreeTrainingCommand(TrainingCommand):
    """TRL's ``TrainingCommand`` launching its script through ``python -m hf_tree.trl.cli`` (the tree classes)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.help_text = f"TRL's `trl {name}` with hf_tree's Tree{TREE_COMMANDS[name][0]}Trainer (same flags)"

    def run(self, args: Namespace, context: CommandContext) -> int:
        """``TrainingCommand.run`` (same parsing and split of the arguments) with the tree classes swapped in."""
        swap_tree_classes(self.name)
        script = importlib.import_module(f"trl.scripts.{self.name}")
        all_args = context.argv_after(self.name)
        parser = script.make_parser(prog=f"hf-tree {self.name}")
        *_, config_remaining, cli_remaining = parser.parse_args_and_config(
            all_args, return_remaining_strings=True, separate_remaining_strings=True
        )
        launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
        script_args = _subtract_subsequence(all_args, cli_remaining)
        runner = ["--module", __name__, self.name]  # `python -m hf_tree.trl.cli <command>` in each process
        launch_command(launch_command_parser().parse_args([*launch_args, *runner, *script_args]))
        return 0


def run_script(command: str, argv: list[str]) -> None:
    """Run TRL's installed ``trl/scripts/<command>.py`` as ``__main__`` with ``argv``, tree classes swapped in."""
    swap_tree_classes(command)
    sys.argv = [f"hf-tree {command}", *argv]
    runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # one launched process of `hf-tree <command>`
    run_script(sys.argv[1], sys.argv[2:])
