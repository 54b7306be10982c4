"""Rotary embedding as DeepSeek-V3 applies it: interleaved (even, odd) pairs rotated by position * theta^(-2i/d)."""

import torch
from torch import nn

batch, seq, heads, rope_dim = 2, 8, 4, 64
THETA = 10000.0


class Model(nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)


def get_inputs():
    inv_freq = THETA ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return [torch.randn(batch, seq, heads, rope_dim), angles.cos(), angles.sin()]


def get_init_inputs():
    return []
