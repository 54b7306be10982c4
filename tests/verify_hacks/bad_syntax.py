"""Does not compile: a Triton kernel using an undefined name, launched unconditionally."""

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * not_defined_anywhere)  # noqa: F821


def candidate(x, y):
    out = torch.empty_like(x)
    _kernel[(1,)](x, out, BLOCK=1024)
    return out
