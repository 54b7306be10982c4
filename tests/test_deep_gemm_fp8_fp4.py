"""``deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous``: FP8 activations x MXFP4 weights (DeepSeek-V4's expert GEMM).

References: a float64 product of the dequantised operands (independent of both the reference op and the kernel);
the Triton kernel in the interpreter against it. Every product of an e4m3 value, an e2m1 value and two powers of
two is an fp32 number, so the only error is summation: fp32 order over K (<= K u sum|terms|, u = 2^-24), with
blockwise rows (an fp32 scale per 1x128) one rounding more per term (the scale times the step's sum), and the
bf16 rounding of the output (half an ulp: 2^-8 relative, 7 stored mantissa bits):
|d - ref| <= 2^-8 |ref| + (K + 1) u sum|a||b| elementwise."""

from __future__ import annotations

import pytest
import torch
import triton

from accel import registry
from deep_gemm import m_grouped_fp8_fp4_gemm_nt_contiguous, per_token_cast_to_fp8
from deep_gemm.fp8_fp4 import _dequant_rows, cast_mxfp8_rows
from deep_gemm.grouped import contiguous_layout
from deep_gemm.kernels import fp8_fp4
from deep_gemm.mxfp4 import pack_mxfp4, unpack_mxfp4
from deep_gemm.utils import dot_scaled_interpreter_gap


def _case(sizes, n, k, seed, rows_fp32=False):
    g = torch.Generator().manual_seed(seed)
    m_indices = contiguous_layout(sizes, torch.device("cpu"))
    x = torch.randn(m_indices.numel(), k, generator=g) * 10.0 ** torch.randint(-3, 3, (m_indices.numel(), 1),
                                                                               generator=g)
    w = torch.randn(len(sizes), n, k, generator=g) * 0.02
    return (per_token_cast_to_fp8(x) if rows_fp32 else cast_mxfp8_rows(x)), pack_mxfp4(w), m_indices


def _float64(a, b, m_indices):
    x = _dequant_rows(*a).double()
    out = torch.zeros(x.shape[0], b[0].shape[1], dtype=torch.float64)
    mag = torch.zeros_like(out)
    for g in range(b[0].shape[0]):
        rows = m_indices == g
        w = unpack_mxfp4(b[0][g], b[1][g], dtype=torch.float32).double()
        out[rows] = x[rows] @ w.T
        mag[rows] = x[rows].abs() @ w.abs().T
    return out, mag


@pytest.mark.parametrize("rows_fp32", [False, True])
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("sizes,n,k", [([100, 0, 37], 40, 128), ([128, 20], 72, 256)])
def test_equals_float64_product_of_the_dequantised_operands(impl, sizes, n, k, rows_fp32, monkeypatch):
    """``rows_fp32``: the rows cast by DeepSeek-V3's blockwise recipe (fp32 scale per 1x128), whose scale multiplies
    each 128-wide step's fp32 sum: one more rounding per step, within the bound's K + 1 roundings per term."""
    if impl == "triton":
        if dot_scaled_interpreter_gap():
            pytest.skip(dot_scaled_interpreter_gap())
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, b, m_indices = _case(sizes, n, k, seed=k + n, rows_fp32=rows_fp32)
    d = torch.full((m_indices.numel(), n), float("nan"), dtype=torch.bfloat16)
    before = registry.reference_call_count("deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous")
    with registry.force(impl):
        m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices)
    ran_reference = registry.reference_call_count("deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous") > before
    assert ran_reference == (impl == "reference")  # the kernel itself ran in the interpreter
    ref, mag = _float64(a, b, m_indices)
    rows = m_indices >= 0
    bound = 2.0**-8 * ref.abs() + (k + 1) * 2.0**-24 * mag
    assert ((d[rows].double() - ref[rows]).abs() <= bound[rows]).all()
    assert torch.isnan(d[~rows]).all()  # padding rows untouched (poisoned before)


def test_unscaled_lhs_equals_the_unit_scale_tensor(monkeypatch):
    """Where a Triton cannot compile sm_100a's unit-scale tensor (``fp8_fp4.lhs_unscaled``) the fp32-rows kernel
    passes no lhs scale: the same unit scale, so both forms give the same bits (run here in the interpreter)."""
    if dot_scaled_interpreter_gap():
        pytest.skip(dot_scaled_interpreter_gap())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (x, sa), (w, sb), m_indices = _case([100, 0, 37], 40, 256, seed=3, rows_fp32=True)
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    outs = []
    for unscaled in (False, True):
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        grid = (triton.cdiv(m, 128), triton.cdiv(n, 32))
        fp8_fp4.fp8_fp4_contiguous_kernel[grid](x, sa, w.view(torch.uint8), sb.view(torch.uint8), d, m_indices, m, n,
                                                k, INTERPRETED=True, A_FP32=True, BLOCK_M=128, BLOCK_N=32,
                                                BLOCK_K=fp8_fp4.BLOCK_K, A_UNSCALED=unscaled)
        outs.append(d)
    rows = m_indices >= 0
    assert not torch.isnan(outs[0][rows]).any()
    assert torch.equal(outs[0][rows], outs[1][rows])


def test_bad_operands_are_one_line_errors():
    a, b, m_indices = _case([128], 32, 128, seed=0)
    d = torch.empty(128, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: expected float8_e4m3fn \[M, K\] with K a multiple of 128"):
        m_grouped_fp8_fp4_gemm_nt_contiguous((a[0][:, :96], a[1][:, :3]), b, d, m_indices)
    with pytest.raises(ValueError, match=r"b: expected MXFP4 int8 \[G, N, 64\]"):
        m_grouped_fp8_fp4_gemm_nt_contiguous(a, (b[0].float(), b[1]), d, m_indices)
    with pytest.raises(ValueError, match="d: expected bfloat16/float32"):
        m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d[:, :8], m_indices)
    with pytest.raises(ValueError, match=r"a's scales: expected uint8/float8_e8m0fnu \[128, 4\] \(MXFP8, 1x32\) or "
                                         r"float32 \[128, 1\] \(1x128\), got torch.float32 \(128, 4\)"):
        m_grouped_fp8_fp4_gemm_nt_contiguous((a[0], a[1].float()), b, d, m_indices)
