"""Helpers shared by the fused kernels: rounding to the output's grid, and the 1x128 FP8 cast of a row chunk.

The FP8 cast is DeepGEMM's per-token one (``deep_gemm.per_token_cast_to_fp8``): scale = max(amax, 1e-4) / 448
per 128 consecutive values of a row, values rounded to nearest-even on the e4m3 grid. It is applied to the
output *after* rounding it to the output dtype, so the FP8 bytes equal a cast of the stored output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from accel.rounding import round_to_bf16, round_to_e4m3_grid

FP8_TILE = 128


@triton.jit
def on_grid(y, dtype: tl.constexpr):
    """fp32 ``y`` rounded to ``dtype``'s values (ties to even), kept in fp32: the cast that follows is exact
    (the interpreter truncates fp32 -> bf16; this rounds as torch and the GPU do)."""
    if dtype == tl.bfloat16:
        y = round_to_bf16(y)
    return y


@triton.jit
def quant_1x128(y, BLOCK: tl.constexpr):
    """``y [BLOCK]`` (a row chunk starting on a 128-column boundary, zeros past the row's end) ->
    (values on the e4m3 grid ``[BLOCK]`` in fp32, scales ``[BLOCK // 128]``)."""
    tiles = tl.reshape(y, (BLOCK // 128, 128))
    sf = tl.maximum(tl.max(tl.abs(tiles), axis=1), 1e-4) / 448.0
    q = round_to_e4m3_grid(tiles * (1.0 / sf)[:, None])
    return tl.reshape(q, (BLOCK,)), sf


@triton.jit
def store_fp8(Q, S, y, start, D, BLOCK: tl.constexpr):
    """Cast the row chunk ``y`` of columns ``start + [0, BLOCK)`` (``start`` a multiple of 128; ``Q``, ``S``
    point at the row) and store its e4m3 values and 1x128 scales."""
    q, sf = quant_1x128(y, BLOCK)
    cols = start + tl.arange(0, BLOCK)
    tl.store(Q + cols, q.to(Q.dtype.element_ty), mask=cols < D)
    tiles = start // 128 + tl.arange(0, BLOCK // 128)
    tl.store(S + tiles, sf, mask=tiles * 128 < D)
