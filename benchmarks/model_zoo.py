"""Model-zoo conformance: every causal-LM architecture of the installed transformers, built tiny, in one state.

    python benchmarks/model_zoo.py                       # the whole zoo (196 types in transformers 5.24, and the
                                                         # length-switch variants of ZOO_VARIANTS; minutes)
    python benchmarks/model_zoo.py llama gemma2 cohere   # some model types
    python benchmarks/model_zoo.py --json zoo.json       # also write the results as JSON

Prints the markdown table of docs/models.md (see hf_tree.zoo for what is checked and what each state means) and
exits non-zero if any architecture is a silent ``MISMATCH``.
"""

from __future__ import annotations

import argparse
import sys

from hf_tree.zoo import check_architecture, markdown_table, run_zoo, zoo_model_types, zoo_variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types to check (default: the whole causal-LM mapping)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--time-limit", type=int, default=300, help="seconds per architecture before giving up")
    args = parser.parse_args(argv)
    known = zoo_model_types() + zoo_variants()
    unknown = sorted(set(args.model_types) - set(known))
    if unknown:
        parser.error(f"unknown causal-LM model types {unknown}; choose among {known}")
    return run_zoo(
        lambda t: check_architecture(t, time_limit=args.time_limit),
        args.model_types or known,
        markdown_table,
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
