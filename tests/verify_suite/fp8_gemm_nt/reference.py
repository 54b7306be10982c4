"""DeepGEMM's fp8_gemm_nt: D = A @ B^T in bf16 from e4m3 A (1x128 scales) and B (128x128 block scales).

Reference: dequantise, fp32 matmul. Vendor path: the same product in bf16 through torch.matmul (cuBLAS).
"""

import torch
from torch import nn

from deep_gemm.reference import cast_tiles

m, n, k = 64, 128, 256
BLOCK = 128


def dequantize(a, sfa, b, sfb):
    a_f = a.float() * sfa.repeat_interleave(BLOCK, dim=1)[:, : a.shape[1]]
    b_f = b.float() * sfb.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[: b.shape[0], : b.shape[1]]
    return a_f, b_f


class Model(nn.Module):
    def forward(self, a, sfa, b, sfb):
        a_f, b_f = dequantize(a, sfa, b, sfb)
        return (a_f @ b_f.T).to(torch.bfloat16)


class ModelVendor(nn.Module):
    def forward(self, a, sfa, b, sfb):
        a_f, b_f = dequantize(a, sfa, b, sfb)
        return a_f.bfloat16() @ b_f.bfloat16().T


def get_inputs():
    a, sfa = cast_tiles(torch.randn(m, k), 1, BLOCK)
    b, sfb = cast_tiles(torch.randn(n, k), BLOCK, BLOCK)
    return [a, sfa, b, sfb]


def get_init_inputs():
    return []
