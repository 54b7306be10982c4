"""The residual add fused into an RMSNorm (``RMSNorm(x, residual)``: one ``fused_ops.rmsnorm`` kernel making
``h = x + residual`` and ``norm(h)``, and ``norm(h)``'s FP8 cast with ``fp8``), and a block's norm recompute
with the fused kernel. (The model itself adds its residuals as two plain lines per block: ``Block.forward``.)

Numerics: the fused kernel adds in fp32 and rounds ``h`` to the input dtype (torch's add of two values of that
dtype rounds the same exact sum once: bit-equal), then normalises the rounded ``h`` as the norm alone would (so
the norm recompute, which re-runs the norm alone on the kept ``h``, refills the same bits). Against the unfused
torch norm only the fp32 order of the ``dim``-term sum of squares differs: rstd within ``dim * 2^-24`` relative
(a sum of positive terms; worst case), so an fp32 ``y`` within that, a bf16 ``y`` within one bf16 rounding
(2^-8 relative) on top.
"""

from __future__ import annotations

import pytest
import torch

import deep_gemm
from accel import registry
from models.deepseek_v3 import ModelArgs
from models.deepseek_v3.layers import Linear, RMSNorm
from recipes.bench_memory import saved_bytes
from training.memory_policy import MemoryPolicy


def _inputs(dtype: torch.dtype, dim: int = 200) -> tuple[torch.Tensor, torch.Tensor, RMSNorm]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, dim, generator=g).to(dtype)
    residual = (torch.randn(3, 7, dim, generator=g) * 4).to(dtype)
    norm = RMSNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    return x, residual, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_residual_fused_and_unfused(dtype):
    x, residual, norm = _inputs(dtype)
    dim = x.shape[-1]
    # unfused: exactly ``h = x + residual``, then the norm of h (today's numbers, gradients included)
    xs = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    out = norm(*xs)
    assert torch.equal(out.residual, x + residual) and out.fp8 is None
    h = (x + residual).requires_grad_()
    assert torch.equal(out.y, norm(h))
    dy, dh = torch.randn_like(out.y), torch.randn_like(out.residual)
    torch.autograd.backward([out.y, out.residual], [dy, dh])
    torch.autograd.backward([norm(h), h], [dy, dh])
    assert torch.equal(xs[0].grad, h.grad) and torch.equal(xs[1].grad, h.grad)

    norm.fused = True
    registry.get("fused_ops.rmsnorm_fp8").last_impl = None
    with registry.force("auto"):
        fx = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
        fused = norm(*fx, fp8=True)
        alone = norm(fused.residual.detach())
        torch.autograd.backward([fused.y, fused.residual], [dy, dh])
    assert registry.get("fused_ops.rmsnorm_fp8").last_impl == "triton"
    assert torch.equal(fused.residual, x + residual)
    assert torch.equal(fused.y, alone)  # what the norm recompute refills is what the forward made
    q, scales = deep_gemm.per_token_cast_to_fp8(fused.y.detach().reshape(-1, dim))
    assert torch.equal(fused.fp8[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(fused.fp8[1], scales)
    rtol = dim * 2.0**-24 + (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    torch.testing.assert_close(fused.y, out.y, rtol=rtol, atol=0.0)
    # gradients: the same fp32 formula, one rounding; dx within rstd's bound plus one rounding of the dtype
    eps = torch.finfo(dtype).eps
    for got, want in zip(fx, xs):
        torch.testing.assert_close(got.grad, want.grad, rtol=rtol + eps, atol=eps * float(want.grad.abs().max()))
    with pytest.raises(ValueError, match="residual must have"):
        norm(x, residual[:, :3])


def test_norm_recompute_keeps_the_input_and_remakes_the_fused_output():
    """The memory policy's norm recompute with the fused kernel: only the norm's input is kept (the consumer's
    saved y is a recipe), and the forward's output and every gradient come out bit for bit as without recompute
    (fp32: the remake runs the same kernel on the same input)."""
    x, _, norm = _inputs(torch.float32, 256)
    norm.fused = True
    lin = Linear(256, 64)
    modules = torch.nn.ModuleList([norm, lin])
    results, kept = [], []
    with registry.force("auto"):
        for recompute in (False, True):
            policy = MemoryPolicy(torch.nn.ModuleDict({"norm": norm}),
                                  ModelArgs.preset("debug_tiny", recompute=("norm",) if recompute else ()))
            inputs = x.clone().requires_grad_()
            modules.zero_grad(set_to_none=True)
            nbytes, out = saved_bytes(lambda inputs=inputs: lin(norm(inputs)), modules, policy)
            policy.remove()
            out.square().sum().backward()
            kept.append(nbytes)
            results.append([out.detach(), inputs.grad, norm.weight.grad, lin.weight.grad])
    # without recompute: x and rstd (the fused norm's backward), y (the Linear); with it: x and rstd
    rstd = x.numel() // 256 * 4
    assert kept == [x.numel() * 4 * 2 + rstd, x.numel() * 4 + rstd], kept
    for got, want in zip(*results):
        assert torch.equal(got, want)
