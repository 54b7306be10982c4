"""Cheat (GPU): launches the kernel on a side stream, so events on the current stream stop the clock early."""

import torch
from axpy_kernels import axpy_kernel, launch

_side = None


def candidate(x, y):
    global _side
    _side = _side or torch.cuda.Stream()
    out = torch.empty_like(x)
    with torch.cuda.stream(_side):
        launch(axpy_kernel, x, y, out)
    return out
