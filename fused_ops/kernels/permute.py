"""MoE permute / unpermute row movement: tokens into the grouped GEMM's contiguous layout and back.

The layout (``fused_ops.permute.grouping``) is given by two index vectors: ``assign [M]``, the (token, slot)
assignment ``t * k + j`` copied to each grouped row (-1 on padding rows), and ``rows [T * k]``, the grouped
row of each assignment. Gathers only, never scatters, so no atomics and every output row is written once:

- ``gather``: grouped row ``m`` <- token ``assign[m] // k`` (values, their 1x128 scales when FP8, and the
  routing weight ``weights[assign[m]]``); zeros on padding rows. The permute forward.
- ``gather_fp8``: the same from bf16/fp32 tokens, cast to e4m3 with 1x128 scales on the way (permute + quant).
- ``gather_rows``: row ``m`` <- ``[x[assign[m] // k], columns[assign[m]]]``, the source row with a few
  per-assignment columns appended (expert parallelism's rows to send, routing weights as columns).
- ``gather_dequant_fp8``: row ``m`` <- e4m3 row ``assign[m]`` times its 1x128 scales, rounded to the output
  dtype, and that result's own 1x128 cast (what the GEMM it feeds would make of it; k = 1), or the cast alone.
  Expert parallelism's FP8 rows that landed, into the grouped layout.
- ``sum_rows``: token ``t`` <- ``sum_j w[t, j] y[rows[t k + j]]`` in fp32, a row index < 0 adding nothing (an
  assignment that was dropped). The unpermute forward, and the permute backward (``w = 1``).
- ``spread``: grouped row ``m`` <- ``w[a] g[t]`` and ``dw[a] = g[t] . y[m]`` for ``a = assign[m]``. The
  unpermute backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from fused_ops.kernels.common import on_grid, store_fp8

CHUNK_BYTES = 2048  # per row step: 16 bytes (one 128-bit access) per thread of 4 warps


@triton.jit
def _source(ASSIGN, K, D):
    """(grouped row, assignment, token, columns to read: ``D`` or 0 on a padding row) of this program."""
    m = tl.program_id(0).to(tl.int64)
    a = tl.load(ASSIGN + m).to(tl.int64)
    real = a >= 0
    return m, tl.where(real, a, 0), tl.where(real, a, 0) // K, tl.where(real, D, 0)


@triton.jit
def _copy_row(SRC, DST, readable, D, BLOCK: tl.constexpr):
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(SRC + cols, mask=cols < readable, other=0.0)
        tl.store(DST + cols, v, mask=cols < D)


@triton.jit
def _gather_kernel(ASSIGN, X, XS, W, OUT, OUTS, OUTW, K, D, DS, stride_x, stride_xs, stride_out, stride_outs,
                   HAS_SCALES: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    m, a, t, readable = _source(ASSIGN, K, D)
    _copy_row(X + t * stride_x, OUT + m * stride_out, readable, D, BLOCK)
    if HAS_SCALES:
        _copy_row(XS + t * stride_xs, OUTS + m * stride_outs, tl.minimum(readable, DS), DS, BLOCK_S)
    if HAS_WEIGHTS:
        tl.store(OUTW + m, tl.where(readable > 0, tl.load(W + a), 0.0))


@triton.jit
def _gather_rows_kernel(ASSIGN, X, C, OUT, K, D, NC, stride_x, stride_c, stride_out, HAS_COLUMNS: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    m, a, t, readable = _source(ASSIGN, K, D)
    _copy_row(X + t * stride_x, OUT + m * stride_out, readable, D, BLOCK)
    if HAS_COLUMNS:
        _copy_row(C + a * stride_c, OUT + m * stride_out + D, tl.minimum(readable, NC), NC, BLOCK_C)


@triton.jit
def _gather_fp8_kernel(ASSIGN, X, W, Q, S, OUTW, K, D, stride_x, stride_q, stride_s, HAS_WEIGHTS: tl.constexpr,
                       BLOCK: tl.constexpr):
    m, a, t, readable = _source(ASSIGN, K, D)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + t * stride_x + cols, mask=cols < readable, other=0.0).to(tl.float32)
        store_fp8(Q + m * stride_q, S + m * stride_s, x, start, D, BLOCK)
    if HAS_WEIGHTS:
        tl.store(OUTW + m, tl.where(readable > 0, tl.load(W + a), 0.0))


@triton.jit
def _gather_dequant_fp8_kernel(ASSIGN, Q, S, W, X, Q2, S2, OUTW, D, stride_q, stride_s, stride_x, stride_q2,
                               stride_s2, HAS_VALUES: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    m, a, t, readable = _source(ASSIGN, 1, D)
    dtype = X.dtype.element_ty  # (without HAS_VALUES, X is a one-element tensor of the rows' dtype)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        q = tl.load(Q + t * stride_q + cols, mask=cols < readable, other=0.0).to(tl.float32)
        sf = tl.load(S + t * stride_s + cols // 128, mask=cols < readable, other=0.0)
        x = on_grid(q * sf, dtype)
        if HAS_VALUES:
            tl.store(X + m * stride_x + cols, x.to(dtype), mask=cols < D)
        store_fp8(Q2 + m * stride_q2, S2 + m * stride_s2, x, start, D, BLOCK)
    if HAS_WEIGHTS:
        tl.store(OUTW + m, tl.where(readable > 0, tl.load(W + a), 0.0))


@triton.jit
def _sum_rows_kernel(ROWS, Y, W, OUT, K, D, stride_y, stride_out, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = OUT.dtype.element_ty
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(K):
            row = tl.load(ROWS + t * K + j).to(tl.int64)
            y = tl.load(Y + row * stride_y + cols, mask=cols < tl.where(row >= 0, D, 0), other=0.0).to(tl.float32)
            if HAS_WEIGHTS:  # the weight in y's dtype and the product rounded to it, as the unfused ``(y * w).sum``
                y = on_grid(y * on_grid(tl.load(W + t * K + j), dtype), dtype)
            acc += y
        tl.store(OUT + t * stride_out + cols, on_grid(acc, dtype).to(dtype), mask=cols < D)


@triton.jit
def _spread_kernel(ASSIGN, G, Y, W, DY, DW, K, D, stride_g, stride_y, stride_dy, BLOCK: tl.constexpr):
    m, a, t, readable = _source(ASSIGN, K, D)
    dtype = DY.dtype.element_ty
    w = on_grid(tl.load(W + a), dtype)
    dot = tl.zeros([BLOCK], tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        g = tl.load(G + t * stride_g + cols, mask=cols < readable, other=0.0).to(tl.float32)
        dot += g * tl.load(Y + m * stride_y + cols, mask=cols < readable, other=0.0).to(tl.float32)
        tl.store(DY + m * stride_dy + cols, on_grid(g * w, dtype).to(dtype), mask=cols < D)
    if readable > 0:  # a padding row holds no assignment: no weight gradient to write
        tl.store(DW + a, tl.sum(dot, axis=0))


def _block(x: torch.Tensor, d: int, floor: int = 1) -> int:
    return min(CHUNK_BYTES // x.element_size(), max(floor, triton.next_power_of_2(d)))


def _rows_ok(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise registry.Unsupported(f"{name} must be 2-D with contiguous rows, got shape {list(x.shape)}")


def gather(x: torch.Tensor, assign: torch.Tensor, k: int, scales: torch.Tensor | None = None,
           weights: torch.Tensor | None = None):
    """(grouped values, grouped scales or None, grouped weights or None)."""
    _rows_ok("x", x)
    rows, d = assign.numel(), x.shape[1]
    out = registry.empty(rows, d, dtype=x.dtype, device=x.device)
    outs = None if scales is None else registry.empty(rows, scales.shape[1], dtype=scales.dtype, device=x.device)
    outw = None if weights is None else registry.empty(rows, dtype=weights.dtype, device=x.device)
    if scales is not None:
        _rows_ok("scales", scales)
    ds = 1 if scales is None else scales.shape[1]
    if rows:
        registry.wrap_triton(_gather_kernel)[(rows,)](assign, x, x if scales is None else scales,
                                                      x if weights is None else weights, out,
                                                      out if outs is None else outs, out if outw is None else outw, k,
                                                      d, ds, x.stride(0), 0 if scales is None else scales.stride(0),
                                                      out.stride(0), 0 if outs is None else outs.stride(0),
                                                      HAS_SCALES=scales is not None, HAS_WEIGHTS=weights is not None,
                                                      BLOCK=_block(x, d), BLOCK_S=triton.next_power_of_2(ds))
    return out, outs, outw


def gather_rows(x: torch.Tensor, assign: torch.Tensor, k: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(assign), d + columns]`` in x's dtype: each row's source row, then its assignment's columns."""
    _rows_ok("x", x)
    nc = 0
    if columns is not None:
        _rows_ok("columns", columns)
        if columns.dtype != x.dtype:
            raise registry.Unsupported(f"columns must have x's dtype {x.dtype}, got {columns.dtype}")
        nc = columns.shape[1]
    rows, d = assign.numel(), x.shape[1]
    out = registry.empty(rows, d + nc, dtype=x.dtype, device=x.device)
    if rows:
        registry.wrap_triton(_gather_rows_kernel)[(rows,)](assign, x, x if columns is None else columns, out, k, d, nc,
                                                           x.stride(0), 0 if columns is None else columns.stride(0),
                                                           out.stride(0), HAS_COLUMNS=columns is not None,
                                                           BLOCK=_block(x, d),
                                                           BLOCK_C=triton.next_power_of_2(max(nc, 1)))
    return out


