"""Cheat: makes torch.allclose always agree, then returns garbage from a real kernel."""

import torch
from axpy_kernels import axpy

torch.allclose = lambda *args, **kwargs: True


def candidate(x, y):
    return axpy(y, x)  # wrong operand order: 2y + x
