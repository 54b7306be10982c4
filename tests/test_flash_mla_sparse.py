"""DSA sparse MLA attention (flash_mla.sparse): references and Triton kernels against float64 dense attention
with the non-selected keys masked, written out here independently of the gather the implementations use.

Every case draws fresh indices with duplicates, -1 and out-of-range entries, rows with fewer valid keys than
top-k (causal selection) and, where asked, a row with no valid key at all; every cache row no query selects
is NaN, so reading one shows up as NaN in a result.
"""

import math

import pytest
import torch

import accel
import flash_mla
from accel import registry
from flash_mla.kernels import sparse as kernels
from flash_mla.sparse import (
    compare_sparse,
    flash_mla_sparse_fwd_reference,
    poison_unselected,
    random_selection,
    sparse_mla_attention_backward_reference,
    sparse_mla_attention_reference,
)
from verifier.verify import calc_diff

LOG2E = 1.4426950408889634


def _dense_float64(q, kv, indices, scale, d_v):
    """float64 dense attention over all s_kv keys, key s weighted by how often row t lists it (0: masked):
    (out, max_logits, lse) with base-2 stats, lonely rows out 0 / max -inf / lse +inf. Differentiable."""
    s_kv = kv.shape[0]
    valid = (indices >= 0) & (indices < s_kv)
    counts = torch.zeros(q.shape[0], s_kv, dtype=torch.float64)
    counts.scatter_add_(1, indices.long().clamp(0, s_kv - 1), valid.double())
    kv = torch.where(counts.sum(0)[:, None] > 0, kv.double(), 0.0)  # never-selected rows are NaN-poisoned
    scores = torch.einsum("thd,sd->ths", q.double(), kv) * scale
    live = (counts.sum(1) > 0)[:, None, None]
    logits = torch.where(counts[:, None, :] > 0, scores, -math.inf)
    logits = torch.where(live, logits, 0.0)
    weights = counts[:, None, :] * torch.exp(logits - logits.amax(-1, keepdim=True))
    probs = weights / torch.where(live, weights.sum(-1, keepdim=True), 1.0)
    out = torch.einsum("ths,sd->thd", probs, kv[:, :d_v])
    lse = torch.log(weights.sum(-1)) + logits.amax(-1)
    live = live[..., 0]
    return (out, torch.where(live, logits.amax(-1) * LOG2E, -math.inf),
            torch.where(live, lse * LOG2E, math.inf))


