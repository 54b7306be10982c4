"""DeepSeek-V3's MoE gate: sigmoid scores, + bias for selection only, group-limited top-k, weights x route_scale.

Scaled down: 16 experts in 4 groups, top-2 groups, top-4 experts (the model: 256 in 8, top-4, top-8).
"""

import torch
from torch import nn

tokens, experts = 8, 16
GROUPS, TOPK_GROUPS, TOPK, ROUTE_SCALE = 4, 2, 4, 2.5


class Model(nn.Module):
    def __init__(self, experts: int, groups: int, topk_groups: int, topk: int, route_scale: float):
        super().__init__()
        self.groups, self.topk_groups, self.topk, self.route_scale = groups, topk_groups, topk, route_scale
        self.register_buffer("bias", 0.1 * torch.randn(experts))

    def forward(self, logits: torch.Tensor):
        scores = logits.float().sigmoid()
        biased = scores + self.bias
        grouped = biased.view(logits.shape[0], self.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
        masked = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        indices = masked.topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        return weights / weights.sum(-1, keepdim=True) * self.route_scale, indices


def get_inputs():
    return [torch.randn(tokens, experts)]


def get_init_inputs():
    return [experts, GROUPS, TOPK_GROUPS, TOPK, ROUTE_SCALE]
