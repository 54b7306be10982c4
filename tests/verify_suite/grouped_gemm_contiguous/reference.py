"""DeepGEMM's m_grouped_fp8_gemm_nt_contiguous (MoE experts, prefill): rows grouped by expert, each group padded
to 128 rows marked -1 in m_indices; row r of D = A[r] @ B[m_indices[r]]^T, padding rows 0."""

import torch
from torch import nn

from deep_gemm.grouped import contiguous_layout
from deep_gemm.reference import cast_tiles

groups, n, k = 2, 128, 128
BLOCK = 128


class Model(nn.Module):
    def forward(self, a, sfa, b, sfb, m_indices):
        a_f = a.float() * sfa.repeat_interleave(BLOCK, dim=1)
        b_f = b.float() * sfb.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
        d = torch.zeros(a.shape[0], b.shape[1])
        for g in range(b.shape[0]):
            rows = m_indices == g
            d[rows] = a_f[rows] @ b_f[g].T
        return d.to(torch.bfloat16)


def get_inputs():
    sizes = torch.randint(BLOCK // 2, BLOCK + 1, (groups,)).tolist()
    m_indices = contiguous_layout(sizes, torch.device("cpu"))
    a, sfa = cast_tiles(torch.randn(m_indices.numel(), k), 1, BLOCK)
    b, sfb = cast_tiles(torch.randn(groups, n, k), BLOCK, BLOCK)
    return [a, sfa, b, sfb, m_indices]


def get_init_inputs():
    return []
