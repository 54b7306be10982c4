"""Dense deep_gemm GEMMs: Triton kernel (CPU interpreter) vs the unquantized fp32 product and vs the reference.

Tolerances: calc_diff against the fp32 product of the *unquantized* inputs below
``tests.tolerances.fp8_calc_diff_bound(2, k, outputs)``: two e4m3 casts (3-bit mantissa: relative rounding
variance <= 2^-8 / 3 each), half their summed variance, independent of K for random-sign inputs, with room for
the finite sample (1.3e-3 to 2.3e-3 on these shapes; DeepGEMM's own rule, 1e-3, is the Gaussian-input case,
7e-4, of the same formula; measured ~2e-4 here); and < 1e-5 between kernel and reference on the same FP8
inputs (only fp32 summation order and the final bf16 rounding differ).
"""

import pytest
import torch

import deep_gemm
from accel import registry
from deep_gemm import calc_diff
from tests.tolerances import fp8_calc_diff_bound

SAME_INPUT_TOL = 1e-5

# M in {1, 64, 129, 256}; N, K multiples of 128 up to 256 (the interpreter's budget).
SHAPES = [(1, 128, 256), (64, 256, 128), (129, 128, 256), (256, 256, 256)]


def _inputs(m: int, n: int, k: int):
    # Rows with different magnitudes, so per-row and per-block scales matter.
    a = torch.randn(m, k) * torch.exp(torch.randn(m, 1))
    b = torch.randn(n, k) * torch.exp(torch.randn(n, 1) * 0.5)
    return a.bfloat16().float(), b.bfloat16().float()


def _operands(kind: str, a: torch.Tensor, b: torch.Tensor, sfb_per_row: bool = False):
    """FP8 operands in the layout of ``kind`` (a: [m, k] logical, b: [n, k] logical)."""
    if kind == "nt":
        b_op = deep_gemm.per_token_cast_to_fp8(b) if sfb_per_row else deep_gemm.per_block_cast_to_fp8(b)
        return deep_gemm.per_token_cast_to_fp8(a), b_op
    if kind == "nn":
        return deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b.T.contiguous())
    if kind == "tt":
        return deep_gemm.per_channel_cast_to_fp8(a.T.contiguous()), deep_gemm.per_block_cast_to_fp8(b)
    return deep_gemm.per_channel_cast_to_fp8(a.T.contiguous()), deep_gemm.per_channel_cast_to_fp8(b.T.contiguous())


