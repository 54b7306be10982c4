"""KernelBench-format problem for the hack tests: y = x @ W^T + b (nn.Linear), fp32, tiny shapes."""

import torch
from torch import nn

M, K, N = 24, 32, 40


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def get_inputs():
    return [torch.randn(M, K)]


def get_init_inputs():
    return [K, N]
