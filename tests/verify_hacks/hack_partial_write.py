"""Cheat: the kernel writes only part of the output (the last row stays whatever empty() held)."""

import torch
from axpy_kernels import launch, partial_kernel


def candidate(x, y):
    return launch(partial_kernel, x, y, torch.empty_like(x))
