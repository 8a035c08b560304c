"""Cost of the first-use self-check (hf_tree.models.check) against ordinary forwards of the same model, in one run.

    python benchmarks/self_check.py                 # SmolLM2-135M (offline, float32), 3 repeats
    python benchmarks/self_check.py --dtype bfloat16 --repeats 5

Prints the probe's shape, the median time of the whole probe and of one forward of its longest branch, and their
ratio: the self-check's one-off price in forwards. Absolute CPU times on the shared 2-core box vary; the ratio is the
figure to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers

from hf_tree.assets import load_smollm2_model
from hf_tree.models.check import probe_tree_exactness
from hf_tree.models.probe import probe_shape


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model = load_smollm2_model(getattr(torch, args.dtype)).eval()
    shape = probe_shape(model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, shape.longest_branch))
    probe_times, forward_times = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same load on the machine
        start = time.perf_counter()
        probe_tree_exactness(model)
        probe_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        forward_times.append(time.perf_counter() - start)
    probe, forward = statistics.median(probe_times), statistics.median(forward_times)
    print(f"SmolLM2-135M {args.dtype}: probe siblings {shape.suffixes} after a {shape.prefix}-token prefix")
    print(f"| probe (s) | one {shape.longest_branch}-token forward (s) | probe / forward |")
    print("|---|---|---|")
    print(f"| {probe:.2f} | {forward:.2f} | {probe / forward:.1f} |")


if __name__ == "__main__":
    main()
