"""Wrong output shape: drops the last column."""

import torch
from axpy_kernels import axpy_kernel, launch


def candidate(x, y):
    return launch(axpy_kernel, x, y, torch.empty_like(x))[:, :-1]
