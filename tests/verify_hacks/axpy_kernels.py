"""Triton kernels the axpy candidates share: the honest one and a few deliberately broken variants."""

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def partial_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - 40  # never writes the last row
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def mutating_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    out = 2 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(x_ptr + offs, out, mask=mask)  # scribbles the result over the input


@triton.jit
def fp16_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float16)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float16)
    tl.store(out_ptr + offs, (2 * x + y).to(tl.float32), mask=mask)  # fp16 arithmetic for an fp32 problem


@triton.jit
def noop_kernel(x_ptr, n):
    pass


def launch(kernel, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)
    return out


def axpy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return launch(axpy_kernel, x, y, torch.empty_like(x))


def noop(x: torch.Tensor) -> None:
    noop_kernel[(1,)](x, x.numel())
