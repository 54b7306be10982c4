"""deep_gemm's Triton cast kernel (amax, scale, round onto the e4m3 grid in one pass)."""

from torch import nn

import deep_gemm  # noqa: F401 - registers the op
from accel import registry


class ModelNew(nn.Module):
    def forward(self, x):
        return registry.get("deep_gemm.per_token_cast_to_fp8").triton(x)
