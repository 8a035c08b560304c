"""Model-zoo conformance: every causal-LM architecture of the installed transformers, built tiny, in one state.

    python benchmarks/model_zoo.py                       # the whole zoo (196 types in transformers 5.24, and the
                                                         # length-switch variants of ZOO_VARIANTS; minutes)
    python benchmarks/model_zoo.py llama gemma2 cohere   # some model types
    python benchmarks/model_zoo.py --json zoo.json       # also write the results as JSON
    python benchmarks/model_zoo.py --write-docs          # the whole zoo, and rewrite its table in docs/models.md
                                                         # and its counts line in README.md (marked blocks)

Prints the markdown table of docs/models.md (see hf_tree.zoo for what is checked and what each state means) and
exits non-zero if any architecture is a silent ``MISMATCH``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from hf_tree.zoo import (
    ZooResult,
    check_architecture,
    markdown_table,
    run_zoo,
    state_counts,
    zoo_model_types,
    zoo_variants,
)

ROOT = Path(__file__).resolve().parent.parent
# The generated blocks: docs/models.md holds the table (its last line the counts), README.md the counts line.
DOCS_BLOCKS = {ROOT / "docs" / "models.md": "zoo-table", ROOT / "README.md": "zoo-counts"}


def replace_block(text: str, name: str, content: str) -> str:
    """``text`` with what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by ``content``."""
    pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(\n<!-- {name}:end -->)", re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> block to rewrite")
    return pattern.sub(lambda m: m.group(1) + content + m.group(2), text)


def write_docs(report: str, results: Sequence[ZooResult]) -> None:
    """Rewrite the zoo's table in docs/models.md and its counts line in README.md."""
    for path, name in DOCS_BLOCKS.items():
        content = report if name == "zoo-table" else state_counts(results)
        path.write_text(replace_block(path.read_text(), name, content))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types to check (default: the whole causal-LM mapping)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--time-limit", type=int, default=300, help="seconds per architecture before giving up")
    parser.add_argument(
        "--write-docs", action="store_true", help="rewrite the table in docs/models.md and the counts in README.md"
    )
    args = parser.parse_args(argv)
    if args.write_docs and args.model_types:
        parser.error("--write-docs writes the whole zoo's table: give no model types")
    known = zoo_model_types() + zoo_variants()
    unknown = sorted(set(args.model_types) - set(known))
    if unknown:
        parser.error(f"unknown causal-LM model types {unknown}; choose among {known}")
    return run_zoo(
        lambda t: check_architecture(t, time_limit=args.time_limit),
        args.model_types or known,
        markdown_table,
        args.json,
        write_docs if args.write_docs else None,
    )


if __name__ == "__main__":
    sys.exit(main())
