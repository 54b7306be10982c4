"""SwiGLU (the MoE experts' activation): silu(gate) * up on the [gate | up] halves of a bf16 row."""

import torch
import torch.nn.functional as F
from torch import nn

tokens, inter = 40, 96


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)


def get_inputs():
    return [torch.randn(tokens, 2 * inter).to(torch.bfloat16)]


def get_init_inputs():
    return []
