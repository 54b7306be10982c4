"""UE8M0 (power-of-two) scales and the MXFP8 recipe: casts, DeepGEMM's packed SM100 scale layout, the GEMMs
and the FP8 Linear, against float64 math and against the fp32-scale path.

Tolerances, derived rather than tuned:
- e4m3 keeps 3 mantissa bits, so a normal value rounds with relative error <= 2^-4; below 2^-6 (subnormal) the
  grid step is 2^-9, so the absolute error is <= 2^-10 x scale. A power-of-two scale rounded *up* from
  amax/448 lies in [amax/448, 2 amax/448), so no element exceeds 448 (no overflow).
- calc_diff < 1e-3 against the unquantised float64 product is DeepGEMM's own test bound. For Gaussian data the
  expected value is about 6.5e-4 whatever the shape (a product of two e4m3 roundings: mean squared relative
  error ~2 x 2^-6/12 x E[1/mantissa^2] ~ 1.3e-3, and calc_diff ~ half the squared relative error).
- Against float64 arithmetic on the *dequantised* operands, what remains is fp32 accumulation (K <= 384:
  ~1e-12) and the final bf16 rounding of D (relative 2^-9, calc_diff ~ 2^-18 / 3 ~ 1.3e-6): < 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

import deep_gemm
from accel import registry
from deep_gemm import reference
from deep_gemm.utils import ceil_to_ue8m0, unpack_ue8m0


def _interpreter_has_dot_scaled() -> bool:
    from triton.runtime.interpreter import InterpreterBuilder

    return hasattr(InterpreterBuilder, "create_dot_scaled")


# The MXFP8 main loop is tl.dot_scaled, which Triton 3.6's interpreter lacks (no create_dot_scaled; 3.9 has it).
# Under 3.6 its compiled form is still gated for sm_90a and sm_100a by tests/test_kernel_compile.py.
MX_IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not _interpreter_has_dot_scaled(), reason="this Triton's interpreter has no tl.dot_scaled"))]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """Gaussian values with a per-row magnitude spread over a few binades (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen))


def _pow2_up_f64(x: float) -> float:
    """The smallest power of two >= x, in float64 (frexp is exact)."""
    mant, exp = math.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    return math.ldexp(1.0, exp - 1) if mant == 0.5 else math.ldexp(1.0, exp)


def test_ceil_to_ue8m0_matches_float64_math():
    edge = [1.0, 2.0 ** -20, 448.0, 1.0 + 2.0 ** -23, 256.0 * (1 + 2.0 ** -23), 3.0, 1e-4 / 448, 0.75]
    vals = torch.tensor(edge + (torch.rand(500, generator=torch.Generator().manual_seed(1)) * 1e3).tolist())
    got = ceil_to_ue8m0(vals.float())
    assert got.tolist() == [_pow2_up_f64(v) for v in vals.float().double().tolist()]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("gran_k", [128, 32])