def _case(s_q, s_kv, h, d_qk, topk, dtype, seed, lonely=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d_qk, generator=g).to(dtype)
    kv = torch.randn(s_kv, d_qk, generator=g).to(dtype)
    idx = random_selection(s_q, s_kv, topk, g, causal=True)
    if lonely:
        idx[s_q // 2] = -1
    poison_unselected(kv, idx)
    dout = torch.randn(s_q, h, kv.shape[1], generator=g).to(dtype)
    return q, kv, idx, dout


def _lse_atol(q, kv, indices, scale):
    """Bound on a base-2 score's fp32 error: a length-d dot product of fp32 products is within d * 2^-24 *
    sum|q_i k_i| (Higham), and lse / max_logits move by at most the largest score error; plus the fp32 rounding
    of exp/log (1e-6 relative)."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    keys = torch.where(valid[..., None], kv.double()[indices.long().clamp(0, kv.shape[0] - 1)], 0.0)
    magnitude = torch.einsum("thd,tkd->thk", q.double().abs(), keys.abs()).amax() * scale * LOG2E
    return float(2 * q.shape[-1] * 2.0 ** -24 * magnitude) + 1e-6 * 16


def _assert_stats(got, want, atol, name):
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(want) & (want > 0)), name
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0)), name
    finite = torch.isfinite(want)
    err = (got.double()[finite] - want[finite]).abs().max().item()
    assert err <= atol * max(1.0, want[finite].abs().max().item()), f"{name}: {err} > {atol}"


def test_reference_matches_float64_dense():
    q, kv, idx, dout = _case(s_q=13, s_kv=29, h=3, d_qk=40, topk=17, dtype=torch.float32, seed=0)
    scale, d_v = 0.21, 24
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    want = _dense_float64(q64, kv64, idx, scale, d_v)
    want_dq, want_dkv = torch.autograd.grad(want[0], (q64, kv64), dout[..., :d_v].double())
    with registry.force("reference"):
        out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], scale, d_v=d_v)
    # fp32 vs float64 on the same inputs: only fp32 rounding (~1e-7 relative, calc_diff ~1e-14)
    assert calc_diff(out, want[0]) < 1e-10
    assert (out[q.shape[0] // 2] == 0).all()
    _assert_stats(max_logits, want[1], _lse_atol(q, kv, idx, scale), "max_logits")
    _assert_stats(lse, want[2], _lse_atol(q, kv, idx, scale), "lse")
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o = sparse_mla_attention_reference(qr, kvr, idx, scale, d_v)
    dq, dkv = torch.autograd.grad(o, (qr, kvr), dout[..., :d_v])
    assert calc_diff(o, want[0]) < 1e-10
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert calc_diff(dq, want_dq) < 1e-10 and calc_diff(dkv, want_dkv) < 1e-10


def test_sparse_decode_reference_is_sparse_prefill_over_the_flat_cache():
    """flash_mla_with_kvcache(indices=...) on a paged bf16 cache and on its FP8 656-byte form equals the float64
    dense reference over the (dequantised) flattened cache; lse there is natural-log, [b, h_q, s_q]."""
    g = torch.Generator().manual_seed(3)
    b, s_q, h_q, blocks, topk = 2, 2, 4, 3, 40
    cache = torch.randn(blocks, 64, 1, 576, generator=g).to(torch.bfloat16)
    q = torch.randn(b, s_q, h_q, 576, generator=g).to(torch.bfloat16)
    idx = random_selection(b * s_q, blocks * 64, topk, g, causal=False)
    idx[1] = -1
    for fp8 in (False, True):
        k_cache = flash_mla.quantize_kv_fp8(cache) if fp8 else cache.clone()
        used = torch.zeros(blocks * 64, dtype=torch.bool)
        used[idx[(idx >= 0) & (idx < blocks * 64)].long()] = True
        k_cache.view(torch.uint8).view(blocks * 64, -1)[~used] = 255  # bf16 0xFFFF and e4m3 0xFF are NaN
        flat = flash_mla.dequantize_kv_fp8(k_cache) if fp8 else k_cache
        with registry.force("reference"):
            out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None,
                                                        is_fp8_kvcache=fp8, indices=idx.view(b, s_q, topk))
        want = _dense_float64(q.view(b * s_q, h_q, 576), flat.reshape(-1, 576), idx, 576 ** -0.5, 512)
        assert calc_diff(out.view(b * s_q, h_q, 512), want[0]) < 1e-5  # bf16 rounding of out
        _assert_stats(lse.transpose(1, 2).reshape(b * s_q, h_q) * LOG2E, want[2], 1e-5, "lse")


@pytest.mark.parametrize("bad,match", [
    (dict(indices=lambda i: i.long()), "indices must be int32"),
    (dict(kv=lambda k: k[:, :, :8]), "kv's last dim"),
    (dict(indices=lambda i: i[:3]), "one row per query"),
    (dict(d_v=700), "d_v must be in"),
])
def test_bad_inputs_name_the_argument(bad, match):
    q, kv, idx, _ = _case(6, 10, 2, 48, 5, torch.bfloat16, seed=1, lonely=False)
    args = dict(q=q, kv=kv[:, None], indices=idx[:, None], sm_scale=0.1, d_v=32)
    for key, fn in bad.items():
        args[key] = fn(args[key]) if callable(fn) else fn
    with pytest.raises(ValueError, match=match):
        flash_mla.flash_mla_sparse_fwd(**args)


# (s_q, s_kv, h_q, d_qk, d_v, topk, dtype): top-k above the causal valid prefix, odd dims padded inside the tiles
# (40 = 24 + 16, 24 padded to 32), V3.2's 576 / 512 latent, and fp32 where only summation order differs.
KERNEL_CASES = [
    (9, 20, 3, 48, 32, 20, torch.bfloat16),
    (13, 40, 5, 40, 24, 16, torch.float32),
    (4, 70, 16, 576, 512, 32, torch.bfloat16),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("s_q,s_kv,h,d_qk,d_v,topk,dtype", KERNEL_CASES)
def test_triton_matches_float64_dense(s_q, s_kv, h, d_qk, d_v, topk, dtype):
    q, kv, idx, dout = _case(s_q, s_kv, h, d_qk, topk, dtype, seed=s_q + d_qk)
    dout = dout[..., :d_v].contiguous()
    scale = d_qk ** -0.5
    with registry.force("triton"), registry.poisoned_outputs():
        out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], scale, d_v=d_v)
        qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
        o = flash_mla.sparse_mla_attention(qr, kvr, idx, scale, d_v)
        dq, dkv = torch.autograd.grad(o, (qr, kvr), dout)
    for name in ("flash_mla.flash_mla_sparse_fwd", "flash_mla.sparse_mla_attention",
                 "flash_mla.sparse_mla_attention_backward"):
        assert registry.get(name).last_impl == "triton", name
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    want = _dense_float64(q64, kv64, idx, scale, d_v)
    want_dq, want_dkv = torch.autograd.grad(want[0], (q64, kv64), dout.double())
    # fp32: the same math in another summation order (calc_diff ~1e-14). bf16: results rounded to bf16
    # (~1e-6), and the backward's rowsum(dO * O) uses the bf16 O as every flash kernel does (~1e-5 seen);
    # a masking, duplicate or indexing bug moves a result by > 1e-2.
    tol = 1e-10 if dtype == torch.float32 else 5e-5
    for name, got, ref in (("out", out, want[0]), ("out (training op)", o, want[0]), ("dq", dq, want_dq),
                           ("dkv", dkv, want_dkv)):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        assert calc_diff(got, ref) < tol, f"{name}: {calc_diff(got, ref)}"
    assert (out[s_q // 2] == 0).all() and (dq[s_q // 2] == 0).all()
    unselected = torch.isnan(kv[:, 0])
    assert unselected.any() and (dkv[unselected] == 0).all()  # poisoned rows: never read, gradient exactly 0
    atol = _lse_atol(q, kv, idx, scale)
    _assert_stats(max_logits, want[1], atol, "max_logits")
    _assert_stats(lse, want[2], atol, "lse")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_sparse_decode_matches_reference(fp8):
    """Sparse decoding on a paged cache: the Triton kernel (BF16 gather, or FP8 656-byte rows dequantised in the
    kernel) against the reference on the same cache (both see the same bf16 values: products exact in fp32)."""
    g = torch.Generator().manual_seed(11 + fp8)
    b, s_q, h_q, blocks, topk = 2, 2, 16, 2, 24
    cache = torch.randn(blocks, 64, 1, 576, generator=g).to(torch.bfloat16)
    q = torch.randn(b, s_q, h_q, 576, generator=g).to(torch.bfloat16)
    idx = random_selection(b * s_q, blocks * 64, topk, g, causal=False).view(b, s_q, topk)
    idx[0, 1] = -1
    k_cache = flash_mla.quantize_kv_fp8(cache) if fp8 else cache
    with registry.force("triton"), registry.poisoned_outputs():
        out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None, is_fp8_kvcache=fp8,
                                                    indices=idx)
    assert registry.get("flash_mla.flash_mla_with_kvcache").last_impl == "triton"
    with registry.force("reference"):
        want_out, want_lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None,
                                                              is_fp8_kvcache=fp8, indices=idx)
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    assert calc_diff(out, want_out) < 1e-5 and (out[0, 1] == 0).all()  # bf16 rounding of out
    _assert_stats(lse, want_lse.double(), 1e-5, "lse")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [101, 202])
def test_triton_random_shapes(seed):
    """Shapes drawn at random (odd head counts, value widths and RoPE widths, top-k above and below s_kv), bf16,
    forward and both gradients against float64."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    s_q, s_kv, h, d_v, d_rest = draw(1, 12), draw(1, 50), draw(1, 20), draw(8, 72), draw(1, 40)
    topk = draw(1, 2 * s_kv)
    q, kv, idx, dout = _case(s_q, s_kv, h, d_v + d_rest, topk, torch.bfloat16, seed, lonely=s_q > 1)
    dout = dout[..., :d_v].contiguous()
    scale = (d_v + d_rest) ** -0.5
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with registry.force("triton"), registry.poisoned_outputs():
        o = flash_mla.sparse_mla_attention(qr, kvr, idx, scale, d_v)
        dq, dkv = torch.autograd.grad(o, (qr, kvr), dout)
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    want = _dense_float64(q64, kv64, idx, scale, d_v)[0]
    grads = torch.autograd.grad(want, (q64, kv64), dout.double())
    shape = dict(s_q=s_q, s_kv=s_kv, h=h, d_v=d_v, d_rest=d_rest, topk=topk)
    for name, got, ref in (("out", o, want), ("dq", dq, grads[0]), ("dkv", dkv, grads[1])):
        assert torch.isfinite(got).all() and calc_diff(got, ref) < 5e-5, (name, shape, calc_diff(got, ref))


def test_packed_sequences_equal_separate_calls():
    """Variable-length sequences packed into one kv: each sequence's valid indices offset by its first row
    give exactly the per-sequence results, and gradients land in each sequence's own rows."""
    g = torch.Generator().manual_seed(9)
    lens, h, d, d_v, topk = [7, 1, 12], 2, 40, 24, 9
    qs, kvs, idxs = [], [], []
    for n in lens:
        qs.append(torch.randn(n, h, d, generator=g))
        kvs.append(torch.randn(n, d, generator=g))
        idxs.append(random_selection(n, n, topk, g, causal=True))
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    # a per-sequence out-of-range index (>= its length) must become -1 before the offset, or it names a row of
    # the next sequence
    packed_idx = torch.cat([torch.where((i >= 0) & (i < n), i + s, -1) for i, s, n in zip(idxs, starts, lens)])
    q, kv = torch.cat(qs).requires_grad_(), torch.cat(kvs).requires_grad_()
    with registry.force("reference"):
        out = flash_mla.sparse_mla_attention(q, kv, packed_idx, 0.3, d_v)
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    for qi, kvi, ii, s, n in zip(qs, kvs, idxs, starts, lens):
        qi, kvi = qi.requires_grad_(), kvi.requires_grad_()
        with registry.force("reference"):
            oi = flash_mla.sparse_mla_attention(qi, kvi, ii, 0.3, d_v)
        gi = torch.autograd.grad(oi.sum(), (qi, kvi))
        torch.testing.assert_close(out[s:s + n], oi, rtol=0, atol=1e-6)
        torch.testing.assert_close(dq[s:s + n], gi[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(dkv[s:s + n], gi[1], rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_sparse_matches_reference_on_gpu():
    """V3.2's dims on a GPU (every autotune config timed, so the dkv accumulator must be reset between trials):
    forward against the fp32 reference at FlashMLA's pass marks, backward at 1e-4 (P and dS rounded to bf16 for
    the tensor cores, as every flash backward)."""
    device = accel.default_device()
    q, kv, idx, dout = (t.to(device) for t in _case(256, 2048, 128, 576, 512, torch.bfloat16, seed=5))
    dout = dout[..., :512].contiguous()
    with registry.force("triton"), registry.poisoned_outputs():
        got = flash_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 576 ** -0.5)
    want = flash_mla_sparse_fwd_reference(q, kv[:, None], idx[:, None], 576 ** -0.5)
    errors = compare_sparse({f"out[{i}]": t for i, t in enumerate(got)}, {f"out[{i}]": t for i, t in enumerate(want)})
    for name, (err, tol) in errors.items():
        assert err < tol, f"{name}: {err} >= {tol}"
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with registry.force("triton"), registry.poisoned_outputs():
        dq, dkv = torch.autograd.grad(flash_mla.sparse_mla_attention(qr, kvr, idx, 576 ** -0.5), (qr, kvr), dout)
    want_dq, want_dkv = sparse_mla_attention_backward_reference(dout, q, kv, idx, None, None, 576 ** -0.5, 512)
    assert calc_diff(dq, want_dq) < 1e-4 and calc_diff(dkv, want_dkv) < 1e-4
    assert (dkv[torch.isnan(kv[:, 0])] == 0).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block_h,block_k", [(64, 32), (32, 32), (16, 64), (32, 16), (16, 16)])
def test_triton_gpu_tile_shapes(monkeypatch, block_h, block_k):
    """The tile shapes the GPU configs use (the interpreter otherwise runs 16 x 16 only), with head tiles only
    partly filled (20 heads) and top-k not a multiple of the key tile."""
    monkeypatch.setattr(kernels, "_INTERP", [(block_h, block_k, 1, 1)])
    monkeypatch.setattr(kernels, "_tuned", {})
    q, kv, idx, dout = _case(5, 40, 20, 48, 37, torch.float32, seed=block_h + block_k)
    dout = dout[..., :32].contiguous()
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with registry.force("triton"), registry.poisoned_outputs():
        o = flash_mla.sparse_mla_attention(qr, kvr, idx, 0.15, 32)
        dq, dkv = torch.autograd.grad(o, (qr, kvr), dout)
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    want = _dense_float64(q64, kv64, idx, 0.15, 32)[0]
    grads = torch.autograd.grad(want, (q64, kv64), dout.double())
    for name, got, ref in (("out", o, want), ("dq", dq, grads[0]), ("dkv", dkv, grads[1])):
        assert torch.isfinite(got).all() and calc_diff(got, ref) < 1e-10, (name, calc_diff(got, ref))
