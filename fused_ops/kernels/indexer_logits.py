"""V4's lightning-indexer logits over compressed keys, block-causal, forward and backward.

``I[t, w] = scale * sum_h wt[t, h] ReLU(q[t, h] . k[w])`` for ``w < (t + 1) // ratio``, else -inf. Forward: one
program per (query block, entry block); the entry block's keys stay in registers while the heads stream past
(the ``[t, h, w]`` logits never reach memory, which is the point: unfused they are ``h`` times the output).
Backward, the logits recomputed per tile: ``g = dI * scale * wt * [q.k > 0]``; ``dq[t, h] = sum_w g k[w]`` and
``dwt[t, h] = scale sum_w dI ReLU(q.k)`` by (query block, head) programs over the visible entry blocks only;
``dk[w] = sum_{t, h} g q[t, h]`` by entry-block programs over the queries that see them (``t >= (w+1) ratio - 1``).
Products are fp32 on both sides (``input_precision="ieee"``: no TF32 for fp32 inputs; bf16 products are exact);
with bf16 inputs the backward's ``g`` enters its two products in bf16, as every flash backward's ``dS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import accel
from accel import registry
from fused_ops.kernels.common import on_grid

BLOCK_T, BLOCK_N = 16, 32


@triton.jit
def _load_q(Q, b, t, h, S, H, D, BLOCK_D: tl.constexpr):
    """Head ``h``'s queries ``[BLOCK_T, BLOCK_D]`` of rows ``t`` (zeros past s and d)."""
    cols = tl.arange(0, BLOCK_D)
    offs = ((b * S + t.to(tl.int64)) * H + h)[:, None] * D + cols[None, :]
    return tl.load(Q + offs, mask=(t < S)[:, None] & (cols < D)[None, :], other=0.0)


