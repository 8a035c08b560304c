"""Memory measurement shared by the benchmarks. Not a benchmark itself.

Each benchmark imports it from its own folder (``python benchmarks/<name>.py`` puts that folder on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated through torch's CPU allocator during ``fn`` above what was allocated before it.

    The torch profiler records every allocation and free (in order); their running sum's maximum is the peak.
    Unlike the process's resident set, this is not hidden by malloc reusing memory freed earlier.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak
