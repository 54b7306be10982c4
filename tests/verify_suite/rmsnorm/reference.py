"""RMSNorm (DeepSeek-V3's norms): y = x / sqrt(mean(x^2) + eps) * weight, in fp32, cast back to bf16."""

import torch
from torch import nn

tokens, dim = 48, 320
EPS = 1e-6


class Model(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def get_inputs():
    return [torch.randn(tokens, dim).to(torch.bfloat16)]


def get_init_inputs():
    return [dim, EPS]
