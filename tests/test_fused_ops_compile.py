"""Each public fused op compiles whole: ``torch.compile(fullgraph=True)`` (which raises on any graph break) of its
forward and backward on the CPU, through the custom ops' fake implementations and registered autograd, gives
eager's outputs and gradients bit for bit.

Backend ``aot_eager``: dynamo's capture and AOTAutograd's trace (fake tensors, functionalisation, the joint
graph) without Inductor's code generation, so the traced graph runs the same aten ops as eager in the same
order: bit-equality is the expectation, not a tolerance. The reference path (the suite's default on the CPU).
"""

from __future__ import annotations

import pytest
import torch

import fused_ce
import fused_ops


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _run(fn, inputs: list, compiled: bool):
    torch._dynamo.reset()
    f = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    leaves = _leaves(*inputs)
    outs = f(*leaves)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if isinstance(o, torch.Tensor)]
    loss = sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum()
               for o in outs if o.requires_grad)
    grads = []
    if isinstance(loss, torch.Tensor):
        diff = [t for t in leaves if t is not None and t.requires_grad]
        grads = torch.autograd.grad(loss, diff, allow_unused=True)
    return [o.detach() for o in outs], grads


def _layout(tokens: int, k: int, experts: int, seed: int) -> fused_ops.Grouping:
    indices = torch.stack([torch.randperm(experts, generator=_gen(seed + t))[:k] for t in range(tokens)])
    return fused_ops.grouping(indices, experts, alignment=4)


def _cases():
    g = _gen(0)
    x = torch.randn(2, 5, 96, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(96, generator=g)).bfloat16()
    r = torch.randn(2, 5, 96, generator=g).bfloat16()
    yield "rmsnorm", lambda x, w: fused_ops.rmsnorm(x, w), [x, w]
    yield "rmsnorm+residual", lambda x, w, r: fused_ops.rmsnorm(x, w, r)[:2], [x, w, r]
    yield "rmsnorm_fp8", lambda x, w, r: (lambda o: (o.y, o.residual, *o.fp8))(fused_ops.rmsnorm(x, w, r, fp8=True)), \
        [x, w, r]
    gu = torch.randn(6, 2 * 130, generator=g) * 2
    rw = torch.rand(6, generator=g)
    yield "swiglu", lambda gu, rw: fused_ops.swiglu(gu, rw), [gu, rw]
    yield "swiglu_fp8", lambda gu, rw: fused_ops.swiglu_fp8(gu, rw), [gu, rw]
    q = torch.randn(2, 3, 4, 64, generator=g)
    ang = torch.rand(3, 32, generator=g) * 10
    yield "apply_rope", lambda q, c, s: fused_ops.apply_rope(q, c, s), [q, ang.cos(), ang.sin()]
    yield "rope_", lambda q, c, s: fused_ops.rope_(q * 1.0, c, s, interleaved=False), [q, ang.cos(), ang.sin()]
    yield "rope_ in place", lambda q, c, s: fused_ops.rope_(q.detach() * 1.0, c.detach(), s.detach()), \
        [q, ang.cos(), ang.sin()]
    layout = _layout(7, 2, 5, 1)
    xt = torch.randn(7, 48, generator=g)
    tw = torch.rand(7, 2, generator=g)
    yield "permute", lambda x, w: fused_ops.permute(x, layout, w), [xt, tw]
    yield "permute fp8", lambda x, w: fused_ops.permute(x, layout, w, fp8=True), [xt, tw]
    yg = torch.randn(layout.assign.numel(), 48, generator=g)
    yield "unpermute", lambda y: fused_ops.unpermute(y, layout), [yg]
    yield "unpermute weighted", lambda y, w: fused_ops.unpermute(y, layout, w), [yg, tw]
    cols = torch.randn(14, 2, generator=g)
    yield "gather_rows", lambda x, c: fused_ops.gather_rows(x, layout.assign, layout.rows, 2, c), [xt, cols]
    yield "pack_rows_fp8", lambda x, c: fused_ops.pack_rows_fp8(x, layout.assign, layout.rows, 2, c), [xt, cols]
    rows = torch.randn(9, 48 + 1, generator=g)
    perm = torch.randperm(9, generator=g)
    assign, inverse = perm, torch.argsort(perm)
    yield "regroup_rows", lambda rows: fused_ops.regroup_rows(rows, 48, assign, inverse), [rows]
    wire = fused_ops.pack_rows_fp8(rows[:8, :48], torch.arange(8), torch.arange(8), 1, rows[:8, 48:])[1]
    standin = torch.zeros(9, 49)
    yield "regroup_rows_fp8", lambda rows, wire: (lambda o: (o[0], o[1], *o[2]))(
        fused_ops.regroup_rows_fp8(rows, wire, 48, torch.tensor([3, 0, -1, 5, 1]), torch.tensor(
            [1, 4, -1, 0, -1, 3, -1, -1, -1]))), [standin, wire]
    logits = torch.randn(5, 24, generator=g) * 2
    bias = torch.randn(24, generator=g) * 0.1
    yield "route", lambda lg, b: fused_ops.route(lg, b, 6, 3, 2, 2.5), [logits, bias]
    yield "route_softmax", lambda lg: fused_ops.route_softmax(lg, 4, 3, 2, 1.0, norm=True), [logits]
    hidden = torch.randn(2, 5, 16, generator=g)
    head = torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (2, 5), generator=g)
    targets[0, ::3] = -100
    yield "linear_cross_entropy", lambda h, wt, t: fused_ce.linear_cross_entropy(h, wt, t, chunk=3), \
        [hidden, head, targets]


_CASES = {name: (fn, inputs) for name, fn, inputs in _cases()}


@pytest.mark.parametrize("name", list(_CASES))
def test_fused_op_compiles_whole_and_matches_eager(name):
    fn, inputs = _CASES[name]
    want_out, want_grads = _run(fn, inputs, compiled=False)
    got_out, got_grads = _run(fn, inputs, compiled=True)
    assert len(got_out) == len(want_out) and len(got_grads) == len(want_grads)
    for got, want in zip(got_out + list(got_grads), want_out + list(want_grads), strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want), name
