"""FP8 training layers: gradients against fp32 Linear, zero-bubble weight-gradient deferral, modules.

Tolerance: calc_diff against an fp32 nn.Linear for output and every gradient below FP8_TOL, derived in
``tests.tolerances.fp8_calc_diff_bound`` from e4m3's 3-bit mantissa for the worst of the three GEMMs: the wgrad,
whose X is cast twice (1x128 in forward, then 128x1) and dY once, 3 casts, over the smallest compared tensor here
(256 values; ~3.0e-3, independent of the reduction length for random-sign inputs). Measured ~5e-4 here; a wrong
scale or a lost block moves calc_diff by > 1e-2. The fp8=False path must match fp32 autograd to fp32 rounding
(1e-10).
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import accel.wgrad
import deep_gemm
from accel import registry
from deep_gemm import calc_diff
from tests.tolerances import fp8_calc_diff_bound

FP8_TOL = fp8_calc_diff_bound(casts=3, reduction=256, samples=256)
FP32_TOL = 1e-10


def _fp32_linear_grads(x, w, b, grad_out):
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = None if b is None else b.detach().clone().requires_grad_()
    y = F.linear(x2, w2, b2)
    y.backward(grad_out)
    return y, x2.grad, w2.grad, None if b is None else b2.grad


@pytest.mark.parametrize("fp8,tol", [(True, FP8_TOL), (False, FP32_TOL)])
@pytest.mark.parametrize("shape", [(3, 50, 200, 300), (1, 256, 128, 256)])  # (batch, tokens, K, N)
def test_linear_gradients_match_fp32_linear(fp8, tol, shape):
    batch, tokens, k, n = shape
    x = (torch.randn(batch, tokens, k) * torch.exp(torch.randn(batch, tokens, 1))).requires_grad_()
    w = (torch.randn(n, k) * 0.05).requires_grad_()
    b = torch.randn(n).requires_grad_()
    grad_out = torch.randn(batch, tokens, n)
    y = deep_gemm.linear(x, w, b, fp8=fp8)
    y.backward(grad_out)
    y_ref, gx, gw, gb = _fp32_linear_grads(x, w, b, grad_out)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    for got, want in ((y, y_ref), (x.grad, gx), (w.grad, gw), (b.grad, gb)):
        assert calc_diff(got, want) < tol
    assert w.grad.dtype == w.dtype


def test_bf16_activations_with_fp32_master_weight():
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(128, 256) * 0.05).requires_grad_()
    y = deep_gemm.linear(x, w, fp8=True)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    _, gx, gw, _ = _fp32_linear_grads(x.float(), w, None, grad_out.float())
    assert calc_diff(x.grad, gx) < FP8_TOL and calc_diff(w.grad, gw) < FP8_TOL


@pytest.mark.parametrize("fp8", [True, False])
def test_weight_gradient_is_deferred_then_accumulated_like_autograd(fp8):
    x = torch.randn(40, 128, requires_grad=True)
    w = torch.randn(96, 128, requires_grad=True)
    grad_out = torch.randn(40, 96)

    deep_gemm.linear(x, w, fp8=fp8).backward(grad_out)
    direct = w.grad.clone()
    w.grad = None

    closures = []
    with accel.wgrad.collect_into(closures.append):
        deep_gemm.linear(x, w, fp8=fp8).backward(grad_out)
    assert w.grad is None and len(closures) == 1  # the input gradient came back; W waits
    closures[0]()
    torch.testing.assert_close(w.grad, direct, rtol=0, atol=0)
    closures[0]()  # a second run accumulates, as a second backward would
    torch.testing.assert_close(w.grad, 2 * direct, rtol=0, atol=0)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_weight_gradient_reaches_the_parameter_under_checkpointing(use_reentrant):
    # Non-reentrant checkpointing hands backward recomputed stand-ins for saved tensors: the weight
    # gradient must still land on the real parameter.
    x = torch.randn(32, 128, requires_grad=True)
    w = torch.randn(64, 128, requires_grad=True)
    deep_gemm.linear(x, w, fp8=True).sum().backward()
    direct, direct_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    out = torch.utils.checkpoint.checkpoint(lambda t: deep_gemm.linear(t, w, fp8=True), x,
                                            use_reentrant=use_reentrant)
    out.sum().backward()
    torch.testing.assert_close(w.grad, direct, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, direct_x, rtol=0, atol=0)


def test_fp8_linear_module_is_an_nn_linear_drop_in():
    torch.manual_seed(1)
    ref = torch.nn.Linear(256, 128)
    layer = deep_gemm.Fp8Linear(256, 128)
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer, torch.nn.Linear) and layer.fp8 and "fp8=True" in repr(layer)
    x = torch.randn(2, 16, 256)
    assert calc_diff(layer(x), ref(x)) < FP8_TOL
    layer.fp8 = False
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-6, atol=1e-6)


def test_fp8_linear_runs_through_triton_kernels():
    x = torch.randn(64, 128, requires_grad=True)
    w = (torch.randn(128, 128) * 0.1).requires_grad_()
    grad_out = torch.randn(64, 128)
    with registry.force("triton"):
        deep_gemm.linear(x, w, fp8=True).backward(grad_out)
        impls = {name: registry.get(f"deep_gemm.{name}").last_impl for name in ("fp8_gemm_nt", "fp8_gemm_nn",
                                                                                   "fp8_gemm_tn")}
    assert set(impls.values()) == {"triton"}
    _, gx, gw, _ = _fp32_linear_grads(x, w, None, grad_out)
    assert calc_diff(x.grad, gx) < FP8_TOL and calc_diff(w.grad, gw) < FP8_TOL


def _grouped_reference(x, w, m_indices, grad_out):
    """fp32 autograd over explicit per-group slices: out[r] = x[r] @ w[g]^T, padding rows 0."""
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = torch.zeros(x.shape[0], w.shape[1])
    for g in range(w.shape[0]):
        rows = (m_indices == g).nonzero().squeeze(1)
        out = out.index_add(0, rows, x2[rows] @ w2[g].T)
    out.backward(grad_out)
    return out, x2.grad, w2.grad


@pytest.mark.parametrize("fp8,tol", [(True, FP8_TOL), (False, FP32_TOL)])
def test_grouped_linear_gradients_and_padding(fp8, tol):
    sizes, k, n = [100, 0, 150, 20], 200, 160  # K and N not multiples of 128; an empty group
    m_indices = deep_gemm.grouped.contiguous_layout(sizes, "cpu")
    # Put group 2 before group 0 so the weight-gradient path must reorder blocks.
    blocks = m_indices.view(-1, 128)
    m_indices = torch.cat([blocks[1:3], blocks[0:1], blocks[3:]]).flatten()
    pad = m_indices < 0
    x = torch.randn(m_indices.numel(), k)
    x[pad] = 1e3  # garbage in padding rows must not leak anywhere
    x.requires_grad_()
    w = (torch.randn(len(sizes), n, k) * 0.05).requires_grad_()
    grad_out = torch.randn(m_indices.numel(), n)
    y = deep_gemm.grouped_linear(x, w, m_indices, fp8=fp8)
    y.backward(grad_out)
    y_ref, gx, gw = _grouped_reference(x, w, m_indices, grad_out)
    assert torch.all(y[pad] == 0) and torch.all(x.grad[pad] == 0)
    assert torch.all(w.grad[1] == 0)  # the empty group
    for got, want in ((y, y_ref), (x.grad, gx), (w.grad, gw)):
        assert calc_diff(got, want) < tol



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_unquantized_ignores_nan_padding_anywhere_in_a_block(dtype):
    """The bf16/fp32 path reads only valid rows: NaN padding (also mid-block, not only at a group's tail)
    never reaches the output or any gradient, and valid rows match the per-group fp32 reference. Outputs and
    the weight-gradient buffer start NaN-poisoned, so every element must be written (pad rows and the empty
    group included); the hole splits group 0 into two row segments whose weight gradients must add up."""
    sizes, k, n = [130, 70, 0, 90], 48, 40
    m_indices = deep_gemm.grouped.contiguous_layout(sizes, "cpu")
    m_indices[10:20] = -1  # a hole inside group 0's first block
    pad = m_indices < 0
    x = torch.randn(m_indices.numel(), k).to(dtype)
    x[pad] = float("nan")
    x.requires_grad_()
    w = (torch.randn(len(sizes), n, k) * 0.1).to(dtype).requires_grad_()
    grad_out = torch.randn(m_indices.numel(), n).to(dtype)
    grad_out[pad] = float("nan")
    with registry.poisoned_outputs():
        y = deep_gemm.grouped_linear(x, w, m_indices)
        y.backward(grad_out)
    y_ref, gx, gw = _grouped_reference(x.float(), w.float(), m_indices, grad_out.float())
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    assert torch.all(y[pad] == 0) and torch.all(x.grad[pad] == 0) and torch.all(w.grad[2] == 0)
    # fp32: summation order only; bf16: outputs and grads rounded to bf16 (2^-8 relative, calc_diff ~1e-5)
    tol = FP32_TOL if dtype == torch.float32 else 1e-4
    for got, want in ((y[~pad], y_ref[~pad]), (x.grad[~pad], gx[~pad]), (w.grad, gw)):
        assert torch.isfinite(got).all() and calc_diff(got.float(), want) < tol


@pytest.mark.parametrize("fp8", [True, False])
def test_grouped_linear_module_defers_weight_gradient(fp8):
    """The closure runs later, outside backward, with grad mode on and the saved input still requiring grad
    (as a pipeline schedule runs it): it must still produce the plain weight gradient."""
    layer = deep_gemm.GroupedLinear(2, 128, 64, fp8=fp8)
    m_indices = deep_gemm.grouped.contiguous_layout([128, 60], "cpu")
    x = torch.randn(m_indices.numel(), 128).requires_grad_()
    closures = []
    with accel.wgrad.collect_into(closures.append):
        layer(x, m_indices).sum().backward()
    assert layer.weight.grad is None and len(closures) == 1
    with torch.enable_grad():
        closures[0]()
    assert layer.weight.grad.shape == (2, 64, 128) and not layer.weight.grad.requires_grad
    _, _, gw = _grouped_reference(x, layer.weight, m_indices, torch.ones(m_indices.numel(), 64))
    assert calc_diff(layer.weight.grad, gw) < (FP8_TOL if fp8 else FP32_TOL)


@pytest.mark.parametrize("call,match", [
    (lambda: deep_gemm.linear(torch.randn(4, 128), torch.randn(64, 100)), "x's last dim"),
    (lambda: deep_gemm.linear(torch.randn(4, 128), torch.randn(64, 128), torch.randn(3)), "bias must have shape"),
    (lambda: deep_gemm.grouped_linear(torch.randn(100, 128), torch.randn(2, 64, 128),
                                      torch.zeros(100, dtype=torch.int32)), "multiple of 128"),
    (lambda: deep_gemm.grouped_linear(torch.randn(128, 128), torch.randn(2, 64, 128),
                                      torch.full((128,), 2, dtype=torch.int32)), r"group ids in \[0, 2\) or -1"),
    (lambda: deep_gemm.grouped_linear(torch.randn(128, 128), torch.randn(2, 64, 128),
                                      torch.arange(128, dtype=torch.int32) % 2), "one group"),
])
def test_layer_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _saved_while(fn):
    """(result of fn(), [saved tensors' (dtype, numel)]) for everything autograd saved while fn ran."""
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_saves_only_the_e4m3_cast_and_matches_the_uncached_gradients(grouped, dtype):
    """With ``fp8_cache`` the layer keeps its input only as the forward's e4m3 cast plus one fp32 scale per
    1x128 tile (and, grouped, the int32 row map): no float copy of x, no FP8 weight copy. Forward, input
    gradient and weight gradient are the uncached ones bit for bit: the wgrad re-tiles the forward's 1x128
    cast to 128x1 either way (cached, or cast again from the kept x), so caching and recompute change
    memory, never the numbers. That second e4m3 rounding of x must still meet the FP8 rule against fp32
    (calc_diff < 2e-3): each e4m3 rounding has relative error <= 2^-4 and adds ~3e-4 to calc_diff (its mean
    square / 2), so x rounded twice and dy once give ~9e-4; a lost or doubled tile would be > 1e-2."""
    k, n = 200, 160  # K not a multiple of 128: the cast is padded
    if grouped:
        m_indices = deep_gemm.grouped.contiguous_layout([100, 150, 20], "cpu")
        m = m_indices.numel()
        w = (torch.randn(3, n, k) * 0.05).requires_grad_()
        run = lambda x, cache: deep_gemm.grouped_linear(x, w, m_indices, fp8=True, fp8_cache=cache)  # noqa: E731
    else:
        m = 300
        w = (torch.randn(n, k) * 0.05).requires_grad_()
        run = lambda x, cache: deep_gemm.linear(x, w, fp8=True, fp8_cache=cache)  # noqa: E731
    x0 = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).to(dtype)
    grad_out = torch.randn(m, n, dtype=dtype)
    results = {}
    for cache in (False, True):
        x = x0.clone().requires_grad_()
        w.grad = None
        y, saved = _saved_while(lambda x=x, cache=cache: run(x, cache))
        y.backward(grad_out)
        results[cache] = (y, x.grad, w.grad, saved)
    floats = [(dt, numel) for dt, numel in results[True][3] if dt.is_floating_point]
    k_pad = 256
    assert sorted(floats, key=str) == sorted([(torch.float8_e4m3fn, m * k_pad), (torch.float32, m * k_pad // 128)],
                                             key=str)
    y0, gx0, gw0, _ = results[False]
    y1, gx1, gw1, _ = results[True]
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    if grouped:
        _, _, gw_ref = _grouped_reference(x0.float(), w, m_indices, grad_out.float())
    else:
        _, _, gw_ref, _ = _fp32_linear_grads(x0.float(), w, None, grad_out.float())
    assert calc_diff(gw1, gw_ref) < FP8_TOL
