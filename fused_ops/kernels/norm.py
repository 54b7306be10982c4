"""RMSNorm with the residual add and, optionally, the next GEMM's 1x128 FP8 cast, in one pass over the row.

``h = x + residual`` (rounded to the input dtype, as torch's add) is the updated residual stream;
``y = (h * rstd).to(dtype) * weight`` with ``rstd = 1 / sqrt(mean(h^2) + eps)`` in fp32, the model's
``RMSNorm`` numerics. One program per row: a first sweep sums ``h^2`` (and writes ``h``), a second
normalises; a row of V3's 7168 values is one chunk, so the second sweep re-reads it from L1/L2, not HBM.
The backward recomputes ``x_hat = h * rstd`` from the kept ``h`` and ``rstd`` (V3 never stores a norm's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from fused_ops.kernels.common import on_grid, store_fp8

MAX_CHUNK = 8192  # columns per sweep step; the backward holds a whole row, so it takes rows up to this


@triton.jit
def _row_chunk(X, R, start, D, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Columns ``start + [0, BLOCK)`` of one row of ``h = x (+ residual)`` in fp32, zeros past the row's end."""
    cols = start + tl.arange(0, BLOCK)
    h = tl.load(X + cols, mask=cols < D, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = on_grid(h + tl.load(R + cols, mask=cols < D, other=0.0).to(tl.float32), X.dtype.element_ty)
    return h


@triton.jit
def _row_rstd(X, R, H, D, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """First sweep: ``1 / sqrt(mean(h^2) + eps)`` of one row, storing ``h`` when a residual is added."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, D, BLOCK):
        h = _row_chunk(X, R, start, D, HAS_RESIDUAL, BLOCK)
        if HAS_RESIDUAL:
            cols = start + tl.arange(0, BLOCK)
            tl.store(H + cols, h.to(H.dtype.element_ty), mask=cols < D)
        acc += h * h
    return 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)


@triton.jit
def _normalised(X, R, W, Y, start, rstd, D, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """``(h * rstd).to(x's dtype) * weight`` rounded to the output's dtype (torch's promotion of the two)."""
    h = _row_chunk(X, R, start, D, HAS_RESIDUAL, BLOCK)
    cols = start + tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    return on_grid(on_grid(h * rstd, X.dtype.element_ty) * w, Y.dtype.element_ty)


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, H, RSTD, D, stride_x, stride_r, stride_y, stride_h, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X, R, Y, H = X + row * stride_x, R + row * stride_r, Y + row * stride_y, H + row * stride_h
    rstd = _row_rstd(X, R, H, D, eps, HAS_RESIDUAL, BLOCK)
    tl.store(RSTD + row, rstd)
    for start in range(0, D, BLOCK):
        y = _normalised(X, R, W, Y, start, rstd, D, HAS_RESIDUAL, BLOCK)
        cols = start + tl.arange(0, BLOCK)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cols < D)


@triton.jit
def _rmsnorm_fp8_kernel(X, R, W, Y, H, RSTD, Q, S, D, stride_x, stride_r, stride_y, stride_h, stride_q, stride_s,
                        eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X, R, Y, H = X + row * stride_x, R + row * stride_r, Y + row * stride_y, H + row * stride_h
    rstd = _row_rstd(X, R, H, D, eps, HAS_RESIDUAL, BLOCK)
    tl.store(RSTD + row, rstd)
    for start in range(0, D, BLOCK):
        y = _normalised(X, R, W, Y, start, rstd, D, HAS_RESIDUAL, BLOCK)
        cols = start + tl.arange(0, BLOCK)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cols < D)
        store_fp8(Q + row * stride_q, S + row * stride_s, y, start, D, BLOCK)


@triton.jit
def _rmsnorm_backward_kernel(H, W, RSTD, DY, DH, DX, DW, M, D, stride_h, stride_dy, stride_dh, stride_dx,
                             HAS_DH: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``pid, pid + programs, ...``: ``dx = rstd (g - x_hat mean(g x_hat)) (+ dh)``, ``g = dy w``; this
    program's share of ``dw = sum(dy x_hat)`` goes to row ``pid`` of ``DW`` (summed over programs after)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for i in range(0, tl.cdiv(M - pid, tl.num_programs(0))):
        row = pid.to(tl.int64) + i * tl.num_programs(0)
        rstd = tl.load(RSTD + row)
        x_hat = tl.load(H + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32) * rstd
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        dw += dy * x_hat
        g = dy * w
        dx = (g - x_hat * (tl.sum(g * x_hat, axis=0) / D)) * rstd
        if HAS_DH:
            dx += tl.load(DH + row * stride_dh + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, on_grid(dx, DX.dtype.element_ty).to(DX.dtype.element_ty), mask=ok)
    tl.store(DW + pid * D + cols, dw, mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype not in (torch.float32, torch.bfloat16):
        raise registry.Unsupported(f"x and weight must be float32/bfloat16, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise registry.Unsupported("x must be 2-D [rows, dim] with contiguous rows, weight contiguous")


def _launch_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    rows, dim = x.shape
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.float32  # torch's promotion of bf16/fp32
    out = registry.empty(rows, dim, dtype=out_dtype, device=x.device)
    h = x if residual is None else registry.empty(rows, dim, dtype=x.dtype, device=x.device)
    rstd = registry.empty(rows, dtype=torch.float32, device=x.device)
    r = x if residual is None else residual
    return out, h, rstd, r


def _warps(block: int) -> int:
    """16 warps for V3's 7168-value rows: 8 values of a row per thread (one 128-bit access per tensor), ~100
    registers in the backward, so 16 warps per SM stay resident (with 8: 180 registers, 8 warps per SM)."""
    return 16 if block >= 4096 else 8 if block >= 2048 else 4


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6):
    """(y, h, rstd) for a residual, else (y, rstd); see ``fused_ops.ops.rmsnorm_reference``."""
    _check(x, weight)
    y, h, rstd, r = _launch_args(x, weight, residual)
    block = min(MAX_CHUNK, triton.next_power_of_2(x.shape[1]))
    if x.shape[0]:
        registry.wrap_triton(_rmsnorm_kernel)[(x.shape[0],)](x, r, weight, y, h, rstd, x.shape[1], x.stride(0),
                                                             r.stride(0), y.stride(0), h.stride(0), eps,
                                                             HAS_RESIDUAL=residual is not None, BLOCK=block,
                                                             num_warps=_warps(block))
    return (y, rstd) if residual is None else (y, h, rstd)


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6):
    """``rmsnorm`` plus the 1x128 e4m3 cast of ``y``: (y, [h,] rstd, y_fp8, scales)."""
    _check(x, weight)
    rows, dim = x.shape
    y, h, rstd, r = _launch_args(x, weight, residual)
    q = registry.empty(rows, dim, dtype=torch.float8_e4m3fn, device=x.device)
    sf = registry.empty(rows, triton.cdiv(dim, 128), dtype=torch.float32, device=x.device)
    block = min(MAX_CHUNK, max(128, triton.next_power_of_2(dim)))
    if rows:
        registry.wrap_triton(_rmsnorm_fp8_kernel)[(rows,)](x, r, weight, y, h, rstd, q, sf, dim, x.stride(0),
                                                           r.stride(0), y.stride(0), h.stride(0), q.stride(0),
                                                           sf.stride(0), eps, HAS_RESIDUAL=residual is not None,
                                                           BLOCK=block, num_warps=_warps(block))
    return (y, rstd, q, sf) if residual is None else (y, h, rstd, q, sf)


def backward_programs(rows: int, device: torch.device) -> int:
    """Programs of the backward (each sums its rows' share of ``dw``): a few per SM, at most one per row."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64
    return max(1, min(rows, 4 * sms))


def rmsnorm_backward(h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor,
                     grad_h: torch.Tensor | None = None):
    """(dx, dw): the input's gradient (plus ``grad_h``, the updated residual's) and the weight's (fp32)."""
    _check(h, weight)
    rows, dim = h.shape
    if dim > MAX_CHUNK or grad_y.stride(-1) != 1 or (grad_h is not None and grad_h.stride(-1) != 1):
        raise registry.Unsupported(f"backward takes rows of <= {MAX_CHUNK} values with contiguous gradients")
    dx = registry.empty(rows, dim, dtype=h.dtype, device=h.device)
    programs = backward_programs(rows, h.device)
    partial = registry.empty(programs, dim, dtype=torch.float32, device=h.device)
    dh = grad_y if grad_h is None else grad_h
    block = triton.next_power_of_2(dim)
    if rows:
        registry.wrap_triton(_rmsnorm_backward_kernel)[(programs,)](h, weight, rstd, grad_y, dh, dx, partial, rows, dim,
                                                                    h.stride(0), grad_y.stride(0), dh.stride(0),
                                                                    dx.stride(0), HAS_DH=grad_h is not None,
                                                                    BLOCK=block, num_warps=_warps(block))
    return dx, partial.sum(0) if rows else torch.zeros(dim, dtype=torch.float32, device=h.device)
