"""MoE combine (unpermute): each token sums its experts' output rows weighted by its routing weights (fp32)."""

import torch
from torch import nn

tokens, hidden, topk, experts = 40, 64, 2, 8


class Model(nn.Module):
    def __init__(self, topk: int):
        super().__init__()
        self.topk = topk

    def forward(self, y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = torch.empty_like(order)
        rows[order] = torch.arange(order.numel(), device=order.device)
        return (y[rows].view(-1, self.topk, y.shape[1]) * weights[..., None]).sum(1)


def get_inputs():
    order = torch.argsort(torch.randint(0, experts, (tokens * topk,)), stable=True)
    return [torch.randn(tokens * topk, hidden), order, torch.rand(tokens, topk)]


def get_init_inputs():
    return [topk]
