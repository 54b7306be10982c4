"""Cheat: computes in place into y with a real kernel and hands y back (an input, not a new output)."""

from axpy_kernels import axpy_kernel, launch


def candidate(x, y):
    return launch(axpy_kernel, x, y, y)
