"""Cheat: one no-op Triton launch (to look like a kernel), then PyTorch does the work."""

from axpy_kernels import noop


def candidate(x, y):
    noop(x)
    return 2 * x + y
