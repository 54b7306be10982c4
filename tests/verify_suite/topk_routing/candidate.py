"""The group-limited top-k gate in one Triton kernel: a program per token, the expert row in registers."""

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _gate_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, route_scale, E: tl.constexpr, G: tl.constexpr,
                 TOPK_GROUPS: tl.constexpr, TOPK: tl.constexpr):
    t = tl.program_id(0)
    PER: tl.constexpr = E // G
    g = tl.arange(0, G)[:, None]
    j = tl.arange(0, PER)[None, :]
    expert = g * PER + j
    scores = tl.sigmoid(tl.load(logits_ptr + t * E + expert).to(tl.float32))
    biased = scores + tl.load(bias_ptr + expert)
    # group score: sum of each group's two largest biased scores
    first = tl.max(biased, axis=1)
    first_at = tl.argmax(biased, axis=1)
    second = tl.max(tl.where(j == first_at[:, None], float("-inf"), biased), axis=1)
    group_score = first + second
    keep = tl.zeros([G], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.argmax(group_score, axis=0)
        keep = keep | (tl.arange(0, G) == best)
        group_score = tl.where(tl.arange(0, G) == best, float("-inf"), group_score)
    masked = tl.where(keep[:, None], biased, float("-inf"))
    k = tl.arange(0, TOPK)
    weights = tl.zeros([TOPK], dtype=tl.float32)
    indices = tl.zeros([TOPK], dtype=tl.int64)
    for i in tl.static_range(TOPK):
        flat_best = tl.argmax(tl.reshape(masked, [E]), axis=0)
        chosen = expert == flat_best
        weights = tl.where(k == i, tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=1), axis=0), weights)
        indices = tl.where(k == i, flat_best.to(tl.int64), indices)
        masked = tl.where(chosen, float("-inf"), masked)
    tl.store(w_ptr + t * TOPK + k, weights / tl.sum(weights, axis=0) * route_scale)
    tl.store(idx_ptr + t * TOPK + k, indices)


class ModelNew(nn.Module):
    def __init__(self, experts: int, groups: int, topk_groups: int, topk: int, route_scale: float):
        super().__init__()
        self.groups, self.topk_groups, self.topk, self.route_scale = groups, topk_groups, topk, route_scale
        self.register_buffer("bias", 0.1 * torch.randn(experts))

    def forward(self, logits: torch.Tensor):
        logits = logits.contiguous()
        tokens, experts = logits.shape
        weights = torch.empty(tokens, self.topk, dtype=torch.float32, device=logits.device)
        indices = torch.empty(tokens, self.topk, dtype=torch.int64, device=logits.device)
        _gate_kernel[(tokens,)](logits, self.bias, weights, indices, self.route_scale, E=experts, G=self.groups,
                                TOPK_GROUPS=self.topk_groups, TOPK=self.topk)
        return weights, indices
