"""fused_ops: every fused op (Triton under the interpreter, and its PyTorch reference) against float64 math,
forward and backward, on odd shapes; FP8 outputs bit-equal to DeepGEMM's cast of the stored output.

Tolerances. bf16: the op rounds at the same points as the unfused torch sequence (at most three roundings of
2^-8 relative each, bf16's unit roundoff: residual sum, normalised value, times the weight; or silu, times up,
times the routing weight), so each element is within 3 * 2^-8 relative of float64 math, plus a tiny
absolute term for values that cancel (RoPE's two products: 2^-8 of each product, the products bounded
by |x| |cos|). fp32: only evaluation order and the exp/rsqrt ulps differ; the sums here have <= 384 terms,
so at most 384 * 2^-24 = 2.3e-5 relative: 3e-5. Gradients of bf16 inputs pass through one more rounding
(the stored gradient): 4 * 2^-8; the weight gradients add a sum over rows in fp32, bounded at twice that.
The absolute floor, 2^-6 of the tensor's largest value times the same relative bound, covers elements that
cancel to near zero. A wrong row, column, pair, sign or mask is off by O(1) relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accel import registry
from deep_gemm.reference import per_token_cast_reference
from fused_ops import (
    apply_rope,
    gather_rows,
    grouping,
    pack_rows_fp8,
    permute,
    regroup_rows,
    regroup_rows_fp8,
    rmsnorm,
    rope_,
    route,
    route_softmax,
    swiglu,
    swiglu_fp8,
    unpermute,
)
from fused_ops.ops import route_reference, route_softmax_reference

BF16_REL = 3 * 2.0 ** -8  # bf16 keeps 8 significant bits: unit roundoff 2^-8
GRAD_REL = 4 * 2.0 ** -8
FP32_REL = 3e-5
IMPLS = ["triton", "reference"]


def _rel(dtype: torch.dtype, grad: bool = False) -> float:
    return (GRAD_REL if grad else BF16_REL) if dtype == torch.bfloat16 else FP32_REL


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """|got - want| <= rel * (|want| + 2^-6 * max|want|): relative, with a floor for values that cancel."""
    got, want = got.double(), want.double()
    bound = rel * (want.abs() + 2.0 ** -6 * want.abs().max())
    bad = (got - want).abs() > bound
    assert not bad.any() and got.isfinite().all(), (f"{what}: {int(bad.sum())} of {want.numel()} elements off, worst "
                                                    f"{float(((got - want).abs() / bound).max()):.3g}x the bound")


def _randn(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _grads(fn, *inputs: torch.Tensor, grad_out=None):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads_out = grad_out or [_randn(*o.shape, dtype=o.dtype, seed=99 + i) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, grads_out)
    return [o.detach() for o in outs], [x.grad for x in leaves], grads_out


# ---------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,rows,dim", [(torch.bfloat16, 5, 200), (torch.float32, 3, 384)])
def test_rmsnorm_with_residual_matches_float64(impl, dtype, rows, dim):
    x, r = _randn(2, rows, dim, dtype=dtype, seed=1), _randn(2, rows, dim, dtype=dtype, seed=2, scale=3.0)
    w = (1 + 0.1 * _randn(dim, seed=3)).to(dtype)
    with registry.force(impl):
        (y, h), (gx, gw, gr), (gy, gh) = _grads(lambda a, b, c: tuple(rmsnorm(a, b, c)[:2]), x, w, r)

    def exact(a, b, c):
        hh = a + c
        return F.rms_norm(hh, (dim,), b, 1e-6), hh

    (y64, h64), (gx64, gw64, gr64), _ = _grads(exact, x.double(), w.double(), r.double(),
                                              grad_out=[gy.double(), gh.double()])
    assert y.dtype == h.dtype == dtype and y.shape == x.shape
    _close(h, h64, _rel(dtype), "residual")  # one rounding of the add
    _close(y, y64, _rel(dtype), "y")
    _close(gx, gx64, _rel(dtype, True), "dx")
    torch.testing.assert_close(gx, gr, rtol=0, atol=0)  # x and residual enter as their sum
    _close(gw, gw64, _rel(dtype, True) * 2, "dweight")  # plus a sum over rows in fp32


def test_rmsnorm_fp8_cast_is_deep_gemms_cast_of_the_output():
    x = (_randn(7, 300, seed=4) * torch.exp(_randn(7, 1, seed=5))).to(torch.bfloat16)
    w = (1 + 0.1 * _randn(300, seed=6)).to(torch.bfloat16)
    w[:3] = torch.tensor([124.3, 1e-3, 448.0]) / x[0, :3].float().abs()  # aim y at a carry into the exponent,
    # a subnormal and the largest e4m3 value of its row
    residual = _randn(7, 300, dtype=torch.bfloat16, seed=7)
    for weight in (w, w.float()):  # bf16 output; fp32 output (torch promotes a bf16 x_hat times an fp32 weight)
        with registry.poisoned_outputs(), registry.force("triton"):
            y, h, (q, sf) = rmsnorm(x, weight, residual, fp8=True)
        q_dg, sf_dg = per_token_cast_reference(y)
        assert torch.equal(q.view(torch.uint8), q_dg.view(torch.uint8)) and torch.equal(sf, sf_dg)
        y_ref, h_ref, _ = registry.get("fused_ops.rmsnorm").reference(x, weight, residual)
        assert y.dtype == y_ref.dtype and torch.equal(h, h_ref)
        # the same rounding points: equal but for a rare 1-ulp flip from the fp32 sum of squares' order
        assert (y != y_ref).float().mean() < 0.01
        assert ((y.float() - y_ref.float()).abs() <= y_ref.float().abs() * 2.0 ** -7).all()


def test_rmsnorm_backward_recomputes_from_the_input_only():
    """The saved tensors are the (updated) input and the per-row rstd: no output is kept for backward."""
    x, w = _randn(4, 64, dtype=torch.bfloat16, seed=7).requires_grad_(), torch.ones(64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with registry.force("triton"):
            y = rmsnorm(x, w)
    assert sorted(tuple(t.shape) for t in saved) == [(4,), (4, 64), (64,)]
    assert not any(t.data_ptr() == y.data_ptr() for t in saved)


# ---------------------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,inter,weighted", [(torch.bfloat16, 200, True), (torch.float32, 130, False),
                                                  (torch.bfloat16, 256, False)])
def test_swiglu_matches_float64(impl, dtype, inter, weighted):
    gu = _randn(3, 5, 2 * inter, dtype=dtype, seed=8, scale=2.0)
    wt = torch.rand(3, 5, generator=torch.Generator().manual_seed(9)) if weighted else None
    fn = (lambda a, b: swiglu(a, b)) if weighted else (lambda a: swiglu(a))
    args = (gu, wt) if weighted else (gu,)
    with registry.force(impl):
        (out,), grads, (g,) = _grads(fn, *args)

    def exact(a, b=None):
        gate, up = a.chunk(2, -1)
        o = F.silu(gate) * up
        return o if b is None else o * b.unsqueeze(-1)

    (out64,), grads64, _ = _grads(exact, *(t.double() for t in args), grad_out=[g.double()])
    assert out.dtype == dtype and out.shape == (3, 5, inter)
    _close(out, out64, _rel(dtype), "out")
    _close(grads[0], grads64[0], _rel(dtype, True), "d gate_up")
    if weighted:
        _close(grads[1], grads64[1], 2 * _rel(dtype, True), "d weights")  # a sum over the row in fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_fp8_cast_is_deep_gemms_cast_of_the_output(dtype):
    gu = _randn(6, 2 * 330, dtype=dtype, seed=10, scale=3.0)
    wt = torch.rand(6, generator=torch.Generator().manual_seed(11))
    with registry.poisoned_outputs(), registry.force("triton"):
        q, sf = swiglu_fp8(gu, wt)
        out = swiglu(gu, wt)  # the unquantised kernel, same rounding points
    q_dg, sf_dg = per_token_cast_reference(out)
    assert torch.equal(q.view(torch.uint8), q_dg.view(torch.uint8)) and torch.equal(sf, sf_dg)
    ref = registry.get("fused_ops.swiglu").reference(gu, wt)
    if dtype == torch.bfloat16:  # the same rounding points: a rare 1-ulp exp difference may flip one
        assert (out != ref).float().mean() < 0.01
    else:  # fp32: exp within a few ulps
        torch.testing.assert_close(out, ref, rtol=4 * 2.0 ** -23, atol=1e-30)


# ---------------------------------------------------------------------------------------------- RoPE


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """float64 rotation through complex numbers (interleaved) or the rotate-half formula (halves)."""
    c, s = cos[None, :, None].double(), sin[None, :, None].double()
    if interleaved:
        z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    x0, x1 = x.double().chunk(2, -1)
    return torch.cat([x0, x1], -1) * torch.cat([c, c], -1) + torch.cat([-x1, x0], -1) * torch.cat([s, s], -1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_in_place_on_a_strided_view_matches_float64(impl, interleaved, dtype):
    from models.deepseek_v3.args import ModelArgs
    from models.deepseek_v3.rope import rope_cos_sin

    args = ModelArgs(qk_rope_head_dim=64, rope_factor=40.0, original_seq_len=4, mscale=1.0,
                     mscale_all_dim=0.8)  # YaRN on, with a cos/sin scale != 1
    cos, sin = rope_cos_sin(args, torch.arange(5) * 3)
    q = _randn(2, 5, 3, 128 + 64, dtype=dtype, seed=12)  # MLA's query head: 128 nope dims, then 64 rotary
    with registry.force(impl):
        leaf = q.clone().requires_grad_()
        full = leaf * 1  # a non-leaf to modify in place
        rope_(full[..., 128:], cos, sin, interleaved)
        g = _randn(*q.shape, dtype=dtype, seed=13)
        full.backward(g)
    want = _rope64(q[..., 128:], cos, sin, interleaved)
    assert torch.equal(full[..., :128].detach(), q[..., :128])
    _close(full[..., 128:].detach(), want, _rel(dtype), "rotated")
    # backward: the transpose (inverse) rotation of the gradient; the nope part passes through
    _close(leaf.grad[..., 128:], _rope64(g[..., 128:], cos, -sin, interleaved), _rel(dtype, True), "grad")
    assert torch.equal(leaf.grad[..., :128], g[..., :128])


def test_apply_rope_matches_the_models_rotation():
    from models.deepseek_v3.args import ModelArgs
    from models.deepseek_v3.rope import apply_rotary_emb, rope_cos_sin

    cos, sin = rope_cos_sin(ModelArgs(qk_rope_head_dim=64), torch.arange(7))
    x = _randn(2, 7, 5, 64, dtype=torch.bfloat16, seed=14)
    with registry.force("triton"):
        got = apply_rope(x, cos, sin)
    want = apply_rotary_emb(x, cos, sin)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 2.0 ** -12).all()


# ---------------------------------------------------------------------------------------------- permute


def _layout(tokens: int, k: int, experts: int, seed: int):
    indices = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed)).topk(k, -1).indices
    return indices, grouping(indices, experts, 8)


def test_grouping_matches_the_models_permute():
    from models.deepseek_v3.permute import permute as model_permute

    indices, layout = _layout(11, 3, 5, seed=15)
    x = _randn(11, 16, seed=16)
    x_grouped, m_indices, state = model_permute(x, indices, 5, 8)
    assert torch.equal(layout.rows, state.rows) and torch.equal(layout.m_indices, m_indices)
    with registry.force("triton"):
        got, _, _ = permute(x, layout)
    assert torch.equal(got, x_grouped)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_permute_and_weighted_unpermute_match_float64(impl, dtype):
    indices, layout = _layout(9, 3, 4, seed=17)
    x = _randn(9, 200, dtype=dtype, seed=18)
    w = torch.rand(9, 3, generator=torch.Generator().manual_seed(19))

    def fused(a, b):
        grouped, _, gw = permute(a, layout, b)
        return unpermute(grouped * 2, layout, b), gw

    def exact(a, b):
        rows = a[torch.arange(27) // 3]  # assignment t * k + j is token t's
        gw = torch.zeros(layout.assign.numel(), dtype=b.dtype).index_put((layout.rows,), b.reshape(-1))
        return (2 * rows.view(9, 3, -1) * b.unsqueeze(-1)).sum(1), gw

    with registry.force(impl):
        (y, gw), (gx, gwt), grads = _grads(fused, x, w)
    (y64, gw64), (gx64, gwt64), _ = _grads(exact, x.double(), w.double(), grad_out=[g.double() for g in grads])
    _close(y, y64, 2 * _rel(dtype), "unpermuted")  # weight rounded to dtype, then the fp32 sum rounded
    assert torch.equal(gw.double(), gw64)
    _close(gx, gx64, 2 * _rel(dtype, True), "dx")
    _close(gwt, gwt64, 2 * _rel(dtype, True), "d weights")


def test_permute_fp8_moves_values_with_their_scales_and_casts_like_deep_gemm():
    indices, layout = _layout(6, 2, 3, seed=20)
    x = _randn(6, 300, dtype=torch.bfloat16, seed=21) * torch.exp(_randn(6, 1, seed=22))
    w = torch.rand(6, 2, generator=torch.Generator().manual_seed(23))
    with registry.poisoned_outputs(), registry.force("triton"):
        q, sf, gw = permute(x, layout, w, fp8=True)
        plain, _, _ = permute(x, layout)
        xq, xs = per_token_cast_reference(x)
        q2, sf2, gw2 = permute(xq, layout, w, scales=xs)
    q_dg, sf_dg = per_token_cast_reference(plain)  # pad rows included: zeros, scale 1e-4 / 448
    assert torch.equal(q.view(torch.uint8), q_dg.view(torch.uint8)) and torch.equal(sf, sf_dg)
    real = layout.assign >= 0
    assert torch.equal(q2.view(torch.uint8)[real], q_dg.view(torch.uint8)[real])  # a row's cast is the token's
    assert torch.equal(sf2[real], sf_dg[real]) and torch.equal(gw, gw2)
    assert torch.equal(gw[real], w.reshape(-1)[layout.assign[real]]) and not gw[~real].any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,columns", [(torch.bfloat16, 2), (torch.float32, 1)])
def test_gather_rows_and_regroup_rows_match_float64(impl, dtype, columns):
    """Expert parallelism's row movements: 7 tokens x top-3 with 4 assignments dropped, the rest sent in a
    shuffled order with per-assignment columns, then regrouped with padding. Forward values are copies (exact);
    the backward sums a token's up to 3 row gradients in fp32 and rounds once: within 2 roundings of float64
    (the gradient's own, and the sum's), the columns' and the regrouped gradients are copies again (exact)."""
    g = torch.Generator().manual_seed(30)
    tokens, k, dim = 7, 3, 200
    x = _randn(tokens, dim, dtype=dtype, seed=31)
    cols = _randn(tokens * k, columns, dtype=dtype, seed=32)
    assign = torch.randperm(tokens * k, generator=g)[:tokens * k - 4]  # sent row -> assignment; 4 never sent
    inverse = torch.full((tokens * k,), -1).index_put_((assign,), torch.arange(len(assign)))
    regroup = torch.randperm(len(assign) + 1, generator=g)  # arrival row of each grouped row, -1 = padding
    regroup = torch.cat([regroup[:8], torch.tensor([-1, -1]), regroup[8:]])
    regroup = torch.where(regroup == len(assign), -1, regroup)  # the spare row of the arrivals: padding too
    back = torch.full((len(assign) + 1,), -1).index_put_((regroup[regroup >= 0],), torch.nonzero(regroup >= 0)[:, 0])

    def fused(a, c):
        sent = gather_rows(a, assign, inverse, k, c)
        landed = torch.cat([sent, torch.zeros(1, sent.shape[1], dtype=sent.dtype)])  # + the spare zero row
        return regroup_rows(landed, dim, regroup, back)

    def exact(a, c):
        real = (regroup >= 0).unsqueeze(-1)
        a_rows = torch.cat([a[assign // k], torch.zeros(1, dim, dtype=a.dtype)])[regroup]
        w = torch.cat([c[assign].sum(1), torch.zeros(1, dtype=c.dtype)])[regroup]
        return torch.where(real, a_rows, 0), torch.where(real[:, 0], w, 0)

    with registry.poisoned_outputs(), registry.force(impl):
        (got, got_w), (gx, gc), grads = _grads(fused, x, cols)
    (want, want_w), (gx64, gc64), _ = _grads(exact, x.double(), cols.double(), grad_out=[g.double() for g in grads])
    assert torch.equal(got.double(), want) and got_w.dtype == torch.float32
    _close(got_w, want_w, 0.0 if columns == 1 else 2.0 ** -24, "weights")  # two columns summed: one fp32 rounding
    _close(gx, gx64, 2 * _rel(dtype, True), "dx")
    # each column's gradient is the weight's, rounded once to the rows' dtype (pads and dropped slots: 0)
    _close(gc, gc64, 2.0 ** -8 if dtype == torch.bfloat16 else 0.0, "d columns")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_travel_packed_and_land_with_the_gemms_cast(dtype):
    """Expert parallelism's FP8 dispatch, fused: the sender's wire (gather + cast in one kernel, or the producer's
    precast moved) is byte for byte today's (gather, then DeepGEMM's cast, then the bytes concatenated); the
    receiver's grouped rows are today's dequantisation (bit for bit) and the cast it hands the grouped GEMM is
    DeepGEMM's cast of those rows (bit for bit, padding rows aside: the GEMM skips them). Tiles: six decades of
    magnitudes, an all-zero row and rows at the 1e-4 amax floor."""
    from models.deepseek_v3.expert_parallel import _pack_fp8, _unpack_fp8

    g = torch.Generator().manual_seed(40)
    tokens, k, dim = 7, 3, 300
    x = _randn(tokens, dim, seed=41) * torch.exp(_randn(tokens, 1, seed=42) * 3)
    x[0], x[1] = 0.0, x[1] / x[1].abs().max() * 0.97e-4  # the amax floor: all zero, and just below 1e-4
    x = x.to(dtype)
    cols = _randn(tokens * k, 2 if dtype == torch.bfloat16 else 1, dtype=dtype, seed=43)
    assign = torch.randperm(tokens * k, generator=g)[:tokens * k - 2]
    inverse = torch.full((tokens * k,), -1).index_put_((assign,), torch.arange(len(assign)))
    regroup = torch.cat([torch.randperm(len(assign), generator=g), torch.tensor([-1, -1, -1])])
    back = torch.full((len(assign) + 1,), -1).index_put_((regroup[regroup >= 0],), torch.nonzero(regroup >= 0)[:, 0])
    with registry.poisoned_outputs(), registry.force("triton"):
        send, wire = pack_rows_fp8(x, assign, inverse, k, cols)
        _, moved = pack_rows_fp8(x, assign, inverse, k, cols, x_fp8=per_token_cast_reference(x))
        landed = torch.zeros((), dtype=dtype).expand(len(assign) + 1, dim + cols.shape[1])
        grouped, weights, (q, sf) = regroup_rows_fp8(landed, wire, dim, regroup, back)
        standin, weights2, (q2, sf2) = regroup_rows_fp8(landed, wire, dim, regroup, back, keep_rows=False)
    assert standin.shape == grouped.shape and standin.untyped_storage().nbytes() <= 4  # the cast only (fp8_cache)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sf2, sf)
    assert torch.equal(weights2, weights)
    today = torch.cat([_pack_fp8(x[assign // k]), cols[assign].view(torch.uint8)], dim=1)
    assert wire.shape[1] % 16 == 0 and not wire[:, today.shape[1]:].any()  # rows padded to 16 bytes with zeros
    assert torch.equal(wire[:, :today.shape[1]], today) and torch.equal(moved, wire)
    assert send.shape == (len(assign), dim + cols.shape[1]) and send.untyped_storage().nbytes() <= 4
    real = regroup >= 0
    rows = _unpack_fp8(today, dim, dtype)
    assert torch.equal(grouped[real], rows[regroup[real]]) and not grouped[~real].any()
    assert torch.equal(weights[real], cols[assign].float().sum(1)[regroup[real]]) and not weights[~real].any()
    q_dg, sf_dg = per_token_cast_reference(grouped)
    assert torch.equal(q.view(torch.uint8)[real], q_dg.view(torch.uint8)[real]) and torch.equal(sf[real], sf_dg[real])
    # Why the receiver casts again (in registers) rather than hand on the e4m3 that landed: the landed codes are
    # that same cast except where a tile's amax sits just below the 1e-4 floor (its dequantised amax can round
    # up past it); there the GEMM's cast of the dequantised rows has other scales. Token 1 is such a row.
    sent_q, sent_sf = _pack_fp8(x[assign // k])[regroup[real]].split([dim, sf.shape[1] * 4], dim=1)
    sent_sf = sent_sf.contiguous().view(torch.float32)
    differs = (sent_q != q[real].view(torch.uint8)).any(1) | (sent_sf != sf[real]).any(1)
    assert set((assign[regroup[real]] // k)[differs].tolist()) == ({1} if dtype == torch.bfloat16 else set())


# ---------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("experts,k,groups,topk_groups,node_limit", [
    (64, 8, 8, 4, None), (24, 6, 3, 2, None), (16, 2, 1, 1, None),
    (24, 4, 1, 1, (6, 2)),  # node limit alone: 6 nodes of 4, each token on <= 2 (node score: top-2 sum)
    (32, 6, 4, 3, (8, 3)),  # after the group limit, nodes finer than groups (the top-2 sum of 4 experts)
    (30, 6, 2, 1, (5, 2)),  # nodes of 6 across groups of 15: a node straddling a losing group scores -inf
    (64, 8, 8, 4, (8, 4)),  # V3's shape: nodes = groups, max_nodes = topk_groups (the limits coincide)
])
def test_route_matches_the_models_gate(impl, experts, k, groups, topk_groups, node_limit):
    from models.deepseek_v3.args import ModelArgs
    from models.deepseek_v3.moe import Gate

    args = ModelArgs(dim=32, n_routed_experts=experts, n_activated_experts=k, n_expert_groups=groups,
                     n_limited_groups=topk_groups, route_scale=2.5, score_func="sigmoid")
    gate = Gate(args)
    gate.reset_parameters(0.3)
    gate.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(24))
    x = _randn(13, 32, seed=25)
    want = gate(x.double().float(), node_limit)
    logits = want.logits.detach().clone().requires_grad_()
    nodes, max_nodes = node_limit or (1, None)
    with registry.poisoned_outputs(), registry.force(impl):
        weights, indices, scores = route(logits, gate.e_score_correction_bias, k, groups, topk_groups, 2.5,
                                         nodes=nodes, max_nodes=max_nodes)
    assert torch.equal(indices, want.indices)
    if node_limit is not None:  # no token beyond max_nodes nodes; the limit bites unless it is the group limit
        per_node = experts // nodes
        assert max(len(set((row // per_node).tolist())) for row in indices) <= max_nodes
        unlimited = gate(x.double().float(), None).indices
        assert torch.equal(unlimited, indices) == (nodes == groups and max_nodes == topk_groups and k // max_nodes == 2)
    torch.testing.assert_close(scores, want.scores, rtol=2 ** -22, atol=0)
    torch.testing.assert_close(weights, want.weights, rtol=4 * 2 ** -23, atol=0)
    gw, gs = _randn(13, k, seed=26), _randn(13, experts, seed=27)
    torch.autograd.backward([weights, scores], [gw, gs])
    logits64 = want.logits.detach().double().requires_grad_()
    s64 = logits64.sigmoid()
    picked = s64.gather(1, indices)
    w64 = picked / picked.sum(-1, keepdim=True) * 2.5
    torch.autograd.backward([w64, s64], [gw.double(), gs.double()])
    _close(logits.grad, logits64.grad, FP32_REL, "d logits")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("experts,k,groups,topk_groups,norm,node_limit", [
    (64, 6, 8, 3, True, None),  # V2's shape scaled down: 8 groups, 3 kept, group score = its largest
    (24, 6, 1, 1, False, None),  # V2-Lite: no groups, weights not normalised
    (30, 4, 3, 2, False, (5, 2)),  # a node limit (nodes of 6 across groups of 10)
])
def test_route_softmax_matches_the_models_gate(impl, experts, k, groups, topk_groups, norm, node_limit):
    """The softmax-scored gate (no bias). Scores: a softmax's fp32 evaluation order and exp differ by a few ulps
    (2^-21 relative); weights add the normalisation (4 ulps); the logits' gradient as the sigmoid router's."""
    from models.deepseek_v3.args import ModelArgs
    from models.deepseek_v3.moe import Gate

    args = ModelArgs(dim=32, n_routed_experts=experts, n_activated_experts=k, n_expert_groups=groups,
                     n_limited_groups=topk_groups, route_scale=1.5, score_func="softmax", norm_topk_prob=norm)
    gate = Gate(args)
    gate.reset_parameters(0.3)
    x = _randn(13, 32, seed=28)
    want = gate(x, node_limit)
    logits = want.logits.detach().clone().requires_grad_()
    nodes, max_nodes = node_limit or (1, None)
    with registry.poisoned_outputs(), registry.force(impl):
        weights, indices, scores = route_softmax(logits, k, groups, topk_groups, 1.5, norm, nodes, max_nodes)
    assert torch.equal(indices, want.indices)
    torch.testing.assert_close(scores, want.scores, rtol=2 ** -21, atol=0)
    torch.testing.assert_close(weights, want.weights, rtol=8 * 2 ** -23, atol=0)
    gw, gs = _randn(13, k, seed=29), _randn(13, experts, seed=30)
    torch.autograd.backward([weights, scores], [gw, gs])
    logits64 = want.logits.detach().double().requires_grad_()
    s64 = logits64.softmax(-1)
    picked = s64.gather(1, indices)
    w64 = (picked / picked.sum(-1, keepdim=True) if norm else picked) * 1.5
    torch.autograd.backward([w64, s64], [gw.double(), gs.double()])
    _close(logits.grad, logits64.grad, FP32_REL, "d logits")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softmax", [False, True], ids=["sigmoid", "softmax"])
def test_route_ranks_a_nan_score_first_as_torch_topk(impl, softmax):
    """A NaN logit (a NaN gate weight or activation) reaches the routing weights as NaN, and so the loss, where a
    run's NaN guard sees it: every top-k slot still names a real expert, distinct within the token (never one past
    the last, which the permute would turn into an out-of-range group). Sigmoid: the NaN expert is taken first,
    as ``torch.topk`` ranks NaN, through group and node limits; softmax: one NaN makes the token's scores all NaN.
    Rows without NaN: the reference's choice."""
    experts, k, groups, topk_groups, nodes, max_nodes = 24, 4, 3, 2, 6, 3
    logits = _randn(6, experts, seed=31)
    logits[1, 5] = float("nan")
    logits[3] = float("nan")
    bias = _randn(experts, seed=32, scale=0.1)
    args = (k, groups, topk_groups, 2.5, True, nodes, max_nodes)
    with registry.poisoned_outputs(), registry.force(impl):
        weights, indices, _ = route_softmax(logits, *args) if softmax else route(logits, bias, *args)
    want_w, want_i, _ = (route_softmax_reference(logits, *args) if softmax
                         else route_reference(logits, bias, *args))
    nan_rows = torch.tensor([False, True, False, True, False, False])
    assert ((indices >= 0) & (indices < experts)).all()
    assert all(len(set(row.tolist())) == k for row in indices)
    assert weights[nan_rows].isnan().all() and want_w[nan_rows].isnan().all()
    assert torch.equal(indices[~nan_rows], want_i[~nan_rows]) and weights[~nan_rows].isfinite().all()
    if not softmax:
        assert 5 in indices[1].tolist() and 5 in want_i[1].tolist()


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="rmsnorm: weight must be"):
        rmsnorm(torch.randn(2, 8), torch.ones(4))
    with pytest.raises(ValueError, match="swiglu: gate_up's last dim must be even"):
        swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="rope: cos and sin must be"):
        rope_(torch.randn(1, 2, 3, 8), torch.randn(2, 3), torch.randn(2, 3))
    _, layout = _layout(4, 2, 3, seed=0)
    with pytest.raises(ValueError, match="permute: x must be"):
        permute(torch.randn(5, 8), layout)
    with pytest.raises(ValueError, match="grouping: indices must be"):
        grouping(torch.rand(3, 2), 4, 8)
