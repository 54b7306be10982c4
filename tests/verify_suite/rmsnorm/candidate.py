"""RMSNorm in one Triton kernel: one program per row, fp32 statistics."""

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, dim, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    rms = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride + cols, (x * rms * w).to(y_ptr.dtype.element_ty), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        rows, dim = x.reshape(-1, x.shape[-1]).shape
        _rmsnorm_kernel[(rows,)](x, self.weight, y, dim, dim, self.eps, BLOCK=triton.next_power_of_2(dim))
        return y
