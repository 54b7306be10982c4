"""``torch.compile(fullgraph=True)`` over the kernel ops' training paths: ``deep_gemm.linear`` / ``Fp8Linear`` (bf16,
blockwise FP8 and MXFP8, with and without FP8 activation caching) and ``flash_mla.mla_attention``, forward and
backward. ``fullgraph=True`` raises on any graph break, so a pass means 0 breaks. The ``aot_eager`` backend runs
what matters for the ops (Dynamo, fake tensors through their fakes, AOTAutograd through their registered
autograd, the triton_op decomposition) without Inductor's C++ build; one Inductor case checks the generated code.

The linear ops are opaque to the compiler, so compiled and eager give the same bits, the weight gradient included
(handed to ``accel.grads`` / ``accel.wgrad`` by the backward op at run time, compiled or not). ``mla_attention`` is
a triton_op: compiled, its reference forward is traced into the graph, so its output may differ from eager in
fp32 summation order (bound below); its backward op is opaque, so the gradients are the eager ones bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import accel.wgrad
import deep_gemm
import flash_mla
from accel import grads


def _linear_run(fn, x, layer, dy):
    layer.weight.grad = layer.bias.grad = None
    if grads.has_main_grad(layer.weight):
        layer.weight.main_grad.zero_()
    x = x.detach().requires_grad_()
    out = fn(x)
    out.backward(dy)
    return out.detach(), x.grad, grads.grad(layer.weight).clone(), layer.bias.grad


@pytest.mark.parametrize("fp8,fp8_cache", [(False, False), (True, False), (True, True), ("mxfp8", True)])
def test_linear_compiles_whole_and_matches_eager(fp8, fp8_cache):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    layer = deep_gemm.Fp8Linear(200, 136, fp8=fp8, fp8_cache=fp8_cache)  # K and N not multiples of 128: padded
    x = torch.randn(2, 7, 200, generator=g)
    dy = torch.randn(2, 7, 136, generator=g)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    want = _linear_run(layer, x, layer, dy)
    got = _linear_run(compiled, x, layer, dy)
    for name, a, b in zip(("out", "dx", "dw", "db"), got, want):
        assert torch.equal(a, b), name


def test_linear_compiled_keeps_main_grad_and_deferred_weight_gradient():
    """The weight gradient of a bf16 weight goes to its fp32 main_grad, and under a zero-bubble collector it is
    deferred (nothing accumulated until the collected closure runs), compiled as in eager."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(128, 256, generator=g).bfloat16())
    grads.keep_main_grads([weight])
    x = torch.randn(16, 256, generator=g).bfloat16()
    dy = torch.randn(16, 128, generator=g).bfloat16()
    compiled = torch.compile(lambda t: deep_gemm.linear(t, weight, fp8=True, fp8_cache=True), fullgraph=True,
                             backend="aot_eager")
    results = []
    for fn in (lambda t: deep_gemm.linear(t, weight, fp8=True, fp8_cache=True), compiled):
        weight.main_grad.zero_()
        collected = []
        with accel.wgrad.collect_into(collected.append):
            fn(x.requires_grad_()).backward(dy)
        assert len(collected) == 1 and weight.main_grad.abs().sum() == 0 and weight.grad is None
        collected[0]()
        assert weight.main_grad.dtype == torch.float32 and weight.grad is None
        results.append(weight.main_grad.clone())
    assert results[0].abs().sum() > 0
    assert torch.equal(results[0], results[1])


def _attention_run(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("backend,causal", [("aot_eager", True), ("aot_eager", False),
                                            pytest.param("inductor", True, marks=pytest.mark.slow)])
def test_mla_attention_compiles_whole(backend, causal):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    b, s, h, dqk, dv = 2, 40, 2, 48, 32
    q, k, v = (torch.randn(b, s, h, d, generator=g) for d in (dqk, dqk, dv))
    dout = torch.randn(b, s, h, dv, generator=g)

    def attention(q, k, v):
        return flash_mla.mla_attention(q, k, v, causal=causal, softmax_scale=0.2)

    want = _attention_run(attention, q, k, v, dout)
    got = _attention_run(torch.compile(attention, fullgraph=True, backend=backend), q, k, v, dout)
    # out: the same fp32 ops over rows of <= 40 keys of 48 products, maybe summed in another order: each value of
    # magnitude <= max|v| moves by a few ulps of fp32 (2^-23 * 40 terms < 1e-5 relative to max|v|)
    assert (got[0] - want[0]).abs().max() <= 1e-5 * v.abs().max()
    for name, a, w in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert torch.equal(a, w), name


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_linear_compiles_whole_and_matches_eager(fp8):
    """The expert GEMM (padding rows, an empty group, a group split over two blocks): the same bits compiled."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    layer = deep_gemm.GroupedLinear(3, 200, 136, fp8=fp8, fp8_cache=fp8)
    m_indices = torch.tensor([0] * 100 + [-1] * 28 + [2] * 128 + [2] * 5 + [-1] * 123, dtype=torch.int32)
    x = torch.randn(384, 200, generator=g)
    dy = torch.randn(384, 136, generator=g)
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        layer.weight.grad = None
        xs = x.clone().requires_grad_()
        out = fn(xs, m_indices)
        out.backward(dy)
        results.append((out.detach(), xs.grad, layer.weight.grad.clone()))
    for name, a, b in zip(("out", "dx", "dw"), *results):
        assert torch.equal(a, b), name
