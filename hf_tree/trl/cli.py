"""``hf-tree sft|dpo|grpo|rloo|kto|reward``: TRL's CLI with the tree trainers.

``trl <command> ARGS`` parses ``ARGS`` with its installed script's parser (``trl/scripts/<command>.py``:
``make_parser()``), hands the flags that parser does not know to ``accelerate launch`` (``--num_processes``,
``--config_file``, ``--accelerate_config``) and launches the script. ``hf-tree <command> ARGS`` does the same with
TRL's own code (its command class, config resolution and subsequence split), except that the script's ``trl`` names
``<X>Config``/``<X>Trainer`` are hf_tree's ``Tree<X>Config``/``Tree<X>Trainer``: in this process (so the parser knows
the tree flags, e.g. ``--max_packed_tokens``, and ``--help`` lists them) and in every launched process, which runs
``python -m hf_tree.trl.cli <command> ARGS`` = TRL's installed script (``runpy``) after the same swap. No copy of
TRL's scripts lives here: a TRL upgrade changes both CLIs alike.

The launched processes run with ``PYTHONSAFEPATH=1``: ``python -m`` would otherwise put the working directory first
on the import path, and a folder named ``hf_tree`` there (the folder above a clone) would shadow the package.
Failures end with one line (``hf_tree.cli_messages``): a flag or config key that neither TRL's script nor
``accelerate launch`` takes is named, with the closest valid flag, before anything is launched; a launched process
that fails hands its one line to this one, which prints it last.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import trl
from accelerate.commands.launch import launch_command, launch_command_parser
from accelerate.utils import patch_environment
from trl.cli.accelerate_config import resolve_accelerate_config_argument
from trl.cli.commands.base import CommandContext
from trl.cli.commands.training import TrainingCommand, _subtract_subsequence

from hf_tree.cli_messages import (
    ERROR_FILE_ENV,
    debug_enabled,
    flags_of,
    one_line_errors,
    plain_help,
    raise_usage_errors,
    unknown_config_key,
    unknown_flag,
)
from hf_tree.data.sources import check_local_dataset

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
        """``TrainingCommand.run`` (same parsing and split of the arguments) with the tree classes swapped in.

        Returns the exit status of the launched processes; argument errors raise ``UsageError`` first."""
        swap_tree_classes(self.name)
        script = importlib.import_module(f"trl.scripts.{self.name}")
        all_args = context.argv_after(self.name)
        prog = f"hf-tree {self.name}"
        parser = plain_help(raise_usage_errors(script.make_parser(prog=prog)))
        script_args, *_, config_remaining, cli_remaining = parser.parse_args_and_config(
            all_args, return_remaining_strings=True, separate_remaining_strings=True
        )
        if getattr(script_args, "dataset_name", None):  # a missing local path: said now, not after hub retries
            check_local_dataset(script_args.dataset_name)
        launch_parser = launch_command_parser()
        check_launch_flags(all_args, config_remaining, cli_remaining, flags_of(parser), flags_of(launch_parser), prog)
        launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
        script_args = _subtract_subsequence(all_args, cli_remaining)
        runner = ["--module", __name__, self.name]  # `python -m hf_tree.trl.cli <command>` in each process
        launch = launch_parser.parse_args([*launch_args, *runner, *script_args])
        return launch_reporting_errors(launch, prog)


# TRL's own flag, resolved to accelerate's --config_file by resolve_accelerate_config_argument
TRL_LAUNCH_FLAGS = ("--accelerate_config",)


def check_launch_flags(
    all_args: list[str],
    config_remaining: list[str],
    cli_remaining: list[str],
    script_flags: list[str],
    launch_flags: list[str],
    prog: str,
) -> None:
    """Raise ``UsageError`` for a flag (or ``--config`` key) that neither the script's parser nor ``accelerate
    launch`` takes, naming the closest valid one (else accelerate would print its usage and blame itself)."""
    accepted = {*launch_flags, *TRL_LAUNCH_FLAGS}
    known = [*script_flags, *accepted]
    for token in config_remaining[::2]:  # TRL returns unused config keys as "--key value" pairs
        if token not in accepted:
            config = all_args[all_args.index("--config") + 1]
            raise unknown_config_key(config, token.removeprefix("--"), [f.lstrip("-") for f in known], prog)
    for token in cli_remaining:
        if token.startswith("-") and token.split("=", 1)[0] not in accepted and not _is_number(token):
            raise unknown_flag(token, known, prog)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def launch_reporting_errors(launch: Namespace, prog: str) -> int:
    """``accelerate launch`` of the parsed ``launch`` arguments; a failed run ends with the first line a launched
    process wrote to ``HF_TREE_ERROR_FILE`` (or one line naming the exit status), not the launcher's traceback."""
    with tempfile.TemporaryDirectory() as folder:
        error_file = os.path.join(folder, "error.txt")
        # PYTHONSAFEPATH: `python -m` must not import a folder named hf_tree from the working directory
        with patch_environment(PYTHONSAFEPATH="1", **{ERROR_FILE_ENV: error_file}):
            try:
                launch_command(launch)
            except Exception as error:  # CalledProcessError (one process), torchrun's ChildFailedError (several)
                lines = Path(error_file).read_text(encoding="utf-8").splitlines() if Path(error_file).exists() else []
                if lines and not debug_enabled():
                    raise SystemExit(lines[0]) from None
                status = getattr(error, "returncode", None)
                raise RuntimeError(
                    f"the training process failed ({type(error).__name__}"
                    + (f", exit status {status}" if status is not None else "")
                    + "; its output is above)"
                ) from error
    return 0


def run_script(command: str, argv: list[str]) -> None:
    """Run TRL's installed ``trl/scripts/<command>.py`` as ``__main__`` with ``argv``, tree classes swapped in."""
    swap_tree_classes(command)
    sys.argv = [f"hf-tree {command}", *argv]
    runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # one launched process of `hf-tree <command>`
    with one_line_errors(f"hf-tree {sys.argv[1]}"):
        run_script(sys.argv[1], sys.argv[2:])
