"""DeepSeek-V4's lightning-indexer logits over CSA's compressed keys, block-causal, as ``torch.ops.dsv3`` ops.

    I[t, w] = scale * sum_h weights[t, h] * ReLU(q[t, h] . k[w])     for w < (t + 1) // ratio, else -inf

``q [b, s, h, d]`` the indexer's queries, ``k [b, n, d]`` its compressed keys (one per ``ratio`` tokens; entry w
closes at token ``(w + 1) ratio - 1``), ``weights [b, s, h]`` fp32 per-head weights, ``I [b, s, n]`` fp32. Unfused,
the model materialises the ``[b, s, h, n]`` logits (and autograd keeps them); fused, only ``I`` is written and
the backward recomputes them per tile. Gradients reach ``q``, ``k`` and ``weights`` (the indexer's KL loss
trains all three); an entry not yet visible passes none.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec

OP, BWD_OP = "fused_ops.indexer_logits", "fused_ops.indexer_logits_backward"


def visible(s: int, n: int, ratio: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[s, n]`` True where query t sees entry w: its window has closed, ``w < (t + 1) // ratio``."""
    t = torch.arange(s, device=device).unsqueeze(1)
    return torch.arange(n, device=device) < (t + 1) // ratio


@registry.reference_for(OP)
def indexer_logits_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int,
                             scale: float) -> torch.Tensor:
    """fp32 math (the model's former lines): ``[b, s, n]``, -inf where not visible."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1))  # [b, s, h, n]
    scores = (torch.relu(logits) * scale * weights.float().unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(~visible(q.shape[1], k.shape[1], ratio, q.device), -math.inf)


@registry.reference_for(BWD_OP)
def indexer_logits_backward_reference(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                                      ratio: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dweights), written out: ``g = grad * scale * weights * [q.k > 0]`` on the visible entries."""
    grad = torch.where(visible(q.shape[1], k.shape[1], ratio, q.device), grad.float(), 0.0)
    q32, k32 = q.float(), k.float()
    logits = torch.matmul(q32, k32.transpose(-1, -2).unsqueeze(1))  # [b, s, h, n]
    dweights = (grad.unsqueeze(2) * torch.relu(logits)).sum(-1) * scale
    g = torch.where(logits > 0, grad.unsqueeze(2) * (weights.float() * scale).unsqueeze(-1), 0.0)
    dq = torch.matmul(g, k32.unsqueeze(1))
    dk = torch.einsum("bshn,bshd->bnd", g, q32)
    return dq.to(q.dtype), dk.to(k.dtype), dweights


def _inputs(shape: dict, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    b, s, h, d, ratio = shape["b"], shape["s"], shape["h"], shape["d"], shape.get("ratio", 4)
    dtype = getattr(torch, shape.get("dtype", "float32"))
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s // ratio, d, generator=g).to(dtype)
    weights = torch.randn(b, s, h, generator=g) * h ** -0.5
    return q.to(device), k.to(device), weights.to(device), ratio, d ** -0.5


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    return Case(args=_inputs(shape, seed, device))


def _make_bwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, k, weights, ratio, scale = _inputs(shape, seed, device)
    grad = torch.randn(q.shape[0], q.shape[1], k.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    return Case(args=(grad.to(device), q, k, weights, ratio, scale))


def _flops(shape: dict) -> float:
    """The visible half of the ``s x n`` products (block causality), per head."""
    return shape["b"] * shape["s"] * (shape["s"] // shape.get("ratio", 4)) * shape["h"] * shape["d"]


# Odd sizes around the 16 x 32 tiles: d 24 padded to 32, 5 heads, s not a multiple of ratio, fewer entries than a
# tile; V4-Flash's 128-wide head in bf16.
_SHAPES = [dict(b=2, s=37, h=5, d=24), dict(b=1, s=70, h=3, d=128, dtype="bfloat16"), dict(b=1, s=9, h=2, d=16)]
_BENCH = [dict(b=1, s=4096, h=64, d=128, dtype="bfloat16"), dict(b=2, s=4096, h=64, d=128, dtype="bfloat16")]

indexer_logits_op = registry.register(
    OP, reference=indexer_logits_reference, triton="fused_ops.kernels.indexer_logits:indexer_logits",
    # fp32 products and sums both sides, another order: relative ~d * 2^-24 per logit (calc_diff ~1e-13)
    verify=VerifySpec(make_case=_make_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-9,
                      flops=lambda s: 2 * _flops(s)),
)
indexer_logits_backward_op = registry.register(
    BWD_OP, reference=indexer_logits_backward_reference,
    triton="fused_ops.kernels.indexer_logits:indexer_logits_backward",
    # bf16: the kernel's g enters its products in bf16 (2^-9 relative, calc_diff ~1e-6) and dq, dk round to bf16;
    # a wrong mask, ReLU gate or weight moves a gradient by > 1e-2
    verify=VerifySpec(make_case=_make_bwd_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-5,
                      flops=lambda s: 6 * _flops(s)),
)


@registry.torch_op(indexer_logits_backward_op)
def _indexer_logits_backward_torch_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                                      ratio: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dw = indexer_logits_backward_op(grad, q, k, weights, ratio, scale)
    return dq.contiguous(), dk.contiguous(), dw.contiguous()


# the backward recomputes the [b, s, h, n] logits from q, k and weights, never kept
@registry.torch_op(indexer_logits_op, recompute=_indexer_logits_backward_torch_op)
def _indexer_logits_torch_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int,
                             scale: float) -> torch.Tensor:
    return indexer_logits_op(q, k, weights, ratio, scale)


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """V4's index scores ``[b, s, n]`` (fp32, -inf where entry w is not visible to query t: ``w >= (t+1) // ratio``)
    from ``q [b, s, h, d]``, ``k [b, n, d]`` (q's dtype) and ``weights [b, s, h]`` (fp32); differentiable in all
    three (module docstring)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"indexer_logits: q must be a 4-d tensor [b, s, h, d], got {tuple(getattr(q, 'shape', ()))}")
    b, s, h, d = q.shape
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != d:
        raise ValueError(f"indexer_logits: k must be [{b}, n, {d}], got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"indexer_logits: k must have q's dtype {q.dtype}, got {k.dtype}")
    if tuple(weights.shape) != (b, s, h) or weights.dtype != torch.float32:
        raise ValueError(f"indexer_logits: weights must be float32 [{b}, {s}, {h}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if ratio < 1:
        raise ValueError(f"indexer_logits: ratio must be >= 1, got {ratio}")
    return _indexer_logits_torch_op(q.contiguous(), k.contiguous(), weights.contiguous(), int(ratio), float(scale))
