"""Cheat: tries a broken kernel and, when it raises, quietly falls back to PyTorch."""

import torch
import triton
import triton.language as tl


@triton.jit
def _broken(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * undefined_name)  # noqa: F821 - fails to compile


def candidate(x, y):
    out = torch.empty_like(x)
    try:
        _broken[(1,)](x, out, x.numel(), BLOCK=128)
    except Exception:
        return 2 * x + y
    return out
