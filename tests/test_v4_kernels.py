"""DeepSeek-V4's fused ops (fused_ops.sinkhorn, gated_pool, indexer_logits): reference and Triton kernel (in the
interpreter), forward and backward, against float64 math written out here independently of both (plain loops
over windows and steps), and the V4 model with the kernels equal to the model with the references.

Every kernel output is NaN-poisoned before the launch (``registry.poisoned_outputs``), shapes vary around the
tiles (odd widths, partial blocks, one entry, HCA's 128-token windows) and inputs are fresh per run. Tolerances:
fp32 runs differ from float64 by fp32 rounding of reordered sums only (calc_diff ~1e-14 seen; 1e-10 flags any
wrong weight, mask or step); bf16 ones by the rounding points each docstring names, each within the unit
roundoff u = 2^-8 relative: k roundings give calc_diff <= (k u)^2 / 2.
"""

from __future__ import annotations

import math

import pytest
import torch

import fused_ops
from accel import registry
from models.deepseek_v4 import ModelArgs, Transformer
from models.deepseek_v4.indexer_loss import indexer_loss
from verifier import verify
from verifier.verify import calc_diff

U_BF16 = 2.0 ** -8


def _bf16_bound(roundings: int) -> float:
    return (roundings * U_BF16) ** 2 / 2


def _fresh_seed() -> int:
    return int(torch.randint(1 << 30, ()))


def _run(impl, fn, inputs, grad):
    """``fn`` on clones of ``inputs`` under ``impl`` with poisoned outputs: (out, input gradients)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    with registry.force(impl), registry.poisoned_outputs():
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad)
    return out, grads


# ------------------------------------------------------------------------------------------------ Sinkhorn
def _sinkhorn64(z, eps, iters):
    x = torch.softmax(z.double(), dim=-1) + eps
    for s in range(2 * iters - 1):
        x = x / (x.sum(dim=-2 if s % 2 == 0 else -1, keepdim=True) + eps)
    return x


@pytest.mark.parametrize("tokens,hc,eps,iters", [(70, 4, 1e-6, 20), (3, 4, 1e-6, 20), (65, 2, 1e-2, 3),
                                                 (16, 8, 1e-4, 1)])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_sinkhorn_matches_float64(impl, tokens, hc, eps, iters):
    """Forward and the logits' gradient through every step (the kernel recomputes the states) in fp32."""
    g = torch.Generator().manual_seed(_fresh_seed())
    z = torch.randn(2, tokens, hc, hc, generator=g) * 3  # spread: far from uniform matrices
    dy = torch.randn(z.shape, generator=g)
    z64 = z.double().requires_grad_()
    want = _sinkhorn64(z64, eps, iters)
    (want_dz,) = torch.autograd.grad(want, z64, dy.double())
    out, (dz,) = _run(impl, lambda t: fused_ops.sinkhorn(t, eps, iters), [z], dy)
    assert registry.get("fused_ops.sinkhorn_backward").last_impl == impl
    assert out.dtype == dz.dtype == torch.float32 and out.shape == z.shape
    assert torch.isfinite(out).all() and torch.isfinite(dz).all()
    assert calc_diff(out, want) < 1e-10 and calc_diff(dz, want_dz) < 1e-10, (calc_diff(out, want),
                                                                              calc_diff(dz, want_dz))


# ------------------------------------------------------------------------------------------------ gated pool
def _pool64(kv, score, ape, m, overlap):
    """Entry by entry: its window's rows listed explicitly (Ca of window i-1, then Cb of window i), softmax of
    score + ape down the rows, pooled; float64."""
    b, t, cd = kv.shape
    n, d = t // m, cd // (2 if overlap else 1)
    entries = []
    for i in range(n):
        rows_kv, rows_s = [], []
        if overlap and i > 0:
            rows_kv.append(kv[:, (i - 1) * m:i * m, :d])
            rows_s.append(score[:, (i - 1) * m:i * m, :d] + ape[:, :d])
        rows_kv.append(kv[:, i * m:(i + 1) * m, cd - d:])
        rows_s.append(score[:, i * m:(i + 1) * m, cd - d:] + ape[:, cd - d:])
        w = torch.softmax(torch.cat(rows_s, dim=1).double(), dim=1)
        entries.append((w * torch.cat(rows_kv, dim=1).double()).sum(dim=1))
    return torch.stack(entries, dim=1)


POOL_CASES = [  # (b, n, m, d, dtype)
    (2, 5, 4, 40, torch.float32),     # CSA, a partial 32-column block
    (1, 1, 4, 16, torch.float32),     # one entry: only its Cb rows
    (1, 3, 128, 24, torch.float32),   # HCA's 128-token windows
    (2, 3, 4, 64, torch.bfloat16),
    (1, 2, 128, 33, torch.bfloat16),
]


