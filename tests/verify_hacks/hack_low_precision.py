"""Cheat: does the fp32 problem's arithmetic in fp16 (faster on a GPU, too imprecise)."""

import torch
from axpy_kernels import fp16_kernel, launch


def candidate(x, y):
    return launch(fp16_kernel, x, y, torch.empty_like(x))
