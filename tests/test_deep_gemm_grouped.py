"""Grouped deep_gemm GEMMs (Triton, CPU interpreter) against a per-group loop of the dense op.

Tolerances: < 1e-5 calc_diff against the dense op on the same FP8 inputs (fp32 summation order and
bf16 output rounding only); against the fp32 product of the unquantized inputs below
``tests.tolerances.fp8_calc_diff_bound(2, K, outputs)`` (two e4m3 casts, derived there; DeepGEMM's 1e-3 is its
Gaussian-input case).
Outputs start as NaN: rows the op must skip have to stay NaN.
"""

import pytest
import torch

import deep_gemm
from accel import registry
from deep_gemm import calc_diff
from deep_gemm.grouped import contiguous_layout
from tests.tolerances import fp8_calc_diff_bound

SAME_INPUT_TOL = 1e-5


def _nan(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("nn", [False, True])
def test_m_grouped_contiguous_matches_dense_per_group(nn):
    sizes, n, k = [90, 0, 130], 128, 256  # an empty group and a group spanning two 128-row blocks
    m_indices = contiguous_layout(sizes, "cpu")
    m = m_indices.numel()
    a = torch.randn(m, k) * (m_indices >= 0).unsqueeze(1)
    b = torch.randn(len(sizes), n, k)
    a_op = deep_gemm.per_token_cast_to_fp8(a)
    if nn:
        b_op = deep_gemm.per_block_cast_to_fp8(b.transpose(1, 2).contiguous())
        fn, dense = deep_gemm.m_grouped_fp8_gemm_nn_contiguous, deep_gemm.fp8_gemm_nn
    else:
        b_op = deep_gemm.per_block_cast_to_fp8(b)
        fn, dense = deep_gemm.m_grouped_fp8_gemm_nt_contiguous, deep_gemm.fp8_gemm_nt
    d = _nan(m, n)
    with registry.force("triton"):
        fn(a_op, b_op, d, m_indices)
    pad = m_indices < 0
    assert torch.isnan(d[pad]).all() and not torch.isnan(d[~pad]).any()
    for g in range(len(sizes)):
        rows = (m_indices == g).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        want = dense((a_op[0][rows], a_op[1][rows]), (b_op[0][g], b_op[1][g]), _nan(rows.numel(), n))
        assert calc_diff(d[rows], want) < SAME_INPUT_TOL
        assert calc_diff(d[rows], a[rows] @ b[g].T) < fp8_calc_diff_bound(2, k, d[rows].numel())


def test_m_grouped_contiguous_unsorted_groups_bf16():
    # Groups need not appear in order; bf16 twin; padding rows untouched.
    ordered = contiguous_layout([70, 128], "cpu")
    m_indices = torch.cat([ordered[128:], ordered[:128]])  # group 1's block first, then group 0's
    m, n, k = m_indices.numel(), 256, 128
    a = torch.randn(m, k).bfloat16()
    b = torch.randn(2, n, k).bfloat16()
    d = _nan(m, n)
    with registry.force("triton"):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
    for g in (0, 1):
        rows = m_indices == g
        assert calc_diff(d[rows], a[rows].float() @ b[g].float().T) < SAME_INPUT_TOL
    assert torch.isnan(d[m_indices < 0]).all()


def test_m_grouped_masked_skips_rows_beyond_masked_m():
    groups, m_max, n, k = 3, 64, 128, 256
    masked_m = torch.tensor([40, 0, 64], dtype=torch.int32)
    a = torch.randn(groups, m_max, k)
    b = torch.randn(groups, n, k)
    a_op, b_op = deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b)
    d = _nan(groups, m_max, n)
    with registry.force("triton"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a_op, b_op, d, masked_m, expected_m=40)
    for g, rows in enumerate(masked_m.tolist()):
        assert torch.isnan(d[g, rows:]).all()
        if rows:
            want = deep_gemm.fp8_gemm_nt((a_op[0][g, :rows], a_op[1][g, :rows]), (b_op[0][g], b_op[1][g]),
                                         _nan(rows, n))
            assert calc_diff(d[g, :rows], want) < SAME_INPUT_TOL
            assert calc_diff(d[g, :rows], a[g, :rows] @ b[g].T) < fp8_calc_diff_bound(2, k, rows * n)
    assert deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_masked is deep_gemm.m_grouped_fp8_gemm_nt_masked


