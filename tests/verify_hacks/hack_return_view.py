"""Cheat: returns a view of an input (after a no-op launch)."""

from axpy_kernels import noop


def candidate(x, y):
    noop(x)
    return y.view(y.shape)
