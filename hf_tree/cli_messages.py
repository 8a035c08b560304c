"""What the command line prints (``hf-tree <command>``, ``python launch/train.py``): one line per failure, plain
help text.

A failed command ends with one line naming the cause (and, for a ``ValueError`` of hf_tree, the fix), not a
traceback: the traceback is shown with ``hf-tree --debug <command>`` or ``HF_TREE_DEBUG=1``. A training process
started by ``hf-tree sft|dpo|...`` (through ``accelerate launch``) writes its line to the file named by
``HF_TREE_ERROR_FILE``; the command that launched it prints that line last, after the launcher's own output.
Argument errors (an unknown flag, an unknown config key) name the closest valid flag (``difflib``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

DEBUG_ENV = "HF_TREE_DEBUG"
ERROR_FILE_ENV = "HF_TREE_ERROR_FILE"
DEBUG_HINT = f"{DEBUG_ENV}=1 shows the traceback"


class UsageError(ValueError):
    """A command-line argument or config key that no parser accepts."""


def debug_enabled() -> bool:
    """Whether ``HF_TREE_DEBUG`` asks for full tracebacks (any value but empty, ``0``, ``false``, ``no``)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


# Errors of the stack whose fix on the command line is not the one they name: (part of the message, the fix).
FLAG_FIXES = (
    (  # transformers' TrainingArguments on a machine without a GPU: TRL's configs default to bf16=True
        "Your setup doesn't support bf16/gpu",
        "On a CPU, pass --bf16 False (TRL's configs default to bf16=True); --use_cpu True keeps bf16 as CPU autocast.",
    ),
    (  # datasets, for a --dataset_name that is no local path and not on the Hub (offline: after a minute of retries)
        "on the Hub",
        "It is no local file or folder either; a local path written as ./PATH (or /PATH) is checked at once.",
    ),
)


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message with whitespace collapsed (and the flag that fixes it, ``FLAG_FIXES``);
    other types than ``ValueError`` (whose hf_tree messages name the fix) are named, with the way to see the
    traceback."""
    text = " ".join(str(error).split())
    text = " ".join([text, *(fix for marker, fix in FLAG_FIXES if marker in text)])
    if isinstance(error, ValueError) and text:
        return text
    return f"{type(error).__name__}: {text} ({DEBUG_HINT})" if text else f"{type(error).__name__} ({DEBUG_HINT})"


@contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Turn an exception raised inside into ``SystemExit("<prog>: <one line>")`` (exit status 1), unless
    ``HF_TREE_DEBUG`` is set. Inside a launched training process (``HF_TREE_ERROR_FILE`` set) the line goes to that
    file for the launching command to print, and the process exits with status 1 silently."""
    try:
        yield
    except Exception as error:  # SystemExit (--help, argparse) and KeyboardInterrupt pass unchanged
        if debug_enabled():
            raise
        message = f"{prog}: {one_line(error)}"
        path = os.environ.get(ERROR_FILE_ENV)
        if path:
            # each failing rank appends; the launching command prints the first line
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(message + "\n")
            raise SystemExit(1) from None
        raise SystemExit(message) from None


def _normalized(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").lower()


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name`` (dashes and underscores alike), or ``None`` when none is close."""
    dashed = "-" in name.lstrip("-")
    by_name: dict[str, str] = {}
    for choice in choices:  # of two spellings of one flag, the one written like ``name``
        key = _normalized(choice)
        if key not in by_name or ("-" in choice.lstrip("-")) == dashed:
            by_name[key] = choice
    match = difflib.get_close_matches(_normalized(name), list(by_name), n=1, cutoff=0.6)
    return by_name[match[0]] if match else None


def unknown_flag(flag: str, known: Iterable[str], prog: str) -> UsageError:
    """The error for a flag (``--name`` or ``--name=value``) that ``prog`` does not take, naming the closest one."""
    flag = flag.split("=", 1)[0]
    suggestion = closest(flag, [k for k in known if k.startswith("--")])
    fix = f"did you mean {suggestion}?" if suggestion else f"`{prog} --help` lists the flags."
    return UsageError(f"unknown flag {flag}: {fix}")


def unknown_config_key(path: str, key: str, known: Iterable[str], prog: str) -> UsageError:
    """The error for a key of ``--config path`` that is no field of ``prog``, naming the closest field."""
    suggestion = closest(key, known)
    fix = f"did you mean {_normalized(suggestion)!r}?" if suggestion else f"`{prog} --help` lists the fields."
    return UsageError(f"--config {path}: key {key!r} is not a field of {prog}: {fix}")


def flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string ``parser`` takes (``--max_packed_tokens``, ``-h``, ...)."""
    return list(parser._option_string_actions)


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``parser``'s subcommand ``name``."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return next(a.choices[name] for a in actions if name in a.choices)


def raise_usage_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` (and its subcommand parsers) raise ``UsageError`` with one line instead of printing its usage
    and exiting: an unknown flag names the closest valid flag."""

    def error(message: str) -> None:
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise unknown_flag(unknown.group(1), flags_of(parser), parser.prog)
        raise UsageError(f"{message} (`{parser.prog} --help` lists the flags)")

    parser.error = error  # argparse calls self.error on a bad command line
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                raise_usage_errors(subparser)
    return parser


def plain(text: str | None) -> str | None:
    """Help text without reStructuredText markup: ``code`` -> code."""
    return None if text is None else re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL)


def plain_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with its description and every flag's help ``plain`` (help text comes from docstrings and field
    docs written in reStructuredText)."""
    parser.description = plain(parser.description)
    for action in parser._actions:
        action.help = plain(action.help)
    return parser
