"""fp32 softmax attention in PyTorch with causal block skipping: the reference path of ``mla_attention``.

This is what the model trains with wherever the Triton kernel does not run (a CPU), so it is written
for speed on BLAS as much as for clarity. Queries are cut into blocks of ``block`` rows, as a flash
kernel tiles them; with ``causal``, query block ``[r0, r1)`` multiplies only keys ``[0, r1)``, so the
score and value GEMMs and the softmax cover ``(n + 1) / 2n`` of the square for ``n`` blocks (5/8 at
n = 4) instead of all of it. Only the diagonal block needs a mask: a ``[block, block]`` upper
triangle of -inf added in place. No ``[s, s]`` mask is ever built.

For backward it keeps what the flash kernel keeps, no more: its inputs q, k, v as given (views,
no copies), not the probabilities. Backward recomputes each block's scores and softmax (the same
ops, so the same probabilities bit for bit) before using them. That costs one more score GEMM per
block, and it makes a CPU run hold for backward what a GPU run holds (``s^2 / 2`` probabilities per
head would otherwise dominate the activation memory), which the memory accounting relies on.

Same arithmetic as ``softmax(q k^T * scale) v`` up to fp32 summation order: each kept score is one
dot product, and masked (finite) scores become exactly -inf (probability exactly 0), as in the full matrix.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

# Query rows per block. Forward+backward time relative to SDPA's math path, [batch 4 x 8 heads, 256, 48/32],
# 1 thread of a 2-core AVX2 CPU: 64 -> 0.65x, 32 -> 0.66x (more, smaller GEMMs), 128 -> 0.68x,
# 256 (one block: no skipping, only the mask handling saved) -> 0.85x.
CAUSAL_BLOCK = 64


def _causal_bias(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` fp32: -inf above the diagonal, 0 elsewhere. Adding it is exact (``x + 0 == x``) and ~5x
    cheaper on a CPU than ``masked_fill_`` with a broadcast bool mask on the strided diagonal block."""
    return torch.full((n, n), -math.inf, device=device).triu(1)


def blocked_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                              block: int = CAUSAL_BLOCK, with_lse: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out ``[b, s, h, dv]`` fp32, natural-log lse ``[b, h, s]`` fp32 with ``with_lse``, else None), no autograd."""
    b, s, h = q.shape[:3]
    block = block if causal else max(s, 1)
    if s == 0:  # an empty varlen sequence
        return v.new_empty(v.shape, dtype=torch.float32), q.new_empty(b, h, 0, dtype=torch.float32)
    q_scaled, k_t, v_h = _operands(q, k, v, scale)
    bias = _causal_bias(block, q.device) if causal else None
    outs, lses = [], []
    for i in range(-(-s // block)):
        p, keys = _block_probabilities(q_scaled, k_t, i, block, bias, lses if with_lse else None)
        outs.append(torch.bmm(p, v_h[:, :keys]))
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=1).view(b, h, s) if with_lse else None
    return out.view(b, h, s, -1).transpose(1, 2).contiguous(), lse


class _BlockedAttention(torch.autograd.Function):
    """q/k ``[b, s, h, dqk]``, v ``[b, s, h, dv]`` -> out ``[b, s, h, dv]`` fp32; saves q, k, v only."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, block: int):
        ctx.causal, ctx.scale, ctx.block = causal, scale, block
        ctx.save_for_backward(q, k, v)
        return blocked_attention_forward(q, k, v, causal, scale, block)[0]

    @staticmethod
    @once_differentiable  # a hand-written backward: a double backward through it raises instead of going wrong
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v = ctx.saved_tensors
        return (*blocked_attention_backward(grad_out, q, k, v, ctx.causal, ctx.scale, ctx.block), None, None, None)


def blocked_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               causal: bool, scale: float, block: int = CAUSAL_BLOCK
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``blocked_attention`` in q/k/v's dtypes, recomputing each block's probabilities with the
    forward's ops (no autograd: the backward kernel op's reference runs below autograd)."""
    b, s, h = q.shape[:3]
    block = block if causal else max(s, 1)
    if s == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q_scaled, k_t, v_h = _operands(q, k, v, scale)
    k_h = k_t.transpose(1, 2)
    grad_out = _heads_first(grad_out)
    v_t = v_h.transpose(1, 2)
    bias = _causal_bias(block, q.device) if causal else None
    n_blocks = -(-s // block)
    grad_q = [None] * n_blocks
    grad_k = grad_v = None
    # last block first: it reaches every key, so it creates dK and dV and earlier blocks add to a prefix
    for i in reversed(range(n_blocks)):
        p, keys = _block_probabilities(q_scaled, k_t, i, block, bias)
        r0, r1 = i * block, min((i + 1) * block, s)
        d_o = grad_out[:, r0:r1]
        d_p = torch.bmm(d_o, v_t[:, :, :keys])
        d_s = torch._softmax_backward_data(d_p, p, -1, p.dtype)  # what autograd runs for softmax
        grad_q[i] = torch.bmm(d_s, k_h[:, :keys])
        dv_part = torch.bmm(p.transpose(1, 2), d_o)
        dk_part = torch.bmm(d_s.transpose(1, 2), q_scaled[:, r0:r1])
        if grad_v is None:
            grad_v, grad_k = dv_part, dk_part
        else:
            grad_v[:, :keys] += dv_part
            grad_k[:, :keys] += dk_part
    grad_q = (torch.cat(grad_q, dim=1) if len(grad_q) > 1 else grad_q[0]).mul_(scale)

    def back(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return g.view(b, h, s, -1).transpose(1, 2).to(like.dtype)

    return back(grad_q, q), back(grad_k, k), back(grad_v, v)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` -> fp32 ``[b * h, s, d]`` (a copy, or a view when b or h is 1: never write to it)."""
    b, s, h, d = t.shape
    return t.float().transpose(1, 2).reshape(b * h, s, d)


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(q * scale, k^T, v), heads first in fp32: one pass over q instead of one over every score block."""
    return _heads_first(q) * scale, _heads_first(k).transpose(1, 2), _heads_first(v)


def _block_probabilities(q_scaled: torch.Tensor, k_t: torch.Tensor, i: int, block: int,
                         bias: torch.Tensor | None, lses: list | None = None) -> tuple[torch.Tensor, int]:
    """Query block ``i``'s softmax probabilities ``[n, rows, keys]`` and ``keys``; causal when ``bias``
    (the -inf upper triangle) is given: the block sees keys ``[0, r1)`` only. ``lses``: append the block's
    log-sum-exp ``[n, rows]`` to it."""
    s = q_scaled.shape[1]
    r0, r1 = i * block, min((i + 1) * block, s)
    keys = r1 if bias is not None else s
    scores = torch.bmm(q_scaled[:, r0:r1], k_t[:, :, :keys])
    if bias is not None:
        scores[:, :, r0:r1] += bias[: r1 - r0, : r1 - r0]
    if lses is not None:
        lses.append(scores.logsumexp(dim=-1))
    return scores.softmax(dim=-1), keys


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      block: int = CAUSAL_BLOCK) -> torch.Tensor:
    """``softmax(q k^T * scale [+ causal mask]) v`` in fp32: ``[batch, seq, heads, d]`` -> ``[.., heads, dv]``.

    ``causal`` masks key j > query i (top-left aligned, q and k of equal length). Differentiable; the
    output is fp32 whatever the input dtype.
    """
    if block < 1:
        raise ValueError(f"blocked_attention: block must be >= 1, got {block}")
    return _BlockedAttention.apply(q, k, v, causal, scale, block)
