"""Kernel timing: median of many runs, device events, L2 flushed between runs on a GPU."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

# Imported by name: the package attribute `accel.backend` is the function, not this module.
from accel.backend import Event, backend, default_device, synchronize

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H200: 50 MB)


def do_bench(fn: Callable[[], object], warmup: int = 5, rep: int = 30, flush_l2: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``rep`` runs after ``warmup`` runs.

    On a GPU each run is timed with device events and preceded by a write of a buffer larger
    than L2, so no run profits from the previous one's cache. On the cpu the figure is wall time
    and, under the Triton interpreter, says nothing about a GPU.
    """
    if warmup < 0 or rep < 1:
        raise ValueError(f"do_bench: expected warmup >= 0 and rep >= 1, got warmup={warmup}, rep={rep}")
    on_gpu = backend() != "cpu"
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=default_device()) if (
        on_gpu and flush_l2
    ) else None
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(rep):
        if flush is not None:
            flush.zero_()
        start, end = Event(), Event()
        start.record()
        fn()
        end.record()
        synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
