"""DSA indexer logits (deep_gemm.fp8_mqa_logits, fp8_paged_mqa_logits, select_topk) against float64 math, and the
FP8 result against the unquantised BF16 one within the bound e4m3's 3 mantissa bits allow."""

import math

import pytest
import torch

import accel
import deep_gemm
from accel import registry

E4M3_U = 2.0 ** -4  # e4m3 unit roundoff (3 mantissa bits) for normal values
E4M3_SUB = 2.0 ** -10  # half the spacing of e4m3 subnormals (2^-9): the absolute error below 2^-6


def _float64_logits(q, k, scale, weights, ks, ke):
    """sum_h w[t, h] * ReLU(q[t, h] . k[s] * scale[s]), -inf outside [ks, ke): one einsum in float64."""
    score = torch.einsum("thd,sd->ths", q.double(), k.double()) * scale.double()[None, None, :]
    logits = (score.relu() * weights.double()[..., None]).sum(1)
    cols = torch.arange(k.shape[0])
    inside = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    return logits.masked_fill(~inside, -math.inf)


def _inputs(s_q, s_kv, heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, heads, d, generator=g).to(torch.bfloat16)
    k = torch.randn(s_kv, d, generator=g).to(torch.bfloat16)
    weights = torch.randn(s_q, heads, generator=g)
    ks = torch.randint(0, s_kv // 2, (s_q,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, s_kv, (s_q,), generator=g, dtype=torch.int32),
                       torch.tensor(s_kv, dtype=torch.int32))
    ke[0] = ks[0]  # an empty range: a row of -inf
    scale = k.float().abs().amax(-1).clamp_min(1e-4) / 448.0
    return q, k, weights, ks, ke, q.to(torch.float8_e4m3fn), (k.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def _assert_logits(got, want, atol):
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and not torch.isnan(got).any()
    err = (got.double() - want).masked_fill(inf, 0).abs()
    assert (err <= atol).all(), f"max error {err.max().item()} (bound {atol if isinstance(atol, float) else ''})"


def _reorder_atol(q8, k8, scale, weights, reduction):
    """fp32 evaluation of exact fp8 products: each score within d * 2^-24 * sum|q k| * scale, the head sum
    within heads * 2^-24 * sum|w relu|; twice for two orders."""
    mag = torch.einsum("thd,sd->ths", q8.double().abs(), k8.double().abs()) * scale.double()
    return 2 * 2.0 ** -24 * (reduction + q8.shape[1]) * (mag * weights.double().abs()[..., None]).sum(1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("s_q,s_kv,heads,d", [(9, 37, 3, 32), (16, 64, 8, 128), (5, 150, 2, 32)])
def test_matches_float64(impl, s_q, s_kv, heads, d):
    if impl == "triton" and heads & (heads - 1):
        heads += 1  # the kernel takes power-of-two head counts (3 -> 4); the reference any
    _, _, weights, ks, ke, q8, k8, scale = _inputs(s_q, s_kv, heads, d, seed=s_q)
    with registry.force(impl), registry.poisoned_outputs():
        got = deep_gemm.fp8_mqa_logits(q8, (k8, scale), weights, ks, ke)
    assert registry.get("deep_gemm.fp8_mqa_logits").last_impl == impl
    _assert_logits(got, _float64_logits(q8, k8, scale, weights, ks, ke), _reorder_atol(q8, k8, scale, weights, d))


def test_fp8_logits_within_the_e4m3_bound_of_bf16():
    """Quantising q and k to e4m3 moves each element by at most u|x| + 2^-10 (u = 2^-4; 2^-10 covers
    subnormals, times the key's scale for k); a product then moves by e_q|k| + |q|e_k + e_q e_k, a score by the
    sum of that over d, and ReLU does not enlarge a difference: |logit error| <= sum_h |w_h| * scale * that sum.
    The FP8 op must lie within this bound of the float64 logits of the unquantised BF16 inputs."""
    q, k, weights, ks, ke, q8, k8, scale = _inputs(24, 96, 4, 128, seed=7)
    with registry.force("triton"), registry.poisoned_outputs():
        got = deep_gemm.fp8_mqa_logits(q8, (k8, scale), weights, ks, ke)
    want = _float64_logits(q, k, torch.ones(k.shape[0]), weights, ks, ke)
    qa, ka = q.double().abs(), (k.double() / scale.double()[:, None]).abs()  # k in its scaled (fp8) units
    eq, ek = E4M3_U * qa + E4M3_SUB, E4M3_U * ka + E4M3_SUB
    per_score = (torch.einsum("thd,sd->ths", eq, ka) + torch.einsum("thd,sd->ths", qa, ek)
                 + torch.einsum("thd,sd->ths", eq, ek)) * scale.double()
    bound = (per_score * weights.double().abs()[..., None]).sum(1)
    bound = bound + _reorder_atol(q8, k8, scale, weights, 128)
    _assert_logits(got, want, bound)
    # and the bound is not vacuous: the quantisation error is a visible share of it
    finite = torch.isfinite(want)
    assert ((got.double() - want)[finite].abs() / bound[finite]).max() > 0.05


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("two_d", [False, True])
def test_paged_equals_float64_on_the_gathered_keys(impl, two_d):
    g = torch.Generator().manual_seed(5)
    b, next_n, heads, d, block = 3, 2, 4, 32, 16
    max_len = 70
    lens = torch.tensor([2, 70, 33], dtype=torch.int32)
    ends = (lens[:, None] - next_n + 1 + torch.arange(next_n)).to(torch.int32)  # 1-d lengths: the causal tail
    if two_d:  # per-query lengths (DeepGEMM's 2-d context_lens): any length up to the sequence's
        ends = torch.randint(1, 71, (b, next_n), generator=g, dtype=torch.int32).minimum(lens[:, None])
    keys = torch.randn(16, block, 1, d, generator=g)
    cache = deep_gemm.kv_cache_cast_to_fp8(keys)
    table = torch.randperm(16, generator=g)[:b * 5].view(b, 5).to(torch.int32)
    table[0, 1:] = 10 ** 6  # entries past a row's last page are never read
    q8 = torch.randn(b, next_n, heads, d, generator=g).to(torch.float8_e4m3fn)
    weights = torch.randn(b * next_n, heads, generator=g)
    with registry.force(impl), registry.poisoned_outputs():
        got = deep_gemm.fp8_paged_mqa_logits(q8, cache, weights, ends if two_d else lens, table, None, max_len)
    assert registry.get("deep_gemm.fp8_paged_mqa_logits").last_impl == impl
    values, scales = deep_gemm.mqa_logits.split_paged_cache(cache)
    for i in range(b):
        pages = table[i, : -(-int(lens[i]) // block)].long()
        k8, sc = values[pages].reshape(-1, d), scales[pages].reshape(-1)
        for j in range(next_n):
            end = int(ends[i, j])
            want = torch.full((max_len,), -math.inf, dtype=torch.float64)
            want[:end] = _float64_logits(q8[i, j:j + 1], k8[:end], sc[:end], weights[i * next_n + j:][:1],
                                         torch.zeros(1, dtype=torch.int32), torch.tensor([end]))[0]
            # exact fp8 products, fp32 sums of 32 + 4 terms: ~1e-6 of the magnitude; bugs are > 1e-2
            _assert_logits(got[i * next_n + j], want, 1e-5 * float(want[:end].abs().max()))


def test_select_topk_marks_masked_and_missing_slots():
    logits = torch.tensor([[0.5, -math.inf, 2.0, 1.0], [-math.inf] * 4, [3.0, 1.0, 2.0, 0.0]])
    got = deep_gemm.select_topk(logits, 6)
    assert got.dtype == torch.int32 and got.shape == (3, 6)
    assert got[0].tolist() == [2, 3, 0, -1, -1, -1]
    assert got[1].tolist() == [-1] * 6
    assert got[2].tolist() == [0, 2, 1, 3, -1, -1]


def test_bad_inputs_name_the_argument():
    _, _, weights, ks, ke, q8, k8, scale = _inputs(5, 9, 2, 32, seed=1)
    with pytest.raises(ValueError, match="weights must be float32"):
        deep_gemm.fp8_mqa_logits(q8, (k8, scale), weights.double(), ks, ke)
    with pytest.raises(ValueError, match="cu_seqlen_ke must be int32"):
        deep_gemm.fp8_mqa_logits(q8, (k8, scale), weights, ks, ke.long())
    with pytest.raises(ValueError, match=r"kv\[1\] must be float32"):
        deep_gemm.fp8_mqa_logits(q8, (k8, scale[:3]), weights, ks, ke)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_logits_match_reference_on_gpu():
    """V3.2's indexer (64 heads of 128) on a GPU against the reference on the same e4m3 inputs: Hopper's FP8 MMAs
    keep fewer accumulator bits than fp32 (about 14 mantissa bits over one 128-long K block, the DeepSeek-V3
    report), a relative error of ~1e-4 per score, calc_diff ~1e-8; 1e-6 still flags any mask or index bug."""
    device = accel.default_device()
    _, _, weights, ks, ke, q8, k8, scale = _inputs(512, 2048, 64, 128, seed=3)
    args = [t.to(device) for t in (q8, k8, scale, weights, ks, ke)]
    with registry.force("triton"), registry.poisoned_outputs():
        got = deep_gemm.fp8_mqa_logits(args[0], (args[1], args[2]), *args[3:])
    want = deep_gemm.mqa_logits.fp8_mqa_logits_reference(args[0], (args[1], args[2]), *args[3:])
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf)
    assert deep_gemm.calc_diff(got.masked_fill(inf, 0), want.masked_fill(inf, 0)) < 1e-6
