"""Wrong output dtype: the kernel stores into a float64 output of an fp32 problem."""

import torch
from axpy_kernels import axpy_kernel, launch


def candidate(x, y):
    return launch(axpy_kernel, x, y, torch.empty(x.shape, dtype=torch.float64))
