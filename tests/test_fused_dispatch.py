"""``fused_ops.dispatch``: the model's one call per fusion takes the kernel where it runs (the registry's choice)
and the torch path otherwise; both against float64 math and against each other.

Tolerances (fp32 inputs, fresh random values): a norm over d = 256 sums 256 squares in fp32, relative error at
most ~256 * 2^-24 ~ 1.5e-5 (typically ~1e-6), so outputs within rtol 2e-5 of float64 and gradients within
calc_diff 1e-9 (calc_diff squares relative errors: (1.5e-5)^2 ~ 2e-10). SwiGLU and RoPE round a handful of
fp32 products per element: rtol 1e-6 (8 ulps). Moving rows (permute) is a copy: bit-equal.
"""

from __future__ import annotations

import pytest
import torch

import fused_ops
from accel import registry
from accel.numerics import calc_diff

torch.manual_seed(0)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).requires_grad_()


def test_the_registrys_choice_decides():
    """``DSV3_KERNEL_IMPL=reference`` (or ``fused=False``): the torch path, whose ``NormOut.fp8`` is None; the
    kernels forced (Triton's interpreter on a CPU): the fused op, which makes the 1x128 cast in the same pass."""
    x, w = torch.randn(4, 256), torch.ones(256)
    with registry.force("reference"):
        assert not fused_ops.kernels_run(x.device)
        assert fused_ops.rms_norm(x, w, fp8=True).fp8 is None
    with registry.force("triton"):
        if not fused_ops.kernels_run(x.device):
            pytest.skip("Triton cannot run here (no interpreter)")
        assert fused_ops.rms_norm(x, w, fp8=True).fp8 is not None
        assert fused_ops.rms_norm(x, w, fp8=True, fused=False).fp8 is None


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_rms_norm_matches_float64(impl):
    x, r, w = _leaf(3, 5, 256), _leaf(3, 5, 256), _leaf(256)
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    with registry.force(impl):
        out = fused_ops.rms_norm(x, w, r, eps=1e-6)
    h64 = x64 + r64
    want = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    torch.testing.assert_close(out.y.double(), want, rtol=2e-5, atol=1e-6)
    assert torch.equal(out.residual, x.detach() + r.detach())  # the residual stream: torch's fp32 add, exactly
    g = torch.randn_like(want)
    torch.autograd.backward([out.y], [g.float()])
    torch.autograd.backward([want], [g])
    for a, b in ((x, x64), (r, r64), (w, w64)):
        assert calc_diff(a.grad.double(), b.grad) < 1e-9


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("weighted", [False, True])
def test_silu_and_mul_matches_float64(impl, weighted):
    gu, wt = _leaf(37, 2 * 96), (_leaf(37) if weighted else None)
    gu64 = gu.detach().double().requires_grad_()
    wt64 = None if wt is None else wt.detach().double().requires_grad_()
    with registry.force(impl):
        out = fused_ops.silu_and_mul(gu, wt)
    gate, up = gu64.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up * (1 if wt64 is None else wt64[:, None])
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(want)
    out.backward(g.float())
    want.backward(g)
    assert calc_diff(gu.grad.double(), gu64.grad) < 1e-10
    if weighted:
        assert calc_diff(wt.grad.double(), wt64.grad) < 1e-10


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    c, s = cos[None, :, None, :].double(), sin[None, :, None, :].double()
    x = x.double()
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    x0, x1 = x.chunk(2, -1)
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_float64(impl, interleaved):
    x = torch.randn(2, 6, 3, 64)
    angles = torch.rand(6, 32) * 6
    cos, sin = angles.cos(), angles.sin()
    with registry.force(impl):
        out = fused_ops.rotary(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(out.double(), _rotate64(x, cos, sin, interleaved), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("in_place", [True, False])
def test_rotary_tail_rotates_only_the_tail(impl, in_place):
    """MLA's queries: the nope dims untouched (bit for bit), the RoPE dims rotated as interleaved pairs; in place
    only where the kernel runs and the caller allows it."""
    q = torch.randn(2, 6, 3, 32 + 16)
    angles = torch.rand(6, 8) * 6
    cos, sin = angles.cos(), angles.sin()
    before = q.clone()
    with registry.force(impl):
        out = fused_ops.rotary_tail_(q, 32, cos, sin, in_place=in_place)
        wrote = in_place and fused_ops.kernels_run(q.device)
    assert (out is q) == wrote and torch.equal(q, out if wrote else before)
    assert torch.equal(out[..., :32], before[..., :32])
    torch.testing.assert_close(out[..., 32:].double(), _rotate64(before[..., 32:], cos, sin, True), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("tokens,k,experts,alignment", [(9, 2, 4, 8), (1, 3, 5, 4), (16, 1, 2, 128)])
def test_permute_tokens_kernel_and_torch_paths_agree(tokens, k, experts, alignment):
    """The same layout and rows (a copy: bit-equal) and gradients either way; the kernel path hands back its
    ``Grouping`` (unpermute then takes the kernel too), the torch path None."""
    x = _leaf(tokens, 24)
    indices = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    with registry.force("reference"):
        torch_path = fused_ops.permute_tokens(x, indices, experts, alignment)
    with registry.force("triton"):
        if not fused_ops.kernels_run(x.device):
            pytest.skip("Triton cannot run here (no interpreter)")
        x2 = x.detach().clone().requires_grad_()
        kernel = fused_ops.permute_tokens(x2, indices, experts, alignment)
        g = torch.randn_like(kernel.x_grouped)
        kernel.x_grouped.backward(g)
    assert torch_path.layout is None and kernel.layout is not None
    for a, b in zip(torch_path[:4], kernel[:4]):
        assert torch.equal(a, b)
    torch_path.x_grouped.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)  # k fp32 terms summed per token
    assert torch.equal(torch_path.x_grouped[torch_path.m_indices < 0], torch.zeros(0, 24).new_zeros(
        int((torch_path.m_indices < 0).sum()), 24))
