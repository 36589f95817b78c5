"""Timing GPU work: the median of CUDA-event-timed repetitions after warm-up."""

from __future__ import annotations

import statistics


def cuda_median_s(fn, warmup: int = 1, reps: int = 7, min_time_s: float = 0.0, max_reps: int | None = None) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream, timed with events.

    At least ``reps`` timed calls; with ``min_time_s``, short calls repeat until their total
    reaches it (at most ``max_reps``).
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < reps or (sum(times) < min_time_s and (max_reps is None or len(times) < max_reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
