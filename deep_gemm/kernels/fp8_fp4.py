"""FP8-activation x MXFP4-weight grouped GEMM (contiguous layout): ``tl.dot_scaled`` with E4M3 rows scaled per 1x32
(UE8M0) and E2M1 weights packed two per byte with an E8M0 scale per 32 along K. Rows cast by DeepSeek-V3's
blockwise recipe (fp32 scales per 1x128) enter with a unit row scale, their scale applied to each 128-wide step's
fp32 product (the promotion of the blockwise FP8 GEMMs).

On sm_100a Triton lowers ``dot_scaled`` to tcgen05's block-scaled MMA (the scales applied inside the MMA; the
compile table's ``block_scaled_mma``); below sm_100 (sm_90a) it dequantises both tiles to bf16 times their scales
and runs a plain MMA: the same kernel is the Hopper path. 128-row tiles only (a 64-row ``dot_scaled`` is upcast
on sm_100 too, as for MXFP8: ``deep_gemm.kernels.gemm.tile_fits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import accel
from accel import autotune, registry
from deep_gemm.kernels.rounding import round_to_bf16
from deep_gemm.utils import dot_scaled_interpreter_gap

BLOCK_K = 128  # four 32-blocks of scales per step
# (BLOCK_N, warps, stages) per capability, 128-row tiles: compile evidence (recipes.kernels_compiled): on sm_90a
# the upcast 128 x 256 tile spills 432 B, on sm_100a it fits beside the accumulator in tensor memory
TILES = {90: [(128, 8, 3)], 100: [(128, 8, 3), (256, 8, 3)]}
# fp32 row scales (A_FP32): the per-step promotion reads the accumulator out of tensor memory, and the 128 x 256
# tile then spills 392 B on sm_100a too
TILES_ROWS_FP32 = {90: [(128, 8, 3)], 100: [(128, 8, 3)]}
# Triton before 3.9 cannot compile that sm_100a kernel (3.6's pass manager fails on the constant unit-scale tensor
# beside the per-step accumulator read-out): there the MMA takes no lhs scale (``A_UNSCALED``), which Triton lowers
# as a tcgen05 MMA on upcast operands, not the block-scaled one; its 128-wide tile spills, the 64-wide one does not
TILES_ROWS_FP32_UNSCALED = [(64, 8, 3)]
UNIT_SCALE_COMPILES = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)


def tiles_for(capability: tuple[int, int] | int | None, rows_fp32: bool = False) -> list[tuple[int, int, int]]:
    """The autotune tiles for a CUDA capability: Blackwell's from sm_100 up, else Hopper's (``rows_fp32``: for rows
    with 1x128 fp32 scales)."""
    if lhs_unscaled(capability, rows_fp32):
        return TILES_ROWS_FP32_UNSCALED
    return autotune.for_capability(TILES_ROWS_FP32 if rows_fp32 else TILES, capability)


def lhs_unscaled(capability: tuple[int, int] | int | None, rows_fp32: bool) -> bool:
    """Whether the fp32-rows MMA passes no lhs scale (``None``: the same unit scale) instead of a constant E8M0 1.0
    tensor: on sm_100a with a Triton that cannot compile the tensor form (``TILES_ROWS_FP32_UNSCALED``). On sm_90a
    the tensor form is the one that does not spill."""
    cap = autotune.capability_number(capability)
    return rows_fp32 and cap is not None and cap >= 100 and not UNIT_SCALE_COMPILES


def _configs(rows_fp32: bool = False) -> list[triton.Config]:
    if accel.triton_interpreted():
        return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 32, "A_UNSCALED": False}, num_warps=4, num_stages=1)]
    capability = accel.device_capability() if accel.backend() == "cuda" else None
    stages = (lambda s: 1) if accel.backend() == "musa" else (lambda s: s)
    unscaled = lhs_unscaled(capability, rows_fp32)
    return [triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "A_UNSCALED": unscaled}, num_warps=w,
                          num_stages=stages(s)) for bn, w, s in tiles_for(capability, rows_fp32)]


@triton.jit
def fp8_fp4_contiguous_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, m_indices_ptr, M, N, K,
                              INTERPRETED: tl.constexpr, A_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_UNSCALED: tl.constexpr):
    """``d[r] = (a[r] * 2^sa[r]) @ (e2m1(b[g]) * 2^sb[g])^T`` for the rows of group g = ``m_indices[r]`` (-1: row
    left untouched). ``a`` e4m3 ``[M, K]``, ``sa`` uint8 ``[M, K/32]`` (``A_FP32``: fp32 ``[M, K/128]``, DeepSeek-V3's
    1x128 activation scales, applied to each 128-wide step's fp32 product: the MMA takes a unit scale), ``b`` uint8
    ``[G, N, K/2]`` (element 2i in the low nibble), ``sb`` uint8 ``[G, N, K/32]``; K a multiple of BLOCK_K."""
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ids = tl.load(m_indices_ptr + offs_m, mask=offs_m < M, other=-1)
    g = tl.max(ids, axis=0)  # a 128-row block holds one group (or padding)
    k_len = tl.where(g >= 0, K, 0)
    g = tl.maximum(g, 0).to(tl.int64)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # past the edge read the last row/column (never stored)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + rows[:, None] * K + offs_k[None, :]
    if A_FP32:
        sa_ptrs = sa_ptr + rows * (K // BLOCK_K)  # one fp32 scale per row and 128-wide step
        unit = tl.full((BLOCK_M, BLOCK_K // 32), 127, tl.uint8)  # E8M0 1.0
    else:
        sa_ptrs = sa_ptr + rows[:, None] * (K // 32) + offs_s[None, :]
    b_ptrs = b_ptr + g * N * (K // 2) + cols[None, :] * (K // 2) + offs_kb[:, None]
    sb_ptrs = sb_ptr + g * N * (K // 32) + cols[:, None] * (K // 32) + offs_s[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(k_len, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if A_FP32:
            if A_UNSCALED:  # the same unit scale, as sm_100a's compiler takes it (lhs_unscaled)
                part = tl.dot_scaled(a, None, "e4m3", b, tl.load(sb_ptrs), "e2m1")
            else:
                part = tl.dot_scaled(a, unit, "e4m3", b, tl.load(sb_ptrs), "e2m1")
            acc += part * tl.load(sa_ptrs)[:, None]
            sa_ptrs += 1
        else:
            acc = tl.dot_scaled(a, tl.load(sa_ptrs), "e4m3", b, tl.load(sb_ptrs), "e2m1", acc)
            sa_ptrs += BLOCK_K // 32
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        sb_ptrs += BLOCK_K // 32
    d_ptrs = d_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    ok = (ids == g)[:, None] & (offs_n < N)[None, :]
    if INTERPRETED and d_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter truncates fp32 -> bf16
        acc = round_to_bf16(acc)
    tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=ok)


# one autotuner per row-scale kind (their tile lists differ), over the same kernel
_mx_rows = triton.autotune(configs=_configs(), key=["N", "K"])(fp8_fp4_contiguous_kernel)
_fp32_rows = triton.autotune(configs=_configs(rows_fp32=True), key=["N", "K"])(fp8_fp4_contiguous_kernel)


def m_grouped_fp8_fp4_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    """Launch over ``a = (e4m3 [M, K], UE8M0 [M, K/32] or fp32 [M, K/128])``, ``b = (int8 [G, N, K/2], E8M0 [G, N,
    K/32])``."""
    (x, sa), (w, sb) = a, b
    m, k = x.shape
    n = w.shape[1]
    gap = dot_scaled_interpreter_gap() if accel.triton_interpreted() else None
    if gap:
        raise registry.Unsupported(gap)
    if d.numel():
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        a_fp32 = sa.dtype == torch.float32
        launch = registry.wrap_triton(_fp32_rows if a_fp32 else _mx_rows)[grid]
        launch(x, sa if a_fp32 else sa.view(torch.uint8), w.view(torch.uint8), sb.view(torch.uint8), d, m_indices,
               m, n, k, INTERPRETED=accel.triton_interpreted(), A_FP32=a_fp32, BLOCK_K=BLOCK_K)
    return d
