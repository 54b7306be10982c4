"""fused_ops' compiled kernels on a real GPU at DeepSeek-V3 shapes (skipped without a GPU).

The FP8 outputs must be bit-equal to DeepGEMM's cast of the stored output at the real sizes, compiled (the
GPU's own fp32 -> e4m3 and fp32 -> bf16 conversions after our grid rounding). Every op's agreement with its
reference at the bench shapes is the gpu_check verify step's (``verify_kernels --bench-shapes``, strict).
"""

import pytest
import torch

import accel
from accel import registry
from deep_gemm.reference import per_token_cast_reference
from fused_ops import grouping, permute, rmsnorm, swiglu, swiglu_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_fp8_outputs_are_deep_gemms_cast_of_the_output():
    dev = accel.default_device()
    x, r = (torch.randn(4096, 7168, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(7168, device=dev, dtype=torch.bfloat16) + 0.5
    gu = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16) * 3
    rw = torch.rand(8192, device=dev)
    indices = torch.rand(4096, 256, device=dev).topk(8, dim=-1).indices
    layout = grouping(indices, 256, 128)
    with registry.force("triton"):
        y, _, (q, sf) = rmsnorm(x, w, r, fp8=True)
        q2, sf2 = swiglu_fp8(gu, rw)
        out = swiglu(gu, rw)
        q3, sf3, _ = permute(x, layout, fp8=True)
        grouped, _, _ = permute(x, layout)
    for (values, scales), source in (((q, sf), y), ((q2, sf2), out), ((q3, sf3), grouped)):
        want_q, want_sf = per_token_cast_reference(source)
        assert torch.equal(values.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales, want_sf)
