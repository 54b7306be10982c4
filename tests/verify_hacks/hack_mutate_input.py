"""Cheat: the kernel overwrites its input x with the result."""

import torch
from axpy_kernels import launch, mutating_kernel


def candidate(x, y):
    return launch(mutating_kernel, x, y, torch.empty_like(x))
