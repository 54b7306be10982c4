"""DeepSeek-V4 sparse attention (flash_mla.sparse_sink): the reference and the Triton kernels (in the interpreter)
against float64 dense attention over every key with a sink column, written out here independently of the gather
the implementations use; forward and the gradients of q, kv (K = V) and the sink.

Every case draws fresh index rows with duplicates, -1 and out-of-range entries, rows with fewer valid keys than
top-k (causal selection) and a row with no valid key at all (its output is 0: the sink takes all the weight);
every kv row no query selects is NaN, so reading one shows up as NaN in a result.
"""

import math

import pytest
import torch

import accel
import flash_mla
from accel import registry
from flash_mla.kernels import sparse as kernels
from flash_mla.sparse import poison_unselected, random_selection
from flash_mla.sparse_sink import sparse_sink_attention_backward_reference, sparse_sink_attention_reference
from verifier.verify import calc_diff

LOG2E = 1.4426950408889634


def _dense_float64(q, kv, indices, sink, scale):
    """float64 softmax over [all s_kv keys | sink], key s weighted by how often row t lists it (0: masked), the
    sink column dropped from the output: (out, lse base 2). Differentiable in q, kv and sink."""
    s_kv = kv.shape[0]
    valid = (indices >= 0) & (indices < s_kv)
    counts = torch.zeros(q.shape[0], s_kv, dtype=torch.float64)
    counts.scatter_add_(1, indices.long().clamp(0, s_kv - 1), valid.double())
    kv = torch.where(counts.sum(0)[:, None] > 0, kv.double(), 0.0)  # never-selected rows are NaN-poisoned
    scores = torch.einsum("thd,sd->ths", q.double(), kv) * scale
    logits = torch.where(counts[:, None, :] > 0, scores, -math.inf)
    sink = sink.double()[None, :].expand(q.shape[0], -1)
    top = torch.maximum(logits.amax(-1), sink)
    weights = counts[:, None, :] * torch.exp(logits - top[..., None])
    denom = weights.sum(-1) + torch.exp(sink - top)
    out = torch.einsum("ths,sd->thd", weights / denom[..., None], kv)
    return out, (torch.log(denom) + top) * LOG2E


