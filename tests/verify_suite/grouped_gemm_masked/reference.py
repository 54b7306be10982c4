"""DeepGEMM's m_grouped_fp8_gemm_nt_masked (MoE experts, decode): group g computes its first masked_m[g] rows
of A [G, m_max, k]; the other rows of D are 0."""

import torch
from torch import nn

from deep_gemm.reference import cast_tiles

groups, m_max, n, k = 2, 64, 128, 128
BLOCK = 128


class Model(nn.Module):
    def forward(self, a, sfa, b, sfb, masked_m):
        a_f = a.float() * sfa.repeat_interleave(BLOCK, dim=2)
        b_f = b.float() * sfb.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
        d = torch.zeros(a.shape[0], a.shape[1], b.shape[1])
        for g, rows in enumerate(masked_m.tolist()):
            d[g, :rows] = a_f[g, :rows] @ b_f[g].T
        return d.to(torch.bfloat16)


def get_inputs():
    a, sfa = cast_tiles(torch.randn(groups, m_max, k), 1, BLOCK)
    b, sfb = cast_tiles(torch.randn(groups, n, k), BLOCK, BLOCK)
    return [a, sfa, b, sfb, torch.randint(0, m_max + 1, (groups,), dtype=torch.int32)]


def get_init_inputs():
    return []
