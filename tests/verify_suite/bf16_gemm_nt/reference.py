"""DeepGEMM's bf16_gemm_nt: D = A @ B^T, bf16 in and out, fp32 accumulation. Vendor path: torch.matmul (cuBLAS)."""

import torch
from torch import nn

m, n, k = 64, 128, 128


class Model(nn.Module):
    def forward(self, a, b):
        return (a.float() @ b.float().T).to(torch.bfloat16)


class ModelVendor(nn.Module):
    def forward(self, a, b):
        return a @ b.T


def get_inputs():
    return [torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)]


def get_init_inputs():
    return []
