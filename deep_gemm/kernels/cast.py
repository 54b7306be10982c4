"""Triton FP8 cast: one fp32 scale per TILE_R x TILE_C tile (1x128 tokens, 128x1 channels, 128x128 blocks; 1x32 and
32x1 for MXFP8).

Rounding is done onto the e4m3 grid in fp32 before the final cast, so the cast itself is exact.
Why: Triton's CPU interpreter rounds fp32 -> e4m3 wrongly when rounding carries into the exponent
(124.3 becomes 64 instead of 128), and an explicit round-to-nearest-even makes every backend agree
bit for bit with ``torch``'s cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from accel.registry import wrap_triton
from deep_gemm.kernels.gemm import require_fp8_hardware
from deep_gemm.kernels.rounding import round_to_e4m3_grid
from deep_gemm.utils import BLOCK, FP8, ceil_div


@triton.jit
def _cast_kernel(
    x_ptr, q_ptr, sf_ptr, R, C, s_xb, s_xr, s_xc, s_qb, s_qr, s_qc, s_sb, s_sr, s_sc,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, UE8M0: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    x = tl.load(x_ptr + batch * s_xb + offs_r[:, None].to(tl.int64) * s_xr + offs_c[None, :] * s_xc,
                mask=ok, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if TILE_R == 1:  # per-row tiles: BLOCK_C == TILE_C
        amax = tl.max(ax, axis=1)[:, None]
    elif TILE_C == 1:  # per-column tiles: BLOCK_R == TILE_R
        amax = tl.max(ax, axis=0)[None, :]
    else:  # one square tile per program
        amax = tl.max(tl.max(ax, axis=1), axis=0)
    sf = tl.maximum(amax, AMAX_FLOOR) / 448.0
    if UE8M0:  # round up to a power of two on the bits: exponent, plus one if any mantissa bit is set
        bits = sf.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        sf = (tl.minimum(tl.maximum(exp, 1), 254) << 23).to(tl.float32, bitcast=True)
    q = round_to_e4m3_grid(x * (1.0 / sf))
    tl.store(q_ptr + batch * s_qb + offs_r[:, None].to(tl.int64) * s_qr + offs_c[None, :] * s_qc,
             q.to(q_ptr.dtype.element_ty), mask=ok)
    sf_base = sf_ptr + batch * s_sb
    if TILE_R == 1:
        tl.store(sf_base + offs_r[:, None] * s_sr + pid_c * s_sc, sf, mask=offs_r[:, None] < R)
    elif TILE_C == 1:
        tl.store(sf_base + pid_r * s_sr + offs_c[None, :] * s_sc, sf, mask=offs_c[None, :] < C)
    else:
        tl.store(sf_base + pid_r * s_sr + pid_c * s_sc, sf)


def cast_warps(tile_rows: int, tile_cols: int) -> int:
    """Warps per program: a 128x128 tile takes 32 (with 8 or 16 it spills registers on sm_90 in Triton 3.6
    or 3.9, benchmarks/kernels_compiled.md)."""
    return 32 if tile_rows > 1 and tile_cols > 1 else 4


def cast_tiles(x: torch.Tensor, tile_rows: int, tile_cols: int, use_ue8m0: bool = False):
    """Triton twin of ``reference.cast_tiles`` for 2-D or 3-D ``x`` (tiles over the last two dims)."""
    if x.dim() not in (2, 3):
        raise registry.Unsupported(f"cast kernel takes 2-D or 3-D inputs, got {x.dim()}-D")
    require_fp8_hardware()
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    batch, rows, cols = x3.shape
    r_tiles, c_tiles = ceil_div(rows, tile_rows), ceil_div(cols, tile_cols)
    q = registry.empty(x3.shape, dtype=FP8, device=x.device)
    sf = registry.empty((batch, r_tiles, c_tiles), dtype=torch.float32, device=x.device)
    block_r = 32 if tile_rows == 1 else tile_rows
    block_c = 64 if tile_cols == 1 else tile_cols
    grid = (ceil_div(rows, block_r), ceil_div(cols, block_c), batch)
    wrap_triton(_cast_kernel)[grid](
        x3, q, sf, rows, cols, *x3.stride(), *q.stride(), *sf.stride(),
        TILE_R=tile_rows, TILE_C=tile_cols, BLOCK_R=block_r, BLOCK_C=block_c,
        AMAX_FLOOR=1e-4, UE8M0=use_ue8m0, num_warps=cast_warps(tile_rows, tile_cols),
    )
    if x.dim() == 2:
        return q[0], sf[0]
    return q, sf


def per_token_cast(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK):
    """Triton path of ``deep_gemm.per_token_cast_to_fp8``: 1 x ``gran_k`` tiles."""
    return cast_tiles(x, 1, gran_k, use_ue8m0)


def per_channel_cast(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK):
    """Triton path of ``deep_gemm.per_channel_cast_to_fp8``: ``gran_k`` x 1 tiles."""
    return cast_tiles(x, gran_k, 1, use_ue8m0)


def per_block_cast(x: torch.Tensor, use_ue8m0: bool = False):
    """Triton path of ``deep_gemm.per_block_cast_to_fp8``: 128 x 128 tiles."""
    return cast_tiles(x, BLOCK, BLOCK, use_ue8m0)
