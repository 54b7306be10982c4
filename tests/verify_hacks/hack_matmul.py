"""Cheat: PyTorch's own matmul (cuBLAS on a GPU) instead of a kernel."""

import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.matmul(x, self.linear.weight.T) + self.linear.bias