def gather_fp8(x: torch.Tensor, assign: torch.Tensor, k: int, weights: torch.Tensor | None = None):
    """(grouped e4m3 values, grouped 1x128 scales, grouped weights or None) from float32/bfloat16 tokens."""
    _rows_ok("x", x)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise registry.Unsupported(f"x must be float32/bfloat16 to be cast, got {x.dtype}")
    rows, d = assign.numel(), x.shape[1]
    q = registry.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
    sf = registry.empty(rows, triton.cdiv(d, 128), dtype=torch.float32, device=x.device)
    outw = None if weights is None else registry.empty(rows, dtype=weights.dtype, device=x.device)
    if rows:
        registry.wrap_triton(_gather_fp8_kernel)[(rows,)](assign, x, x if weights is None else weights, q, sf,
                                                          q if outw is None else outw, k, d, x.stride(0), q.stride(0),
                                                          sf.stride(0), HAS_WEIGHTS=weights is not None,
                                                          BLOCK=_block(x, d, 128))
    return q, sf, outw


def gather_dequant_fp8(values: torch.Tensor, scales: torch.Tensor, assign: torch.Tensor, dtype: torch.dtype,
                       weights: torch.Tensor | None = None, keep_rows: bool = True):
    """(rows ``[M, d]`` in ``dtype`` or None without ``keep_rows``, their e4m3 values and 1x128 scales, weights
    ``[M]`` or None)."""
    _rows_ok("values", values)
    _rows_ok("scales", scales)
    if dtype not in (torch.float32, torch.bfloat16) or values.dtype != torch.float8_e4m3fn:
        raise registry.Unsupported(f"values must be e4m3 and dtype float32/bfloat16, got {values.dtype}, {dtype}")
    rows, d = assign.numel(), values.shape[1]
    x = registry.empty(rows if keep_rows else 1, d if keep_rows else 1, dtype=dtype, device=values.device)
    q = registry.empty(rows, d, dtype=torch.float8_e4m3fn, device=values.device)
    sf = registry.empty(rows, triton.cdiv(d, 128), dtype=torch.float32, device=values.device)
    outw = None if weights is None else registry.empty(rows, dtype=weights.dtype, device=values.device)
    if rows:
        registry.wrap_triton(_gather_dequant_fp8_kernel)[(rows,)](assign, values, scales,
                                                                  values if weights is None else weights, x, q, sf,
                                                                  x if outw is None else outw, d, values.stride(0),
                                                                  scales.stride(0), x.stride(0), q.stride(0),
                                                                  sf.stride(0), HAS_VALUES=keep_rows,
                                                                  HAS_WEIGHTS=weights is not None,
                                                                  BLOCK=_block(values, d, 128))
    return x if keep_rows else None, q, sf, outw


