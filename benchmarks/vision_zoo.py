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
import dataclasses
import json
import sys
import warnings

import torch
import transformers

from hf_tree.vision.zoo import check_vision_architecture, markdown_table, vision_model_types
from tests.vision_models import CONFIGS


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
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
    results = []
    for model_type in args.model_types or known:
        result = check_vision_architecture(model_type, CONFIGS, time_limit=args.time_limit)
        print(f"{model_type}: {result.state} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
        results.append(result)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 1 if any(r.state == "MISMATCH" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
