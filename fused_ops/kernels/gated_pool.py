"""V4 compressor's gated pool: one program per (compressed entry, column block), the entry's window in registers.

Entry ``i`` reads its ``W`` rows (``2m`` with overlap: window ``i-1``'s first ``d`` columns, Ca, then window
``i``'s last ``d``, Cb; else window ``i``'s ``m`` rows) of ``kv`` and ``score`` for ``BLOCK_D`` columns, adds the
position bias ``ape``, takes the softmax down the rows in fp32 and pools: the model's rounding points are kept
(score + ape in their promoted dtype, the weights and each product in kv's dtype, the sum in fp32 rounded once),
so the kernel differs from ``fused_ops.gated_pool``'s reference only in the sum's order. Entry 0's Ca rows do not
exist (padding: weight 0). Every input element belongs to exactly one entry, so the backward writes each
gradient once, without atomics: ``dkv = p dout``, ``dscore = p dout (kv - out)`` (``out`` the fp32 pool), and
the last window's Ca rows, which no entry reads, get 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from fused_ops.kernels.common import on_grid

BLOCK_D = 32  # columns per program: a 2m = 8 row window is 256 values; HCA's 128 rows are 4096


@triton.jit
def _window(KV, S, APE, entry, b, col0, N, CD, D, M: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr,
            SUM_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """(offsets into kv/score ``[W, BLOCK_D]``, mask, kv fp32, softmax weights fp32) of one entry's window."""
    r = tl.arange(0, W)
    cols = col0 + tl.arange(0, BLOCK_D)
    if OVERLAP:  # rows < m: window entry-1's Ca (columns [0, d)); rows >= m: window entry's Cb ([d, 2d))
        ca = r < M
        token = (entry - 1) * M + r
        token = tl.where(ca, token, entry * M + r - M)
        col = tl.where(ca[:, None], cols[None, :], D + cols[None, :])
        row_ok = (token >= 0)
        pos = tl.where(ca, r, r - M)
    else:
        token = entry * M + r
        col = cols[None, :] + 0 * r[:, None]
        row_ok = r >= 0
        pos = r
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = (b * N * M + token.to(tl.int64))[:, None] * CD + col
    kv = tl.load(KV + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
    s = on_grid(s + tl.load(APE + pos[:, None] * CD + col, mask=mask, other=0.0).to(tl.float32), SUM_DTYPE)
    s = tl.where(row_ok[:, None], s, float("-inf"))
    e = tl.exp(s - tl.max(s, axis=0)[None, :])
    p = e / tl.sum(e, axis=0)[None, :]
    return offs, mask, kv, p


@triton.jit
def _gated_pool_kernel(KV, S, APE, OUT, N, CD, D, M: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr,
                       SUM_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # b * N + entry
    b, entry = row // N, row % N
    col0 = tl.program_id(1) * BLOCK_D
    _, _, kv, p = _window(KV, S, APE, entry, b, col0, N, CD, D, M, W, OVERLAP, SUM_DTYPE, BLOCK_D)
    prod = on_grid(kv * on_grid(p, KV.dtype.element_ty), KV.dtype.element_ty)
    cols = col0 + tl.arange(0, BLOCK_D)
    out = tl.sum(prod, axis=0)
    tl.store(OUT + row.to(tl.int64) * D + cols, on_grid(out, OUT.dtype.element_ty).to(OUT.dtype.element_ty),
             mask=cols < D)


@triton.jit
def _gated_pool_backward_kernel(KV, S, APE, DOUT, DKV, DS, N, CD, D, M: tl.constexpr, W: tl.constexpr,
                                OVERLAP: tl.constexpr, SUM_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    b, entry = row // N, row % N
    col0 = tl.program_id(1) * BLOCK_D
    offs, mask, kv, p = _window(KV, S, APE, entry, b, col0, N, CD, D, M, W, OVERLAP, SUM_DTYPE, BLOCK_D)
    cols = col0 + tl.arange(0, BLOCK_D)
    dout = tl.load(DOUT + row.to(tl.int64) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = tl.sum(p * kv, axis=0)
    dkv = p * dout[None, :]
    ds = dkv * (kv - out[None, :])
    tl.store(DKV + offs, on_grid(dkv, DKV.dtype.element_ty).to(DKV.dtype.element_ty), mask=mask)
    tl.store(DS + offs, on_grid(ds, DS.dtype.element_ty).to(DS.dtype.element_ty), mask=mask)
    if OVERLAP:  # the last window's Ca rows feed no entry
        if entry == N - 1:
            r = tl.arange(0, M)
            last = (b * N * M + entry * M + r.to(tl.int64))[:, None] * CD + cols[None, :]
            zero = (cols < D)[None, :] & (r >= 0)[:, None]
            tl.store(DKV + last, tl.zeros([M, BLOCK_D], tl.float32).to(DKV.dtype.element_ty), mask=zero)
            tl.store(DS + last, tl.zeros([M, BLOCK_D], tl.float32).to(DS.dtype.element_ty), mask=zero)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _promoted(a: torch.dtype, b: torch.dtype):
    """torch's promotion of two float dtypes (score + ape), as Triton's type; host logic, no torch operator."""
    return _TL[a] if a == b else tl.float32


def _check(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int) -> None:
    for name, t in (("kv", kv), ("score", score), ("ape", ape)):
        if t.dtype not in _TL or not t.is_contiguous():
            raise registry.Unsupported(f"{name} must be contiguous float32/bfloat16/float16, got {t.dtype}")
    if ratio & (ratio - 1) or ratio > 256:
        raise registry.Unsupported(f"ratio must be a power of two <= 256, got {ratio}")


def _launch(kernel, kv, score, ape, ratio: int, overlap: bool, *outs):
    b, t, cd = kv.shape
    n, d = t // ratio, cd // (2 if overlap else 1)
    if b * n:
        grid = (b * n, triton.cdiv(d, BLOCK_D))
        registry.wrap_triton(kernel)[grid](kv, score, ape, *outs, n, cd, d, M=ratio, W=ratio * (2 if overlap else 1),
                                           OVERLAP=overlap, SUM_DTYPE=_promoted(score.dtype, ape.dtype),
                                           BLOCK_D=BLOCK_D, num_warps=4 if ratio * BLOCK_D >= 1024 else 1)


def gated_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """``fused_ops.gated_pool``: ``[b, n * ratio, (2) d]`` rows -> ``[b, n, d]`` pooled entries in kv's dtype."""
    _check(kv, score, ape, ratio)
    b, t, cd = kv.shape
    out = registry.empty(b, t // ratio, cd // (2 if overlap else 1), dtype=kv.dtype, device=kv.device)
    _launch(_gated_pool_kernel, kv, score, ape, ratio, overlap, out)
    return out


def gated_pool_backward(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
                        overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(d kv, d score) of the pool from the pooled entries' ``grad``, the weights recomputed."""
    _check(kv, score, ape, ratio)
    if not grad.is_contiguous() or grad.dtype not in _TL:
        raise registry.Unsupported(f"grad must be contiguous float32/bfloat16/float16, got {grad.dtype}")
    dkv = registry.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    ds = registry.empty(score.shape, dtype=score.dtype, device=kv.device)
    _launch(_gated_pool_backward_kernel, kv, score, ape, ratio, overlap, grad, dkv, ds)
    return dkv, ds
