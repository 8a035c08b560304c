"""Vision-language model zoo: every image-text-to-text architecture of the installed transformers, built tiny, in one
state (exact / refused / not buildable / error / MISMATCH; see hf_tree.vision.zoo).

    PYTHONPATH=. python benchmarks/vision_zoo.py                 # the whole image-text-to-text mapping (minutes)
    PYTHONPATH=. python benchmarks/vision_zoo.py llava gemma3    # some model types
    PYTHONPATH=. python benchmarks/vision_zoo.py --json vz.json  # also write the results as JSON

The supported families are built from tests/vision_models.py's tiny configs (hence ``PYTHONPATH=.``), the others
from their default configs shrunk generically. Prints the markdown table of docs/vision.md and exits non-zero if
any architecture is a silent ``MISMATCH``.
"""

from __future__ import annotations

import argparse
import sys

from hf_tree.vision.zoo import check_vision_architecture, markdown_table, vision_model_types
from hf_tree.zoo import run_zoo
from tests.vision_models import ZOO_CONFIGS as CONFIGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types (default: the whole image-text-to-text mapping)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--time-limit", type=int, default=120, help="seconds per architecture before giving up")
    args = parser.parse_args(argv)
    known = vision_model_types()
    unknown = sorted(set(args.model_types) - set(known))
    if unknown:
        parser.error(f"unknown image-text-to-text model types {unknown}; choose among {known}")
    return run_zoo(
        lambda t: check_vision_architecture(t, CONFIGS, time_limit=args.time_limit),
        args.model_types or known,
        markdown_table,
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
