"""mHC's mixing matrix (DeepSeek-V4): softmax, then Sinkhorn normalisation, per token, as ``torch.ops.dsv3`` ops.

Each sublayer's mHC unit turns ``hc x hc`` logits per token into a nearly doubly-stochastic matrix:

    x = softmax(z, -1) + eps;  x = x / (colsum(x) + eps);  then iters - 1 times: rows, then columns

in fp32. Unfused, that is ``2 iters + 2`` elementwise passes over ``[tokens, hc, hc]`` forward and, through
autograd, every intermediate kept for the backward (``2 iters`` tensors of the logits' size per sublayer);
fused it is one read of ``z`` and one write per direction, nothing kept but ``z``. The backward recomputes the
states in the kernel (``fused_ops.kernels.sinkhorn``: ``(2 iters - 1) iters`` normalisation steps per token
instead of keeping ``2 iters - 1`` states).
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec

OP, BWD_OP = "fused_ops.sinkhorn", "fused_ops.sinkhorn_backward"


def _states(logits: torch.Tensor, eps: float, iters: int) -> list[torch.Tensor]:
    """The softmax plus eps, then the state after each of the ``2 iters - 1`` normalisation steps (fp32)."""
    x = logits.float().softmax(dim=-1) + eps
    states = [x]
    for s in range(2 * iters - 1):
        x = x / (x.sum(dim=-2 if s % 2 == 0 else -1, keepdim=True) + eps)
        states.append(x)
    return states


@registry.reference_for(OP)
def sinkhorn_reference(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """``[tokens, hc, hc]`` logits -> mixing matrices, fp32 (the model's sequence)."""
    return _states(logits, eps, iters)[-1]


@registry.reference_for(BWD_OP)
def sinkhorn_backward_reference(grad: torch.Tensor, logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """The logits' gradient, written out (an op body runs below autograd): through each step
    ``y = x / (r + eps)``, ``dx = (dy - sum(dy * y)) / (r + eps)`` along its axis; then the softmax's."""
    states = _states(logits, eps, iters)
    g = grad.float()
    for s in reversed(range(2 * iters - 1)):
        dim = -2 if s % 2 == 0 else -1
        x, y = states[s], states[s + 1]
        g = (g - (g * y).sum(dim=dim, keepdim=True)) / (x.sum(dim=dim, keepdim=True) + eps)
    p = logits.float().softmax(dim=-1)
    return p * (g - (g * p).sum(dim=-1, keepdim=True))


def _inputs(shape: dict, seed: int, device: torch.device) -> tuple[torch.Tensor, float, int]:
    g = torch.Generator().manual_seed(seed)
    hc = shape.get("hc", 4)
    logits = torch.randn(shape["tokens"], hc, hc, generator=g) * shape.get("spread", 2.0)
    return logits.to(device), shape.get("eps", 1e-6), shape.get("iters", 20)


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    return Case(args=_inputs(shape, seed, device))


def _make_bwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    logits, eps, iters = _inputs(shape, seed, device)
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return Case(args=(grad, logits, eps, iters))


def _bytes(shape: dict, tensors: int) -> float:
    return 4.0 * tensors * shape["tokens"] * shape.get("hc", 4) ** 2


# Token counts around the 64-token tile, hc 4 (V4) and 2, V4's eps and iterations and a larger eps with few.
_SHAPES = [dict(tokens=37), dict(tokens=130, hc=2, eps=1e-2, iters=3), dict(tokens=5, spread=8.0)]
_BENCH = [dict(tokens=4 * 4096), dict(tokens=16 * 4096)]  # a layer's sublayer at 4K tokens, micro-batches 4, 16

sinkhorn_op = registry.register(
    OP, reference=sinkhorn_reference, triton="fused_ops.kernels.sinkhorn:sinkhorn",
    # fp32 both sides, the same operations in the same order up to the sums' association: a few ulp (~1e-7
    # relative per element, calc_diff ~1e-14); a wrong axis or missing eps moves entries by > 1e-3
    verify=VerifySpec(make_case=_make_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-10,
                      bytes_moved=lambda s: _bytes(s, 2)),
)
sinkhorn_backward_op = registry.register(
    BWD_OP, reference=sinkhorn_backward_reference, triton="fused_ops.kernels.sinkhorn:sinkhorn_backward",
    # the recomputed states equal the forward's bit for bit in the kernel; differences are the sums'
    # association through 39 steps (each a ~1e-7 relative perturbation, compounded: ~1e-6, calc_diff ~1e-12)
    verify=VerifySpec(make_case=_make_bwd_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-9,
                      bytes_moved=lambda s: _bytes(s, 3)),
)


@registry.torch_op(sinkhorn_backward_op)
def _sinkhorn_backward_torch_op(grad: torch.Tensor, logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    return sinkhorn_backward_op(grad, logits, eps, iters)


# the backward recomputes the states from the logits, never kept
@registry.torch_op(sinkhorn_op, recompute=_sinkhorn_backward_torch_op)
def _sinkhorn_torch_op(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    return sinkhorn_op(logits, eps, iters)


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """mHC's mixing matrices ``[..., hc, hc]`` (fp32) from their logits (fp32): ``softmax(-1) + eps``, a
    column normalisation, then ``iters - 1`` row-and-column pairs, each ``x / (sum + eps)``; differentiable."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn: logits must be [..., hc, hc], got {tuple(getattr(logits, 'shape', ()))}")
    if logits.dtype != torch.float32:
        raise ValueError(f"sinkhorn: logits must be float32 (mHC runs in fp32), got {logits.dtype}")
    if int(iters) < 1 or not float(eps) >= 0:
        raise ValueError(f"sinkhorn: iters must be >= 1 and eps >= 0, got {iters} and {eps}")
    hc = logits.shape[-1]
    out = _sinkhorn_torch_op(logits.reshape(-1, hc, hc).contiguous(), float(eps), int(iters))
    return out.view(logits.shape)