def _case(s_q, s_kv, h, d, topk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g).to(dtype)
    kv = torch.randn(s_kv, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g) * 2
    idx = random_selection(s_q, s_kv, topk, g, causal=True)
    idx[s_q // 2] = -1  # a query with no valid key
    poison_unselected(kv, idx)
    dout = torch.randn(s_q, h, d, generator=g).to(dtype)
    return q, kv, idx, sink, dout


def _lse_atol(q, kv, indices, scale):
    """Bound on a base-2 lse's fp32 error: a length-d dot product of fp32 products is within d * 2^-24 *
    sum|q_i k_i| (Higham) and the lse moves by at most the largest score error; plus fp32 exp/log rounding."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    keys = torch.where(valid[..., None], kv.double()[indices.long().clamp(0, kv.shape[0] - 1)], 0.0)
    magnitude = torch.einsum("thd,tkd->thk", q.double().abs(), keys.abs()).amax() * scale * LOG2E
    return float(2 * q.shape[-1] * 2.0 ** -24 * magnitude) + 1e-6 * 16


def _want(q, kv, idx, sink, dout, scale):
    q64, kv64, sink64 = (t.double().requires_grad_() for t in (q, kv, sink))
    out, lse = _dense_float64(q64, kv64, idx, sink64, scale)
    grads = torch.autograd.grad(out, (q64, kv64, sink64), dout.double())
    return out.detach(), lse.detach(), *grads


def test_reference_matches_float64_dense():
    """fp32 reference (forward and the written-out backward) vs float64 on the same inputs: only fp32 rounding
    (~1e-7 relative, so calc_diff ~1e-14; 1e-10 leaves room and still flags any wrong weight)."""
    q, kv, idx, sink, dout = _case(13, 29, 3, 40, 17, torch.float32, seed=0)
    scale = 0.21
    want_out, want_lse, want_dq, want_dkv, want_dsink = _want(q, kv, idx, sink, dout, scale)
    out, lse = sparse_sink_attention_reference(q, kv, idx, sink, scale)
    assert calc_diff(out, want_out) < 1e-10 and (out[6] == 0).all()
    assert (lse.double() - want_lse).abs().max() <= _lse_atol(q, kv, idx, scale) * max(1, want_lse.abs().max())
    dq, dkv, dsink = sparse_sink_attention_backward_reference(dout, q, kv, idx, sink, out, lse, scale)
    for name, got, ref in (("dq", dq, want_dq), ("dkv", dkv, want_dkv), ("dsink", dsink, want_dsink)):
        assert torch.isfinite(got).all() and calc_diff(got, ref) < 1e-10, name


@pytest.mark.parametrize("bad,match", [
    (dict(indices=lambda i: i.long()), "indices must be int32"),
    (dict(kv=lambda k: k[:, :8]), "kv's last dim"),
    (dict(indices=lambda i: i[:3]), "one row per query"),
    (dict(sink=lambda s: s[:1]), "one logit per head"),
    (dict(sink=lambda s: s[None]), "sink must be a 1-d tensor"),
])
def test_bad_inputs_name_the_argument(bad, match):
    q, kv, idx, sink, _ = _case(6, 10, 2, 48, 5, torch.bfloat16, seed=1)
    args = dict(q=q, kv=kv, indices=idx, sink=sink, sm_scale=0.1)
    for key, fn in bad.items():
        args[key] = fn(args[key])
    with pytest.raises(ValueError, match=match):
        flash_mla.sparse_sink_attention(**args)


# (s_q, s_kv, h_q, d, topk, dtype): top-k above the causal valid prefix, odd sizes padded inside the tiles (d 40
# in a 64-wide tile, 5 and 3 heads in a 16-head tile), V4's 512-wide head, and fp32 where only summation order
# differs.
KERNEL_CASES = [
    (9, 20, 3, 48, 20, torch.bfloat16),
    (13, 40, 5, 40, 16, torch.float32),
    (4, 70, 16, 512, 32, torch.bfloat16),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("s_q,s_kv,h,d,topk,dtype", KERNEL_CASES)
def test_triton_matches_float64_dense(s_q, s_kv, h, d, topk, dtype):
    q, kv, idx, sink, dout = _case(s_q, s_kv, h, d, topk, dtype, seed=s_q + d + torch.randint(1 << 20, ()).item())
    scale = d ** -0.5
    with registry.force("triton"), registry.poisoned_outputs():
        qr, kvr, sinkr = q.clone().requires_grad_(), kv.clone().requires_grad_(), sink.clone().requires_grad_()
        out = flash_mla.sparse_sink_attention(qr, kvr, idx, sinkr, scale)
        dq, dkv, dsink = torch.autograd.grad(out, (qr, kvr, sinkr), dout)
        _, lse = torch.ops.dsv3.sparse_sink_attention(q, kv, idx, sink, scale)
    for name in ("flash_mla.sparse_sink_attention", "flash_mla.sparse_sink_attention_backward"):
        assert registry.get(name).last_impl == "triton", name
    want_out, want_lse, want_dq, want_dkv, want_dsink = _want(q, kv, idx, sink, dout, scale)
    # fp32: the same math in another summation order (calc_diff ~1e-14). bf16: results rounded to bf16 (~1e-6)
    # and the backward's rowsum(dO * O) (also dsink's factor) uses the bf16 O as every flash kernel does (~1e-5);
    # a masking, sink, duplicate or indexing bug moves a result by > 1e-2.
    tol = 1e-10 if dtype == torch.float32 else 5e-5
    for name, got, ref in (("out", out, want_out), ("dq", dq, want_dq), ("dkv", dkv, want_dkv),
                           ("dsink", dsink, want_dsink)):
        assert torch.isfinite(got).all(), name
        assert calc_diff(got, ref) < tol, f"{name}: {calc_diff(got, ref)}"
    assert out.dtype == dq.dtype == dkv.dtype == dtype and dsink.dtype == torch.float32
    assert (out[s_q // 2] == 0).all() and (dq[s_q // 2] == 0).all()
    unselected = torch.isnan(kv[:, 0])
    assert unselected.any() and (dkv[unselected] == 0).all()  # poisoned rows: never read, gradient exactly 0
    assert (lse.double() - want_lse).abs().max() <= _lse_atol(q, kv, idx, scale) * max(1, want_lse.abs().max())
    # the lonely row's lse is the sink's logit exactly
    assert torch.equal(lse[s_q // 2], sink * LOG2E) or calc_diff(lse[s_q // 2], sink * LOG2E) < 1e-12


def _dense_sink_attention(q, kv, visible, sink, scale):
    """The V4 model's former dense form, in float64: ``softmax([q.k * scale | sink])`` under the ``visible [b, s, n]``
    mask, the sink column dropped, times ``kv``."""
    logits = torch.einsum("bshd,bnd->bhsn", q.double(), kv.double()) * scale
    logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    sinks = sink.double().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhsn,bnd->bshd", probs, kv.double())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["window", "hca", "csa"])
def test_v4_attention_over_index_lists_equals_the_dense_masked_form(kind):
    """The V4 layer's index lists (window + HCA's causal entries or CSA's top-k) name exactly the dense form's
    visible keys, and the sparse op over them (reference and Triton in the interpreter, fp32) gives the dense
    float64 output and gradients to fp32 rounding (calc_diff ~1e-14 seen; 1e-10 flags any missing or extra key)."""
    from models.deepseek_v4.model import (
        attention_rows,
        compressed_visible,
        select_topk,
        sparse_sink_attention,
        window_visible,
    )

    g = torch.Generator().manual_seed(torch.randint(1 << 20, ()).item())
    b, s, h, d, window, ratio, topk = 2, 23, 4, 32, 5, 4, 3
    n = 0 if kind == "window" else s // ratio
    q = torch.randn(b, s, h, d, generator=g)
    kv = torch.randn(b, s + n, d, generator=g)
    sink = torch.randn(h, generator=g)
    dout = torch.randn(b, s, h, d, generator=g)
    causal = compressed_visible(s, n, ratio).expand(b, -1, -1)
    chosen = {"window": None, "hca": causal,
              "csa": select_topk(torch.randn(b, s, n, generator=g).masked_fill(~causal, -math.inf), topk)}[kind]
    rows = attention_rows(s, window, chosen, topk if kind == "csa" else None)
    visible = window_visible(s, window).expand(b, s, s)
    if chosen is not None:
        visible = torch.cat([visible, chosen], dim=-1)
    listed = torch.zeros(b, s, s + n + 1, dtype=torch.int64)
    listed.scatter_add_(-1, torch.where(rows >= 0, rows, s + n).long().expand(b, -1, -1), torch.ones_like(
        rows.expand(b, -1, -1), dtype=torch.int64))
    assert torch.equal(listed[..., :-1] > 0, visible) and listed[..., :-1].max() == 1  # each key once
    q64, kv64, sink64 = (t.double().requires_grad_() for t in (q, kv, sink))
    want = _dense_sink_attention(q64, kv64, visible, sink64, d ** -0.5)
    wants = torch.autograd.grad(want, (q64, kv64, sink64), dout.double())
    for impl in ("reference", "triton"):
        qr, kvr, sinkr = (t.clone().requires_grad_() for t in (q, kv, sink))
        with registry.force(impl), registry.poisoned_outputs():
            out = sparse_sink_attention(qr, kvr, rows, sinkr, d ** -0.5)
            grads = torch.autograd.grad(out, (qr, kvr, sinkr), dout)
        assert registry.get("flash_mla.sparse_sink_attention").last_impl == impl
        for name, got, ref in zip(("out", "dq", "dkv", "dsink"), (out, *grads), (want, *wants)):
            assert calc_diff(got, ref) < 1e-10, f"{impl} {name}: {calc_diff(got, ref)}"


def test_compiles_whole_and_matches_eager():
    """``torch.compile(fullgraph=True)`` (aot_eager: the op's autograd and fake as compile sees them) over the op,
    forward and backward: no graph break, results bitwise eager's (same reference kernels, same order)."""
    q, kv, idx, sink, dout = _case(7, 19, 3, 32, 9, torch.float32, seed=5)
    fn = flash_mla.sparse_sink_attention
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        qr, kvr, sinkr = (t.clone().requires_grad_() for t in (q, kv, sink))
        out = run(qr, kvr, idx, sinkr, 0.3)
        results.append((out, *torch.autograd.grad(out, (qr, kvr, sinkr), dout)))
    for name, got, want in zip(("out", "dq", "dkv", "dsink"), *results):
        assert torch.equal(got, want), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block_h,block_k", [(64, 32), (32, 32), (16, 64), (32, 16), (16, 16)])
def test_triton_gpu_tile_shapes(monkeypatch, block_h, block_k):
    """The tile shapes the GPU configs use (the interpreter otherwise runs 16 x 16 only), with head tiles only
    partly filled (20 heads: the sink of a padded head must not reach dsink) and top-k not a multiple of the key
    tile; fp32, so calc_diff at float64 level."""
    monkeypatch.setattr(kernels, "_INTERP", [(block_h, block_k, 1, 1)])
    monkeypatch.setattr(kernels, "_tuned", {})
    q, kv, idx, sink, dout = _case(5, 40, 20, 48, 37, torch.float32, seed=block_h + block_k)
    qr, kvr, sinkr = (t.clone().requires_grad_() for t in (q, kv, sink))
    with registry.force("triton"), registry.poisoned_outputs():
        out = flash_mla.sparse_sink_attention(qr, kvr, idx, sinkr, 0.15)
        grads = torch.autograd.grad(out, (qr, kvr, sinkr), dout)
    want_out, _, *wants = _want(q, kv, idx, sink, dout, 0.15)
    for name, got, ref in zip(("out", "dq", "dkv", "dsink"), (out, *grads), (want_out, *wants)):
        assert torch.isfinite(got).all() and calc_diff(got, ref) < 1e-10, (name, calc_diff(got, ref))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_sparse_sink_matches_reference_on_gpu():
    """V4-Flash's head (64 heads of 512) on a GPU, every autotune config timed (dkv and dsink accumulators reset
    between trials): out at 1e-5 (bf16 rounding), gradients at 1e-4 (P and dS rounded to bf16 for the tensor
    cores, as every flash backward), against the fp32 reference on the same inputs."""
    device = accel.default_device()
    q, kv, idx, sink, dout = (t.to(device) for t in _case(256, 1024, 64, 512, 640, torch.bfloat16, seed=5))
    qr, kvr, sinkr = (t.clone().requires_grad_() for t in (q, kv, sink))
    with registry.force("triton"), registry.poisoned_outputs():
        out = flash_mla.sparse_sink_attention(qr, kvr, idx, sinkr, 512 ** -0.5)
        grads = torch.autograd.grad(out, (qr, kvr, sinkr), dout)
    want_out, want_lse = sparse_sink_attention_reference(q, kv, idx, sink, 512 ** -0.5)
    wants = sparse_sink_attention_backward_reference(dout, q, kv, idx, sink, want_out, want_lse, 512 ** -0.5)
    assert calc_diff(out, want_out) < 1e-5
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, wants):
        assert calc_diff(got, ref) < 1e-4, (name, calc_diff(got, ref))
    assert (grads[1][torch.isnan(kv[:, 0])] == 0).all()
