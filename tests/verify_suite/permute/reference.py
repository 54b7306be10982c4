"""MoE dispatch permute: each token's row copied once per chosen expert, rows grouped by expert (stable order).

Returns the permuted rows and, for each of them, its (token * topk + slot) source index.
"""

import torch
from torch import nn

tokens, hidden, topk, experts = 40, 64, 2, 8


class Model(nn.Module):
    def __init__(self, topk: int):
        super().__init__()
        self.topk = topk

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor):
        order = torch.argsort(topk_ids.flatten(), stable=True)
        return x[order // self.topk], order


def get_inputs():
    return [torch.randn(tokens, hidden).to(torch.bfloat16), torch.randint(0, experts, (tokens, topk))]


def get_init_inputs():
    return [topk]
