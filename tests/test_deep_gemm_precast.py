"""``x_fp8``: a layer fed its input's 1x128 cast by the producer (a fused norm, SwiGLU or permute) instead of
casting it itself.

The precast is the cast the layer would make (``per_token_cast_to_fp8`` of ``x``), so the output and both
gradients must be the call without it bit for bit: the same e4m3 bytes and scales reach the same GEMMs, and
the wgrad reads the forward's cast either way (kept under ``fp8_cache``, cast again from ``x`` without). K = 200
is not a multiple of 128 (the layer pads the precast as it pads its own cast), grouped rows hold garbage in
their padding rows (a plain cast of ``x`` carries it; the GEMM skips those rows, the cached wgrad zeroes them).
"""

import importlib

import pytest
import torch

import deep_gemm

linear_mod = importlib.import_module("deep_gemm.linear")  # the module: ``deep_gemm.linear`` is the function


def _count_casts(monkeypatch) -> list[int]:
    calls = [0]
    real = linear_mod._act_cast

    def counting(x, recipe):
        calls[0] += 1
        return real(x, recipe)

    monkeypatch.setattr(linear_mod, "_act_cast", counting)
    return calls


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_precast_gives_the_same_output_and_gradients_and_skips_the_cast(grouped, fp8_cache, dtype, monkeypatch):
    k, n = 200, 160
    if grouped:
        m_indices = deep_gemm.grouped.contiguous_layout([100, 150, 20], "cpu")
        blocks = m_indices.view(-1, 128)  # group 1 first: the wgrad reorders blocks
        m_indices = torch.cat([blocks[1:3], blocks[0:1], blocks[3:]]).flatten()
        shape = (m_indices.numel(), k)
        w = (torch.randn(3, n, k) * 0.05).requires_grad_()
        run = lambda x, x_fp8: deep_gemm.grouped_linear(  # noqa: E731
            x, w, m_indices, fp8=True, fp8_cache=fp8_cache, x_fp8=x_fp8)
    else:
        shape = (3, 50, k)
        w = (torch.randn(n, k) * 0.05).requires_grad_()
        run = lambda x, x_fp8: deep_gemm.linear(x, w, fp8=True, fp8_cache=fp8_cache, x_fp8=x_fp8)  # noqa: E731
    x0 = (torch.randn(shape) * torch.exp(torch.randn(*shape[:-1], 1))).to(dtype)
    if grouped:
        x0[m_indices < 0] = 1e3  # garbage padding rows
    grad_out = torch.randn(*shape[:-1], n, dtype=dtype)
    casts = _count_casts(monkeypatch)
    results = []
    for precast in (False, True):
        x = x0.clone().requires_grad_()
        w.grad = None
        x_fp8 = deep_gemm.per_token_cast_to_fp8(x0.reshape(-1, k)) if precast else None
        casts[0] = 0
        y = run(x, x_fp8)
        assert casts[0] == (0 if precast else 1)  # the forward made no cast of x of its own
        y.backward(grad_out)
        results.append((y, x.grad, w.grad))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


def test_modules_take_the_precast():
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    x_fp8 = deep_gemm.per_token_cast_to_fp8(x)
    dense = deep_gemm.Fp8Linear(256, 96, bias=False, fp8=True)
    assert torch.equal(dense(x, x_fp8), dense(x))
    m_indices = deep_gemm.grouped.contiguous_layout([40, 60], "cpu")
    xg = torch.randn(m_indices.numel(), 256, dtype=torch.bfloat16)
    experts = deep_gemm.GroupedLinear(2, 256, 96, fp8=True)
    assert torch.equal(experts(xg, m_indices, deep_gemm.per_token_cast_to_fp8(xg)), experts(xg, m_indices))


def test_takes_precast():
    assert deep_gemm.takes_precast(True) and deep_gemm.takes_precast("blockwise")
    assert not any(deep_gemm.takes_precast(f) for f in (False, None, "mxfp8"))


class _Health:
    def __init__(self, active: bool):
        self.active = active


def test_reads_only_precast():
    """Only the blockwise recipe with caching and no health report sampling reads nothing of x but the cast."""
    assert deep_gemm.reads_only_precast(True, True) and deep_gemm.reads_only_precast("blockwise", True, _Health(False))
    assert not deep_gemm.reads_only_precast(True, False)  # the wgrad casts x again
    assert not deep_gemm.reads_only_precast(True, True, _Health(True))  # the report compares the cast with x
    assert not any(deep_gemm.reads_only_precast(f, True) for f in (False, None, "mxfp8"))


@pytest.mark.parametrize("fp8", ["mxfp8", False])
def test_precast_offered_to_a_recipe_that_casts_its_own_is_unread(fp8):
    """The GEMM decides whether a producer's 1x128 cast is usable: MXFP8 (1x32 UE8M0) and bf16 GEMMs leave it unread
    (a wrong one included), so the result is bit-identical to the call without it, forward and backward."""
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    q, s = deep_gemm.per_token_cast_to_fp8(x)
    for offered in ((q, s), (q[:1], s)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = deep_gemm.linear(a, w, fp8=fp8, x_fp8=offered)
        yb = deep_gemm.linear(b, w, fp8=fp8)
        assert torch.equal(ya, yb)
        ya.float().sum().backward()
        yb.float().sum().backward()
        assert torch.equal(a.grad, b.grad)
    m_indices = torch.zeros(256, dtype=torch.int32)
    wg = torch.randn(1, 128, 256, dtype=torch.bfloat16)
    assert torch.equal(deep_gemm.grouped_linear(x, wg, m_indices, fp8=fp8, x_fp8=(q, s)),
                       deep_gemm.grouped_linear(x, wg, m_indices, fp8=fp8))


_X = torch.randn(300, 200, dtype=torch.bfloat16)
_W = torch.randn(64, 200)
_Q, _S = deep_gemm.per_token_cast_to_fp8(_X)


@pytest.mark.parametrize("x_fp8,fp8,match", [
    ((_Q[:299], _S[:299]), True, r"x_fp8 must be \(e4m3 \[300, 200\], fp32 \[300, 2\]\)"),  # wrong rows
    ((_Q, _S[:, :1]), True, r"x_fp8 must be \(e4m3 \[300, 200\], fp32 \[300, 2\]\)"),  # wrong K blocks
    ((_Q.float(), _S), True, "got \\(torch.float32"),  # values not e4m3
    ((_Q, _S.bfloat16()), True, "torch.bfloat16"),  # scales not fp32
    ((_Q,), True, "x_fp8 must be \\(values"),
    ((_Q, _S.to("meta")), True, "x's device"),
])
def test_mismatched_precast_is_a_one_line_error(x_fp8, fp8, match):
    with pytest.raises(ValueError, match=match) as err:
        deep_gemm.linear(_X, _W, fp8=fp8, x_fp8=x_fp8)
    assert "\n" not in str(err.value)
    m_indices = torch.zeros(384, dtype=torch.int32)
    x = torch.randn(384, 200)
    with pytest.raises(ValueError, match="x_fp8"):
        deep_gemm.grouped_linear(x, torch.randn(1, 64, 200), m_indices, fp8=fp8, x_fp8=x_fp8)