def _poisoned(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("kind", ["nt", "nn", "tn"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemm_matches_fp32_product(kind, m, n, k):
    a, b = _inputs(m, n, k)
    a_op, b_op = _operands(kind, a, b)
    fn = getattr(deep_gemm, f"fp8_gemm_{kind}")
    d = _poisoned(m, n)
    with registry.force("triton"):
        out = fn(a_op, b_op, d)
    assert out is d and not torch.isnan(d).any()
    assert registry.get(f"deep_gemm.fp8_gemm_{kind}").last_impl == "triton"
    assert calc_diff(d, a @ b.T) < fp8_calc_diff_bound(2, k, d.numel())
    d_ref = fn(a_op, b_op, _poisoned(m, n))  # suite default: the reference
    assert calc_diff(d, d_ref) < SAME_INPUT_TOL


@pytest.mark.parametrize("m,n,k", [(129, 256, 128)])
def test_fp8_gemm_tt(m, n, k):
    a, b = _inputs(m, n, k)
    a_op, b_op = _operands("tt", a, b)
    d = _poisoned(m, n)
    with registry.force("triton"):
        deep_gemm.fp8_gemm_tt(a_op, b_op, d)
    assert calc_diff(d, a @ b.T) < fp8_calc_diff_bound(2, k, d.numel())
    assert calc_diff(d, deep_gemm.fp8_gemm_tt(a_op, b_op, _poisoned(m, n))) < SAME_INPUT_TOL


@pytest.mark.parametrize("kind", ["nt", "nn", "tn", "tt"])
@pytest.mark.parametrize("m,n,k", [(1, 128, 192), (129, 256, 128)])
def test_bf16_gemm_matches_fp32_product(kind, m, n, k):
    a, b = _inputs(m, n, k)
    a_op = a.bfloat16() if kind[0] == "n" else a.T.contiguous().bfloat16()
    b_op = b.bfloat16() if kind[1] == "t" else b.T.contiguous().bfloat16()
    d = _poisoned(m, n)
    with registry.force("triton"):
        getattr(deep_gemm, f"bf16_gemm_{kind}")(a_op, b_op, d)
    # bf16 inputs are exact; fp32 accumulation; only the bf16 output rounding (2^-9 relative) remains.
    assert calc_diff(d, a @ b.T) < SAME_INPUT_TOL


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_accumulate_into_c_and_in_place(impl):
    m, n, k = 64, 128, 256
    a, b = _inputs(m, n, k)
    a_op, b_op = _operands("nt", a, b)
    c = torch.randn(m, n) * 8
    with registry.force(impl):
        d = deep_gemm.fp8_gemm_nt(a_op, b_op, _poisoned(m, n, dtype=torch.float32), c=c)
        in_place = c.clone()
        deep_gemm.fp8_gemm_nt(a_op, b_op, in_place, c=in_place)  # DeepGEMM's d is c accumulation
    want = a @ b.T + c
    assert calc_diff(d, want) < fp8_calc_diff_bound(2, k, d.numel())
    torch.testing.assert_close(in_place, d, rtol=0, atol=0)


def test_per_row_b_scales_and_mn_major_scale_views():
    # B scaled per 1x128 tile (the 1D1D recipe) and scales passed as MN-major TMA-aligned views.
    m, n, k = 129, 128, 256
    a, b = _inputs(m, n, k)
    (a_q, sfa), (b_q, sfb) = _operands("nt", a, b, sfb_per_row=True)
    sfa_mn = deep_gemm.get_mn_major_tma_aligned_tensor(sfa)
    assert sfa_mn.stride(0) == 1 and torch.equal(sfa_mn, sfa)
    d = _poisoned(m, n)
    with registry.force("triton"):
        deep_gemm.fp8_gemm_nt((a_q, sfa_mn), (b_q, sfb), d)
    assert calc_diff(d, a @ b.T) < fp8_calc_diff_bound(2, k, d.numel())
    assert calc_diff(d, deep_gemm.fp8_gemm_nt((a_q, sfa), (b_q, sfb), _poisoned(m, n))) < SAME_INPUT_TOL


@pytest.mark.parametrize("fp8", [True, False])
def test_split_k_partial_sums(fp8):
    # Small-M problems split K across programs that add fp32 partials atomically (forced here: the
    # heuristic only splits on a GPU with idle SMs). With an accumulator c, and a ragged last slice.
    from deep_gemm.kernels.gemm import gemm_nt

    m, n, k = 64, 128, 640  # 5 K blocks over 3 slices: 2 + 2 + 1
    a, b = _inputs(m, n, k)
    c = torch.randn(m, n)
    d = _poisoned(m, n, dtype=torch.float32)
    if fp8:
        (a_q, sfa), (b_q, sfb) = _operands("nt", a, b)
        gemm_nt((a_q, sfa), (b_q, sfb), d, c, split_k=3)
        want = deep_gemm.fp8_gemm_nt((a_q, sfa), (b_q, sfb), _poisoned(m, n, dtype=torch.float32), c=c)
    else:
        gemm_nt(a.bfloat16(), b.bfloat16(), d, c, split_k=3)
        want = a @ b.T + c
    assert calc_diff(d, want) < SAME_INPUT_TOL


def test_mn_major_tma_aligned_tensor_3d():
    sf = torch.randn(3, 130, 4)
    out = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
    assert torch.equal(out, sf) and out.stride()[1:] == (1, 132)  # MN-major, MN padded to 16 bytes
    assert deep_gemm.get_mn_major_tma_aligned_tensor(out) is out  # already aligned: returned as is


def test_zero_k_gives_zero_or_c():
    a_op = (torch.empty(8, 0, dtype=torch.float8_e4m3fn), torch.empty(8, 0))
    b_op = (torch.empty(128, 0, dtype=torch.float8_e4m3fn), torch.empty(1, 0))
    d = deep_gemm.fp8_gemm_nt(a_op, b_op, _poisoned(8, 128))
    assert torch.all(d == 0)


def test_v1_alias_and_helpers(monkeypatch):
    monkeypatch.setattr(deep_gemm.utils, "_num_sms", None)  # restored after the test
    assert deep_gemm.gemm_fp8_fp8_bf16_nt is deep_gemm.fp8_gemm_nt
    assert deep_gemm.get_m_alignment_for_contiguous_layout() == 128
    assert deep_gemm.get_num_sms() >= 1
    deep_gemm.set_num_sms(1)
    assert deep_gemm.get_num_sms() == 1
    with pytest.raises(ValueError, match="num_sms"):
        deep_gemm.set_num_sms(0)
    x, y = torch.randn(100), torch.randn(100)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    want = 1 - 2 * (x.double() * y.double()).sum() / (x.double() ** 2 + y.double() ** 2).sum()
    assert calc_diff(x, y) == pytest.approx(float(want), rel=1e-12)


def test_every_op_has_a_triton_kernel_and_interpreter_sized_verify_shapes():
    ops = [name for name in registry.ops() if name.startswith("deep_gemm.")]
    aliases = {"gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
               "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "fp8_m_grouped_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked"}
    layout_helpers = {"kv_cache_cast_to_fp8",  # builds the paged indexer cache in PyTorch, as DeepGEMM's test util
                      "takes_precast", "reads_only_precast"}  # predicates on a recipe, not kernels
    public = [n for n in deep_gemm.__all__
              if ("cast" in n or "gemm" in n or "mqa_logits" in n) and n not in aliases | layout_helpers]
    assert sorted(ops) == sorted(f"deep_gemm.{n}" for n in public)
    for name in ops:
        op = registry.get(name)
        assert op.triton is not None and op.verify is not None, name
        assert op.verify.shapes and op.verify.bench_shapes, name
        for shape in op.verify.shapes:
            assert all(v <= 256 for key, v in shape.items() if key in ("m", "n", "k")), (name, shape)
            case = op.verify.make_case(shape, 0, torch.device("cpu"))
            # GEMMs write d in place; casts and logits return new tensors
            assert case.outputs or "gemm" not in name.split(".")[1], name
