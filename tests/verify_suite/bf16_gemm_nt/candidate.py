"""deep_gemm's Triton bf16 GEMM."""

import torch
from torch import nn

import deep_gemm  # noqa: F401 - registers the op
from accel import registry

ALLOW = {"aten.copy_": "split-K (small M on a GPU) copies the kernel's fp32 partial sums into d"}


class ModelNew(nn.Module):
    def forward(self, a, b):
        d = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        return registry.get("deep_gemm.bf16_gemm_nt").triton(a, b, d)