@triton.jit
def _load_k(K, b, w, N, D, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    offs = (b * N + w.to(tl.int64))[:, None] * D + cols[None, :]
    return tl.load(K + offs, mask=(w < N)[:, None] & (cols < D)[None, :], other=0.0)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 products and sum; ``UPCAST``: operands in fp32 (the interpreter's bf16 dot is wrong)."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _visible(t, w, S, N, RATIO):
    return (t < S)[:, None] & (w < N)[None, :] & (w[None, :] < ((t + 1) // RATIO)[:, None])


@triton.jit
def _indexer_logits_kernel(Q, K, WT, OUT, S, N, H, D, RATIO, scale,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_k(K, b, w, N, D, BLOCK_D)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if tl.program_id(1) * BLOCK_N < (tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, S)) // RATIO:  # any visible
        for h in range(0, H):
            q = _load_q(Q, b, t, h, S, H, D, BLOCK_D)
            wt = tl.load(WT + (b * S + t.to(tl.int64)) * H + h, mask=t < S, other=0.0).to(tl.float32)
            logits = _dot(q, tl.trans(k), UPCAST)
            acc += tl.maximum(logits, 0.0) * wt[:, None]
    out = tl.where(_visible(t, w, S, N, RATIO), acc * scale, float("-inf"))
    offs = (b * S + t.to(tl.int64))[:, None] * N + w[None, :]
    tl.store(OUT + offs, out, mask=(t < S)[:, None] & (w < N)[None, :])


@triton.jit
def _dq_kernel(Q, K, WT, DI, DQ, DWT, S, N, H, D, RATIO, scale,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    q = _load_q(Q, b, t, h, S, H, D, BLOCK_D)
    wt = tl.load(WT + (b * S + t.to(tl.int64)) * H + h, mask=t < S, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    dwt = tl.zeros([BLOCK_T], tl.float32)
    seen = tl.minimum(tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, S) // RATIO, N)  # entries any row sees
    for n0 in range(0, seen, BLOCK_N):
        w = n0 + tl.arange(0, BLOCK_N)
        k = _load_k(K, b, w, N, D, BLOCK_D)
        vis = _visible(t, w, S, N, RATIO)
        di = tl.load(DI + (b * S + t.to(tl.int64))[:, None] * N + w[None, :], mask=vis, other=0.0)
        logits = _dot(q, tl.trans(k), UPCAST)
        dwt += tl.sum(di * tl.maximum(logits, 0.0), axis=1)
        g = tl.where(logits > 0, di * (wt * scale)[:, None], 0.0)
        dq += _dot(on_grid(g, K.dtype.element_ty).to(k.dtype), k, UPCAST)
    cols = tl.arange(0, BLOCK_D)
    offs = ((b * S + t.to(tl.int64)) * H + h)[:, None] * D + cols[None, :]
    tl.store(DQ + offs, on_grid(dq, DQ.dtype.element_ty).to(DQ.dtype.element_ty),
             mask=(t < S)[:, None] & (cols < D)[None, :])
    tl.store(DWT + (b * S + t.to(tl.int64)) * H + h, dwt * scale, mask=t < S)


@triton.jit
def _dk_kernel(Q, K, WT, DI, DK, S, N, H, D, RATIO, scale,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    w = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_k(K, b, w, N, D, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = ((tl.program_id(0) * BLOCK_N + 1) * RATIO - 1) // BLOCK_T * BLOCK_T  # the first query seeing the block
    for t0 in range(first, S, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        vis = _visible(t, w, S, N, RATIO)
        di = tl.load(DI + (b * S + t.to(tl.int64))[:, None] * N + w[None, :], mask=vis, other=0.0)
        for h in range(0, H):
            q = _load_q(Q, b, t, h, S, H, D, BLOCK_D)
            wt = tl.load(WT + (b * S + t.to(tl.int64)) * H + h, mask=t < S, other=0.0).to(tl.float32)
            logits = _dot(q, tl.trans(k), UPCAST)
            g = tl.where(logits > 0, di * (wt * scale)[:, None], 0.0)
            dk += _dot(tl.trans(on_grid(g, Q.dtype.element_ty)).to(q.dtype), q, UPCAST)
    cols = tl.arange(0, BLOCK_D)
    offs = (b * N + w.to(tl.int64))[:, None] * D + cols[None, :]
    tl.store(DK + offs, on_grid(dk, DK.dtype.element_ty).to(DK.dtype.element_ty),
             mask=(w < N)[:, None] & (cols < D)[None, :])


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> int:
    if q.dtype not in _FLOATS or k.dtype != q.dtype or weights.dtype != torch.float32:
        raise registry.Unsupported(f"q, k must share a float dtype and weights be fp32, got {q.dtype}, {k.dtype}, "
                                   f"{weights.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and weights.is_contiguous()):
        raise registry.Unsupported("q, k and weights must be contiguous")
    if q.shape[-1] > 256:
        raise registry.Unsupported(f"head_dim must be <= 256, got {q.shape[-1]}")
    return max(16, triton.next_power_of_2(q.shape[-1]))


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """``fused_ops.indexer_logits``: ``q [b, s, h, d]``, ``k [b, n, d]``, ``weights [b, s, h]`` -> ``[b, s, n]``."""
    block_d = _check(q, k, weights)
    b, s, h, d = q.shape
    n = k.shape[1]
    out = registry.empty(b, s, n, dtype=torch.float32, device=q.device)
    if b * s * n:
        grid = (triton.cdiv(s, BLOCK_T), triton.cdiv(n, BLOCK_N), b)
        registry.wrap_triton(_indexer_logits_kernel)[grid](q, k, weights, out, s, n, h, d, ratio, scale,
                                                           BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            UPCAST=accel.triton_interpreted())
    return out


def indexer_logits_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                            ratio: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dweights) from the logits' ``grad`` (ignored where an entry is not visible)."""
    block_d = _check(q, k, weights)
    if grad.dtype != torch.float32 or not grad.is_contiguous():
        raise registry.Unsupported(f"grad must be contiguous fp32, got {grad.dtype}")
    b, s, h, d = q.shape
    n = k.shape[1]
    dq = registry.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = registry.empty(k.shape, dtype=k.dtype, device=q.device)
    dwt = registry.empty(weights.shape, dtype=torch.float32, device=q.device)
    if b * s * h:
        registry.wrap_triton(_dq_kernel)[(triton.cdiv(s, BLOCK_T), h, b)](
            q, k, weights, grad, dq, dwt, s, n, h, d, ratio, scale, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            UPCAST=accel.triton_interpreted())
    if b * n:
        registry.wrap_triton(_dk_kernel)[(triton.cdiv(n, BLOCK_N), b)](
            q, k, weights, grad, dk, s, n, h, d, ratio, scale, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            UPCAST=accel.triton_interpreted())
    return dq, dk, dwt