def test_ue8m0_cast_bounds(impl, gran_k):
    """Every scale is the power of two at or just above amax/448 (float64), and each element's error stays within
    e4m3's bound: 2^-4 relative (normal) or 2^-10 x scale (subnormal)."""
    x = _randn(65, 256, seed=2)
    x[0, :3] = torch.tensor([124.3, -0.001, 448.0])
    with registry.force(impl):
        q, sf = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=gran_k)
    assert sf.shape == (65, 256 // gran_k)
    amax = x.double().view(65, -1, gran_k).abs().amax(-1).clamp_min(1e-4)
    want = torch.tensor([[_pow2_up_f64(a / 448) for a in row] for row in amax.tolist()], dtype=torch.float64)
    assert torch.equal(sf.double(), want)
    assert q.float().abs().max() <= 448
    deq = (q.double().view(65, -1, gran_k) * sf.double().unsqueeze(-1)).view(65, 256)
    bound = 2.0 ** -4 * x.double().abs() + 2.0 ** -10 * sf.double().repeat_interleave(gran_k, 1)
    assert ((deq - x.double()).abs() <= bound).all()


def test_ue8m0_scales_never_finer_than_fp32_ones():
    """The same tiles with and without use_ue8m0: the UE8M0 scale is the fp32 one rounded up, by less than 2x."""
    x = _randn(130, 384, seed=3)
    for cast in (deep_gemm.per_token_cast_to_fp8, deep_gemm.per_channel_cast_to_fp8, deep_gemm.per_block_cast_to_fp8):
        _, sf = cast(x)
        _, sf2 = cast(x, use_ue8m0=True)
        assert (sf2 >= sf).all() and (sf2 < 2 * sf).all()


def test_packed_layout_is_deepgemm_s():
    """Four exponent bytes per int32 along K (byte j = scale 4i + j), MN-major, MN stride padded to 4."""
    _, sf = deep_gemm.per_token_cast_to_fp8(_randn(6, 640, seed=4), use_ue8m0=True, gran_k=32)  # 20 scales per row
    packed = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    assert packed.dtype == torch.int32 and packed.shape == (6, 5) and packed.stride() == (1, 8)
    for r in range(6):
        for i in range(5):
            word = packed[r, i].item() & 0xFFFFFFFF
            for j in range(4):
                assert (word >> (8 * j)) & 0xFF == math.frexp(sf[r, 4 * i + j].item())[1] - 1 + 127
    assert torch.equal(unpack_ue8m0(packed, 20), sf)
    q, packed2 = deep_gemm.per_token_cast_to_fp8(_randn(6, 640, seed=4), use_ue8m0=True, gran_k=32,
                                                 use_packed_ue8m0=True)
    assert torch.equal(packed2, packed)
    with pytest.raises(ValueError, match="powers of two"):
        deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf * 1.5)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_packed_ue8m0_1x128_gemm_equals_the_fp32_scale_path(impl):
    """DeepGEMM's SM100 blockwise input (packed UE8M0 1x128 scales) gives bit for bit what the same scales as fp32
    give; and a UE8M0-scaled GEMM stays within DeepGEMM's bound of the unquantised product."""
    x, w = _randn(129, 640, seed=5), _randn(256, 640, seed=6)
    xq = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True)
    wq = deep_gemm.per_token_cast_to_fp8(w, use_ue8m0=True)
    d_fp32, d_packed = (torch.full((129, 256), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    with registry.force(impl):
        deep_gemm.fp8_gemm_nt(xq, wq, d_fp32)
        deep_gemm.fp8_gemm_nt((xq[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(xq[1])),
                              (wq[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(wq[1])), d_packed)
    assert torch.equal(d_fp32, d_packed)
    assert deep_gemm.calc_diff(d_fp32, x.double() @ w.double().T) < 1e-3


def _mx(x: torch.Tensor, along: str):
    """MXFP8 operand: 1x32 scales along the last dim (``"k"``) or the first (``"rows"``)."""
    cast = deep_gemm.per_token_cast_to_fp8 if along == "k" else deep_gemm.per_channel_cast_to_fp8
    return cast(x, use_ue8m0=True, gran_k=32)


@pytest.mark.parametrize("impl", MX_IMPLS)
@pytest.mark.parametrize("m,n,k", [(129, 128, 256), (128, 256, 384)])
def test_mxfp8_dense_gemms(impl, m, n, k):
    """Forward (nt), dgrad (nn) and wgrad (tn) with 1x32 UE8M0 scales on both operands, fp32 or packed."""
    x, w, dy = _randn(m, k, seed=7), _randn(n, k, seed=8), _randn(m, n, seed=9)
    with registry.force(impl):
        xq, wq = _mx(x, "k"), _mx(w, "k")
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        deep_gemm.fp8_gemm_nt(xq, wq, d)
        exact = reference.dequantize(*xq).double() @ reference.dequantize(*wq).double().T
        assert deep_gemm.calc_diff(d, exact) < 1e-5
        assert deep_gemm.calc_diff(d, x.double() @ w.double().T) < 1e-3
        packed = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        d2 = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        deep_gemm.fp8_gemm_nt(packed, (wq[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(wq[1])), d2,
                              recipe=(1, 1, 32))
        assert torch.equal(d, d2)  # fp32 and packed UE8M0 scales: the same numbers

        gx = torch.full((m, k), float("nan"))
        deep_gemm.fp8_gemm_nn(_mx(dy, "k"), _mx(w, "rows"), gx)  # W [n, k] read as [k_red = n, k]: 32x1 along n
        assert deep_gemm.calc_diff(gx, dy.double() @ w.double()) < 1e-3
        if m % 128 == 0:  # the wgrad reduces over tokens: a multiple of 128 (the linear layer pads)
            gw = torch.full((n, k), float("nan"))
            deep_gemm.fp8_gemm_tn(_mx(dy, "rows"), _mx(x, "rows"), gw)
            assert deep_gemm.calc_diff(gw, dy.double().T @ x.double()) < 1e-3


@pytest.mark.parametrize("impl", MX_IMPLS)
def test_mxfp8_grouped_gemms(impl):
    """MoE experts: m-grouped contiguous (forward) and k-grouped (weight gradient) with 1x32 / 32x1 scales."""
    groups, n, k = 2, 128, 256
    m_indices = torch.tensor([0] * 128 + [-1] * 64 + [1] * 64, dtype=torch.int32)
    x, w = _randn(256, k, seed=10), _randn(groups, n, k, seed=11)
    with registry.force(impl):
        d = torch.full((256, n), float("nan"), dtype=torch.bfloat16)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(_mx(x, "k"), _mx(w, "k"), d, m_indices)
        for g in range(groups):
            rows = m_indices == g
            assert deep_gemm.calc_diff(d[rows], x[rows].double() @ w[g].double().T) < 1e-3
        assert d[m_indices == -1].isnan().all()  # padding rows untouched
        a, b = _randn(256, 128, seed=12), _randn(256, 256, seed=13)
        dw = torch.full((2, 128, 256), float("nan"))
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(_mx(a, "rows"), _mx(b, "rows"), dw, [128, 128])
        for g in range(2):
            sl = slice(128 * g, 128 * (g + 1))
            assert deep_gemm.calc_diff(dw[g], a[sl].double().T @ b[sl].double()) < 1e-3


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_mxfp8_linear_against_float64_and_blockwise(fp8_cache):
    """Fp8Linear("mxfp8"): output, input gradient and weight gradient within DeepGEMM's bound of float64 math,
    as the blockwise recipe is, and not equal to it (a different quantisation really ran)."""
    x0, w0, g0 = _randn(200, 320, seed=14), _randn(192, 320, seed=15) * 0.05, _randn(200, 192, seed=16)
    want_y = x0.double() @ w0.double().T
    results = {}
    for recipe in ("blockwise", "mxfp8"):
        layer = deep_gemm.Fp8Linear(320, 192, bias=False, fp8=recipe, fp8_cache=fp8_cache)
        with torch.no_grad():
            layer.weight.copy_(w0)
        x = x0.clone().requires_grad_(True)
        y = layer(x)
        y.backward(g0)
        assert deep_gemm.calc_diff(y, want_y) < 1e-3
        assert deep_gemm.calc_diff(x.grad, g0.double() @ w0.double()) < 1e-3
        assert deep_gemm.calc_diff(layer.weight.grad, g0.double().T @ x0.double()) < 1e-3
        results[recipe] = y.detach()
    assert not torch.equal(results["blockwise"], results["mxfp8"])


def test_mxfp8_grouped_linear_against_float64():
    groups, n, k = 2, 128, 256
    m_indices = torch.tensor([0] * 128 + [1] * 100 + [-1] * 28, dtype=torch.int32)
    layer = deep_gemm.GroupedLinear(groups, k, n, fp8="mxfp8")
    x = _randn(256, k, seed=17).requires_grad_(True)
    y = layer(x, m_indices)
    g = _randn(256, n, seed=18)
    y.backward(g)
    valid = m_indices >= 0
    w = layer.weight.detach().double()
    want = torch.stack([x[r].detach().double() @ w[i].T for r, i in enumerate(m_indices.clamp_min(0).tolist())])
    assert deep_gemm.calc_diff(y[valid], want[valid]) < 1e-3 and (y[~valid] == 0).all()
    want_dx = torch.stack([g[r].double() @ w[i] for r, i in enumerate(m_indices.clamp_min(0).tolist())])
    assert deep_gemm.calc_diff(x.grad[valid], want_dx[valid]) < 1e-3
    for e in range(groups):
        rows = m_indices == e
        assert deep_gemm.calc_diff(layer.weight.grad[e], g[rows].double().T @ x[rows].detach().double()) < 1e-3


def test_bad_mx_input_is_a_one_line_error():
    x = _randn(64, 256, seed=19)
    xq, wq = _mx(x, "k"), _mx(_randn(128, 256, seed=20), "k")
    d = torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="both be MXFP8"):
        deep_gemm.fp8_gemm_nt(xq, deep_gemm.per_block_cast_to_fp8(_randn(128, 256, seed=21)), d)
    with pytest.raises(ValueError, match="powers of two"):
        deep_gemm.fp8_gemm_nt((xq[0], xq[1] * 1.5), wq, d)
    with pytest.raises(ValueError, match="use_ue8m0=True"):
        deep_gemm.per_token_cast_to_fp8(x, gran_k=32)
    with pytest.raises(ValueError, match="gran_k"):
        deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=64)
    with pytest.raises(ValueError, match="fp8 must be"):
        deep_gemm.Fp8Linear(256, 128, fp8="fp4")
    with pytest.raises(ValueError, match="recipe"):
        deep_gemm.fp8_gemm_nt(xq, wq, d, recipe=(1, 1, 64))
    bad = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(xq[1]).clone()
    bad[3, 1] = 0  # exponent byte 0: a zero scale
    with pytest.raises(ValueError, match="1..254"):
        deep_gemm.fp8_gemm_nt((xq[0], bad), (wq[0], deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(wq[1])),
                              d, recipe=(1, 1, 32))