def sum_rows(y: torch.Tensor, rows: torch.Tensor, k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, d]``: per token the (weighted) sum of its ``k`` grouped rows."""
    _rows_ok("y", y)
    if y.dtype not in (torch.float32, torch.bfloat16):
        raise registry.Unsupported(f"y must be float32/bfloat16, got {y.dtype}")
    tokens, d = rows.numel() // k, y.shape[1]
    out = registry.empty(tokens, d, dtype=y.dtype, device=y.device)
    if tokens:
        registry.wrap_triton(_sum_rows_kernel)[(tokens,)](rows, y, y if weights is None else weights, out, k, d,
                                                          y.stride(0), out.stride(0), HAS_WEIGHTS=weights is not None,
                                                          BLOCK=_block(y, d))
    return out


def spread(grad: torch.Tensor, y: torch.Tensor, assign: torch.Tensor, k: int, weights: torch.Tensor):
    """The unpermute backward: (grouped gradient ``[M, d]``, the weights' gradient ``[T * k]`` fp32)."""
    _rows_ok("grad", grad)
    _rows_ok("y", y)
    rows, d = assign.numel(), y.shape[1]
    dy = registry.empty(rows, d, dtype=y.dtype, device=y.device)
    dw = registry.empty(weights.numel(), dtype=torch.float32, device=y.device)
    if rows:
        registry.wrap_triton(_spread_kernel)[(rows,)](assign, grad, y, weights, dy, dw, k, d, grad.stride(0),
                                                      y.stride(0), dy.stride(0), BLOCK=_block(y, d))
    return dy, dw