@pytest.mark.parametrize("b,n,m,d,dtype", POOL_CASES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_gated_pool_matches_float64(impl, b, n, m, d, dtype):
    """Forward and the gradients of kv, score and ape. kv and score of the rows no entry reads (the last
    window's Ca, with overlap) are NaN: reading one shows; their gradient must be exactly 0. bf16: the weights,
    each product and the entry are rounded to bf16 (3 roundings), the gradients once."""
    overlap = m == 4
    cd = d * (2 if overlap else 1)
    g = torch.Generator().manual_seed(_fresh_seed())
    kv = torch.randn(b, n * m, cd, generator=g).to(dtype)
    score = (torch.randn(b, n * m, cd, generator=g) * 2).to(dtype)
    ape = torch.randn(m, cd, generator=g)
    if overlap:
        kv[:, -m:, :d], score[:, -m:, :d] = math.nan, math.nan
    dout = torch.randn(b, n, d, generator=g).to(dtype)
    ins64 = [t.double().requires_grad_() for t in (kv, score, ape)]
    want = _pool64(*ins64, m, overlap)
    wants = torch.autograd.grad(want, ins64, dout.double())
    out, grads = _run(impl, lambda *t: fused_ops.gated_pool(*t, m, overlap), [kv, score, ape], dout)
    assert registry.get("fused_ops.gated_pool_backward").last_impl == impl
    assert out.dtype == dtype and out.shape == (b, n, d)
    tol_out, tol_grad = (1e-10, 1e-10) if dtype == torch.float32 else (_bf16_bound(3), _bf16_bound(2))
    assert calc_diff(out, want) < tol_out, calc_diff(out, want)
    for name, got, ref in zip(("dkv", "dscore", "dape"), grads, wants):
        if overlap:
            ref = ref.nan_to_num(0.0)  # float64 autograd of 0 * NaN; the rows no entry reads get no gradient
        assert torch.isfinite(got).all(), name
        assert calc_diff(got, ref) < tol_grad, (name, calc_diff(got, ref))
    if overlap:
        assert (grads[0][:, -m:, :d] == 0).all() and (grads[1][:, -m:, :d] == 0).all()


# ------------------------------------------------------------------------------------------------ indexer logits
def _index64(q, k, w, ratio, scale):
    s, n = q.shape[1], k.shape[1]
    logits = torch.einsum("bshd,bnd->bshn", q.double(), k.double())
    scores = (torch.clamp(logits, min=0) * w.double()[..., None]).sum(2) * scale
    closed = (torch.arange(n)[None, :] + 1) * ratio - 1 <= torch.arange(s)[:, None]  # entry w closed by token t
    return scores.masked_fill(~closed, -math.inf), closed


INDEX_CASES = [  # (b, s, h, d, ratio, dtype)
    (2, 37, 5, 24, 4, torch.float32),   # s not a multiple of ratio, d padded to 32, 5 heads
    (1, 70, 3, 128, 4, torch.bfloat16),  # V4's 128-wide indexer head
    (1, 9, 2, 16, 4, torch.float32),    # fewer entries than a tile
    (1, 40, 2, 16, 8, torch.float32),   # another ratio
]


@pytest.mark.parametrize("b,s,h,d,ratio,dtype", INDEX_CASES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_indexer_logits_match_float64(impl, b, s, h, d, ratio, dtype):
    """Scores (exactly -inf where the entry's window has not closed) and the gradients of q, k and the head
    weights; the gradient given at -inf positions is NaN and must not leak. bf16: fp32 products of bf16 inputs
    (exact) for the scores; the backward's g rounded to bf16 and dq, dk rounded (2 roundings)."""
    g = torch.Generator().manual_seed(_fresh_seed())
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s // ratio, d, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g) * h ** -0.5
    scale = d ** -0.5
    ins64 = [t.double().requires_grad_() for t in (q, k, w)]
    want, closed = _index64(*ins64, ratio, scale)
    dout = torch.randn(want.shape, generator=g).masked_fill(~closed, math.nan)
    wants = torch.autograd.grad(want, ins64, dout.double().nan_to_num(0.0))
    out, grads = _run(impl, lambda *t: fused_ops.indexer_logits(*t, ratio, scale), [q, k, w], dout)
    assert registry.get("fused_ops.indexer_logits_backward").last_impl == impl
    assert out.dtype == torch.float32 and torch.equal(torch.isinf(out), ~closed.expand_as(out))
    assert (out[torch.isinf(out)] < 0).all()
    assert calc_diff(out[closed.expand_as(out)], want[closed.expand_as(want)]) < 1e-10
    tol = 1e-10 if dtype == torch.float32 else _bf16_bound(2)
    for name, got, ref in zip(("dq", "dk", "dweights"), grads, wants):
        assert torch.isfinite(got).all(), name
        assert calc_diff(got, ref) < tol, (name, calc_diff(got, ref))


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call,match", [
    (lambda: fused_ops.sinkhorn(torch.zeros(3, 4, 4, dtype=torch.float64), 1e-6, 20), "must be float32"),
    (lambda: fused_ops.sinkhorn(torch.zeros(3, 4, 3), 1e-6, 20), r"\[\.\.\., hc, hc\]"),
    (lambda: fused_ops.sinkhorn(torch.zeros(3, 4, 4), 1e-6, 0), "iters must be >= 1"),
    (lambda: fused_ops.gated_pool(torch.zeros(1, 6, 8), torch.zeros(1, 6, 8), torch.zeros(4, 8), 4, True),
     "multiple of ratio"),
    (lambda: fused_ops.gated_pool(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), torch.zeros(4, 4), 4, True),
     "ape must be"),
    (lambda: fused_ops.indexer_logits(torch.zeros(1, 8, 2, 16), torch.zeros(1, 2, 8), torch.zeros(1, 8, 2), 4, 1.0),
     "k must be"),
    (lambda: fused_ops.indexer_logits(torch.zeros(1, 8, 2, 16), torch.zeros(1, 2, 16),
                                      torch.zeros(1, 8, 2, dtype=torch.bfloat16), 4, 1.0), "weights must be float32"),
])
def test_bad_inputs_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_model_with_the_kernels_equals_the_references():
    """The debug V4 model (CSA with its indexer, HCA, a window-only MTP block; 4 mHC streams, 3 Sinkhorn
    iterations to keep the interpreter's time down) over 136 tokens (HCA's first entry closes): logits, every
    parameter's gradient and the indexer's loss gradient with every kernel op Triton (interpreted) equal the run
    with the references, fp32: the same math in other summation orders through 6 sublayers
    (calc_diff ~1e-12 seen; 1e-8 still flags any wrong entry, weight or step)."""
    torch.manual_seed(_fresh_seed() % 1000)
    model = Transformer(ModelArgs.preset("debug_v4", vocab_size=64, n_layers=2, compress_ratios=(4, 128, 0),
                                         index_n_heads=4, hc_sinkhorn_iters=3, init_std=0.1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 64, (1, 136))
    csa = model.layers[0].attn
    runs = {}
    for impl in ("reference", "triton"):
        model.zero_grad(set_to_none=True)
        with registry.force(impl):
            logits, mtp = model(tokens, return_mtp=True)
            (logits.square().mean() + mtp[0].square().mean()).backward()  # training mode: with the indexer's KL
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            x = torch.randn(1, 136, model.args.dim, generator=torch.Generator().manual_seed(3))
            loss = indexer_loss(csa, x, model.angles(136, "cpu")[True], sparse=False)
            # .grad, not autograd.grad: the FP8-capable Linear's weight gradient is accumulated (accel.grads)
            csa.indexer.zero_grad(set_to_none=True)
            loss.backward()
            index_grads = [p.grad for p in csa.indexer.parameters()]
        for name in ("fused_ops.sinkhorn_backward", "fused_ops.gated_pool_backward",
                     "fused_ops.indexer_logits_backward"):
            assert registry.get(name).last_impl == impl, name
        runs[impl] = (logits, mtp[0], loss, *index_grads, *grads)
    for i, (got, want) in enumerate(zip(*runs.values(), strict=True)):
        assert torch.isfinite(got).all() and calc_diff(got, want) < 1e-8, (i, calc_diff(got, want))


# ------------------------------------------------------------------------------------------------ torch.compile
def _compile_cases():
    g = torch.Generator().manual_seed(7)
    yield "sinkhorn", lambda z: fused_ops.sinkhorn(z, 1e-6, 20), [torch.randn(2, 5, 4, 4, generator=g)]
    kv, score = torch.randn(2, 12, 16, generator=g), torch.randn(2, 12, 16, generator=g)
    yield "gated_pool", lambda a, b, c: fused_ops.gated_pool(a, b, c, 4, True), [kv, score,
                                                                                  torch.randn(4, 16, generator=g)]
    q, k, w = torch.randn(2, 13, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g), torch.randn(2, 13, 3,
                                                                                                     generator=g)
    yield "indexer_logits", lambda a, b, c: fused_ops.indexer_logits(a, b, c, 4, 0.25), [q, k, w]


@pytest.mark.parametrize("name,fn,inputs", list(_compile_cases()), ids=[c[0] for c in _compile_cases()])
def test_compiles_whole_and_matches_eager(name, fn, inputs):
    """``torch.compile(fullgraph=True)`` (aot_eager: the ops' fake and autograd as compile sees them), forward and
    backward: no graph break, results bitwise eager's (the same reference operators in the same order)."""
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = run(*leaves)
        grad = torch.ones_like(out).masked_fill(torch.isinf(out), 0.0)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want), name


V4_OPS = ["fused_ops.sinkhorn", "fused_ops.sinkhorn_backward", "fused_ops.gated_pool", "fused_ops.gated_pool_backward",
          "fused_ops.indexer_logits", "fused_ops.indexer_logits_backward", "flash_mla.sparse_sink_decode"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", V4_OPS)
def test_kernels_at_v4_flash_shapes_on_gpu(name):
    """Each kernel compiled for the GPU at its first V4-Flash bench shape, against its reference under the op's
    VerifySpec tolerance (the interpreter above checks the same code at small shapes only)."""
    op = registry.get(name)
    [result] = verify.verify_op(name, shapes=op.verify.bench_shapes[:1], seeds=[1], bench=False)
    assert result.passed, result.reason
