"""Bad input to deep_gemm ops: a ValueError that names the argument and what was expected, never a wrong result."""

import pytest
import torch

import deep_gemm

FP8 = torch.float8_e4m3fn


def _pair(rows, k, block_rows=False):
    x = torch.randn(rows, k)
    return deep_gemm.per_block_cast_to_fp8(x) if block_rows else deep_gemm.per_token_cast_to_fp8(x)


A = _pair(64, 256)
B = _pair(128, 256, block_rows=True)
D = torch.empty(64, 128, dtype=torch.bfloat16)


def _nan_scales(pair):
    sf = pair[1].clone()
    sf[0, 0] = float("nan")
    return pair[0], sf


def _inf_scales(pair):
    sf = pair[1].clone()
    sf[-1, -1] = float("inf")
    return pair[0], sf


DENSE_CASES = [
    ("a not fp8", lambda: deep_gemm.fp8_gemm_nt((A[0].float(), A[1]), B, D), r"a\[0\] must be float8_e4m3fn"),
    ("a not a pair", lambda: deep_gemm.fp8_gemm_nt(A[0], B, D), "a must be a .fp8 tensor, float32 scales. pair"),
    ("scales bf16", lambda: deep_gemm.fp8_gemm_nt((A[0], A[1].bfloat16()), B, D), r"a\[1\].*float32"),
    ("K not multiple of 128", lambda: deep_gemm.fp8_gemm_nt(_pair(64, 200), _pair(128, 200, True), D),
     "K=200 must be a multiple of 128"),
    ("N/K mismatch", lambda: deep_gemm.fp8_gemm_nt(A, _pair(128, 384, True), D), "A and B disagree on K"),
    ("sfa shape", lambda: deep_gemm.fp8_gemm_nt((A[0], A[1][:, :1]), B, D), r"a\[1\].*must have shape \[64, 2\]"),
    ("sfb shape", lambda: deep_gemm.fp8_gemm_nt(A, (B[0], B[1][:, :1]), D),
     r"b\[1\].*must have shape \[128, 2\] or \[1, 2\]"),
    ("NaN scale", lambda: deep_gemm.fp8_gemm_nt(_nan_scales(A), B, D), "NaN, Inf or non-positive"),
    ("Inf scale", lambda: deep_gemm.fp8_gemm_nt(A, _inf_scales(B), D), "NaN, Inf or non-positive"),
    ("non-contiguous a", lambda: deep_gemm.fp8_gemm_nt((_pair(256, 128)[0].T, A[1]), B, D),
     r"a\[0\] must be contiguous"),
    ("d wrong shape", lambda: deep_gemm.fp8_gemm_nt(A, B, torch.empty(64, 64, dtype=torch.bfloat16)),
     r"d must have shape \[64, 128\]"),
    ("d fp16", lambda: deep_gemm.fp8_gemm_nt(A, B, D.half()), "d must be bfloat16 or float32"),
    ("c dtype differs from d", lambda: deep_gemm.fp8_gemm_nt(A, B, D, c=torch.zeros(64, 128)), "c must be bfloat16"),
    ("nn b layout", lambda: deep_gemm.fp8_gemm_nn(A, B, D), r"b\[0\] must be \[k, n\] with k = 256"),
    ("bf16 op given fp32", lambda: deep_gemm.bf16_gemm_nt(torch.randn(4, 64), torch.randn(8, 64).bfloat16(),
                                                          torch.empty(4, 8, dtype=torch.bfloat16)),
     "a must be bfloat16"),
]


@pytest.mark.parametrize("name,call,match", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dense_bad_input(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _grouped():
    a = _pair(256, 128)
    b = deep_gemm.per_block_cast_to_fp8(torch.randn(2, 128, 128))
    d = torch.empty(256, 128, dtype=torch.bfloat16)
    m_indices = torch.cat([torch.zeros(128), torch.ones(128)]).int()
    return a, b, d, m_indices


def test_grouped_bad_input():
    a, b, d, m_indices = _grouped()
    with pytest.raises(ValueError, match="m_indices must be int32"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices.long())
    with pytest.raises(ValueError, match=r"group ids in \[0, 2\)"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices + 1)
    with pytest.raises(ValueError, match="must be a multiple of 128"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a[0][:100], a[1][:100]), b, d[:100], m_indices[:100])
    with pytest.raises(ValueError, match="d must be bfloat16"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d.float(), m_indices)
    with pytest.raises(ValueError, match="NaN, Inf"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (b[0], b[1] * float("inf")), d, m_indices)
    with pytest.raises(ValueError, match="use_psum_layout"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, use_psum_layout=True)

    a3 = deep_gemm.per_token_cast_to_fp8(torch.randn(2, 64, 128))
    d3 = torch.empty(2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"masked_m values must lie in \[0, 64\]"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a3, b, d3, torch.tensor([65, 1], dtype=torch.int32), 32)
    with pytest.raises(ValueError, match="expected_m must be a positive int"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a3, b, d3, torch.tensor([6, 1], dtype=torch.int32), 0)

    ka, kb = deep_gemm.per_channel_cast_to_fp8(torch.randn(256, 64)), deep_gemm.per_channel_cast_to_fp8(
        torch.randn(256, 32))
    kd = torch.empty(2, 64, 32)
    with pytest.raises(ValueError, match="multiple of 128"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(ka, kb, kd, [100, 156])
    with pytest.raises(ValueError, match=r"ks must sum to a's rows \(256\)"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(ka, kb, kd, [128, 256])
    with pytest.raises(ValueError, match="d must be float32"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(ka, kb, kd.bfloat16(), [128, 128])
