"""Cheat: a real Triton linear, followed by PyTorch's softmax-based trick (x = log(softmax) + logsumexp)."""

import torch
from matmul_good import linear
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        y = linear(x, self.linear.weight, self.linear.bias)
        return torch.log(torch.softmax(y, dim=-1)) + torch.logsumexp(y, dim=-1, keepdim=True)