def test_m_grouped_masked_bf16():
    a = torch.randn(2, 129, 128).bfloat16()
    b = torch.randn(2, 128, 128).bfloat16()
    masked_m = torch.tensor([129, 5], dtype=torch.int32)
    d = _nan(2, 129, 128)
    with registry.force("triton"):
        deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, 64)
    assert calc_diff(d[0], a[0].float() @ b[0].float().T) < SAME_INPUT_TOL
    assert calc_diff(d[1, :5], a[1, :5].float() @ b[1].float().T) < SAME_INPUT_TOL
    assert torch.isnan(d[1, 5:]).all()


@pytest.mark.parametrize("with_c", [False, True])
def test_k_grouped_tn_matches_dense_tn_per_group(with_c):
    ks, m, n = [128, 0, 256], 128, 256
    a = torch.randn(sum(ks), m)
    b = torch.randn(sum(ks), n)
    # Cast per group (each group's rows are its own 128-row scale tiles), as DeepGEMM's tests do.
    a_op = deep_gemm.per_channel_cast_to_fp8(a)
    b_op = deep_gemm.per_channel_cast_to_fp8(b)
    c = torch.randn(len(ks), m, n) * 4 if with_c else None
    d = _nan(len(ks), m, n, dtype=torch.float32)
    ks_tensor = torch.tensor(ks, dtype=torch.int32)
    with registry.force("triton"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(a_op, b_op, d, ks, ks_tensor, c)
    start = 0
    for g, kg in enumerate(ks):
        base = c[g] if with_c else torch.zeros(m, n)
        if kg == 0:
            torch.testing.assert_close(d[g], base, rtol=0, atol=0)  # an empty group: exactly c (or 0)
            continue
        sl, sb = slice(start, start + kg), slice(start // 128, (start + kg) // 128)
        want = deep_gemm.fp8_gemm_tn((a_op[0][sl].contiguous(), a_op[1][sb]), (b_op[0][sl].contiguous(), b_op[1][sb]),
                                     _nan(m, n, dtype=torch.float32), c=None if c is None else c[g].clone())
        assert calc_diff(d[g], want) < SAME_INPUT_TOL
        assert calc_diff(d[g], base + a[sl].T @ b[sl]) < fp8_calc_diff_bound(2, kg, m * n)
        start += kg


def test_k_grouped_bf16_unaligned_groups():
    ks, m, n = [100, 28], 128, 128  # bf16 twin takes any group sizes
    a = torch.randn(sum(ks), m).bfloat16()
    b = torch.randn(sum(ks), n).bfloat16()
    d = _nan(2, m, n, dtype=torch.float32)
    with registry.force("triton"):
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks)
    assert calc_diff(d[0], a[:100].float().T @ b[:100].float()) < SAME_INPUT_TOL
    assert calc_diff(d[1], a[100:].float().T @ b[100:].float()) < SAME_INPUT_TOL


def test_k_grouped_nt_flat_layout_matches_tn():
    # DeepGEMM's SM90 wgrad layout: same numbers as the tn op on the untransposed data.
    op = registry.get("deep_gemm.k_grouped_fp8_gemm_nt_contiguous")
    shape = {"ks": [256, 0, 128], "m": 128, "n": 256}
    (a, sfa), (b, sfb), d, ks, ks_tensor, c = op.verify.make_case(shape, 3, torch.device("cpu")).args
    assert sfa.shape == (128, 3) and a.numel() == 384 * 128
    with registry.force("triton"):
        got = deep_gemm.k_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), _nan(3, 128, 256, dtype=torch.float32),
                                                         ks, ks_tensor, c)
    tn = registry.get("deep_gemm.k_grouped_fp8_gemm_tn_contiguous").verify.make_case(shape, 3, torch.device("cpu"))
    want = deep_gemm.k_grouped_fp8_gemm_tn_contiguous(*tn.args)  # the suite's default: the reference
    assert calc_diff(got, want) < SAME_INPUT_TOL
    torch.testing.assert_close(got[1], c[1], rtol=0, atol=0)
