"""Cheat: the kernel hard-codes the problem's default size (one program, 24 x 40 elements), so other shapes break."""

import torch
import triton
import triton.language as tl


@triton.jit
def _fixed(x_ptr, y_ptr, out_ptr):
    offs = tl.arange(0, 1024)
    mask = offs < 960  # 24 * 40, the default shape, instead of the runtime size
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def candidate(x, y):
    out = torch.empty_like(x)
    _fixed[(1,)](x, y, out)
    return out
