"""deep_gemm's Triton GEMMs: one short kernel per layout family around one shared main loop.

    _dense_kernel       D [M, N] (+)= A [M, K] @ B [N, K]^T through strides (nt, nn, tn, tt are views);
                        SPLIT_K > 1 slices K over grid axis 1 and adds fp32 partial sums atomically
    _contiguous_kernel  MoE rows grouped by expert: each M tile multiplies by B[m_indices of its rows]
    _masked_kernel      grid axis 1 is the group g: rows >= masked_m[g] of A[g] are skipped
    _k_grouped_kernel   grid axis 1 is the group g, which reduces over its own K range (weight gradients)

FP8 numerics are DeepGEMM's: each 128-wide K block is multiplied exactly in fp32 by ``tl.dot``, then
scaled by ``sfa[m, kb] * sfb[n or n // 128, kb]`` and added into the fp32 accumulator (per-K-block
promotion). bf16 accumulates in fp32. Programs are ordered in groups of GROUP_M tile rows so neighbours
share B tiles in L2. Each kernel's wrapper (check, allocate, grid, launch) is the Triton implementation
that ``accel.registry`` calls for the public op.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
import triton
import triton.language as tl

import accel
from accel import autotune, registry
from accel.registry import wrap_triton
from deep_gemm.kernels.rounding import round_to_bf16
from deep_gemm.utils import get_num_sms

AUTOTUNE_ENV = "DSV3_DEEP_GEMM_AUTOTUNE"  # "0": skip autotuning (first config), e.g. for GPU correctness tests


# Autotune tiles per architecture, (BLOCK_M, BLOCK_N, num_warps, num_stages), from the compile table
# (benchmarks/kernels_compiled.md): each warp group (4 warps) holds a 64-row slice, so the fp32 accumulator and
# one K block's partial product fit in registers; 128 x 256 and 256 x 128 spill on both architectures. On
# Blackwell each K block's product comes back from tensor memory (tcgen05 is asynchronous, LDTM reads it), so
# the list trades Hopper's 3-stage 128 x 128 for a 5-stage one (160 KB of the 227 KB): a deeper copy pipeline
# to cover that latency. Which tile wins is the autotuner's call on the GPU (no Blackwell timing here yet).
# ``tile_fits`` then drops, per launch, the tiles a kind of operand cannot use (the autotuner's prune hook).
TILES = {
    90: [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3)],
    100: [(128, 128, 8, 4), (128, 128, 8, 5), (64, 128, 4, 4), (64, 256, 8, 3)],
}


def tile_fits(block_m: int, block_n: int, capability: tuple[int, int] | int | None, mx: bool = False,
              row_scaled_b: bool = False) -> bool:
    """Whether a tile suits an operand kind on a capability (compile evidence, benchmarks/kernels_compiled.md).

    MXFP8 (``mx``) takes 128-row tiles only: on sm_100 the block-scaled tcgen05 MMA needs 128 rows (Triton lowers a
    64-row ``dot_scaled`` to an upcast and a plain MMA), and below sm_100 Triton always upcasts both tiles to bf16
    times their scales, which spills 64-row tiles. Blockwise FP8 with per-row B scales (weight gradients) multiplies
    each K block by a full scale tile, which at 128 x 128 spills on sm_100 beside the product read back from
    tensor memory (648 B of stack, Triton 3.9; Hopper fits it in 243-254 registers)."""
    cap = autotune.capability_number(capability) or 0
    if mx:
        return block_m == 128
    return not (row_scaled_b and cap >= 100 and (block_m, block_n) == (128, 128))


def tiles_for(capability: tuple[int, int] | int | None, mx: bool = False,
              row_scaled_b: bool = False) -> list[tuple[int, int, int, int]]:
    """The autotune tiles for a CUDA capability (``(10, 0)`` or ``100``) and operand kind: Blackwell's list from
    sm_100 up, else Hopper's (also for MUSA and pre-Hopper GPUs, whose Triton picks its own instructions)."""
    picked = autotune.for_capability(TILES, capability)
    return [t for t in picked if tile_fits(t[0], t[1], capability, mx, row_scaled_b)] or picked


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Autotuner hook: drop the tiles ``tile_fits`` rules out for this launch's operands on this device."""
    capability = accel.device_capability() if accel.backend() == "cuda" else None
    mx, row_scaled_b = bool(kwargs.get("MX")), bool(kwargs.get("FP8")) and kwargs.get("SFB_GRAN_N") == 1
    return [c for c in configs if tile_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], capability, mx,
                                            row_scaled_b)] or configs


def _configs() -> list[triton.Config]:
    """Autotune candidates for this device (BLOCK_K is fixed by the dtype). MUSA's Triton wants one stage."""
    if accel.triton_interpreted():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    capability = accel.device_capability() if accel.backend() == "cuda" else None
    shapes = autotune.for_capability(TILES, capability)
    if os.environ.get(AUTOTUNE_ENV, "1") == "0":  # correctness runs: one config, no tuning time
        shapes = shapes[:1]
    stages = (lambda s: 1) if accel.backend() == "musa" else (lambda s: s)
    return autotune.shard([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w,
                                         num_stages=stages(s)) for bm, bn, w, s in shapes])


def _autotune(*key: str):
    # M_BUCKET: the next power of two of M, so varying token counts share tunings. Tuning reruns the kernel:
    # accumulation and rows it must not touch need D restored.
    return triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "FP8", "MX", "SFB_GRAN_N", *key],
                           restore_value=["d_ptr"], prune_configs_by={"early_config_prune": _prune})


def block_k(fp8: bool) -> int:
    """K per main-loop step: FP8's scale block; 64 for bf16 on a GPU (128 would not fit 4 stages)."""
    return 128 if fp8 or accel.triton_interpreted() else 64


# ---------------------------------------------------------------- shared device code


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """First row and column of this program's output tile (grid axis 0), GROUP_M tile rows sweeping the columns."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return (first_m + (pid % per_group) % rows_here) * BLOCK_M, (pid % per_group) // rows_here * BLOCK_N


@triton.jit
def _ue8m0_bytes(packed):
    """``[R]`` int32, four UE8M0 exponents each (byte j: K sub-block j of 32) -> ``[R, 4]`` uint8 for ``dot_scaled``."""
    return ((packed[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF).to(tl.uint8)


@triton.jit
def _mainloop(a_ptr, b_ptr, sfa_ptr, sfb_ptr, m0, n0, M, N, k_len, s_am, s_ak, s_bn, s_bk, s_sam, s_sak, s_sbn, s_sbk,
              FP8: tl.constexpr, MX: tl.constexpr, SFB_GRAN_N: tl.constexpr, INTERPRETED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``A @ B^T`` of the output tile at (m0, n0) over ``k_len`` of K: per K block load, dot, scale, advance.

    ``a_ptr`` / ``b_ptr``: the tile's first row / column at its first K (a 64-bit offset: a view's row stride
    may be huge); ``sfa_ptr`` / ``sfb_ptr``: the scales' first K block. K offsets are 32-bit, advanced per step.
    MX (MXFP8): the scales are DeepGEMM's packed UE8M0 int32s, one per row per 128-wide K block holding its four
    1x32 exponents; ``tl.dot_scaled`` applies them inside the MMA (tcgen05's block-scaled MMA on Blackwell).
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if FP8:  # past the edge read row M-1 / column N-1 (never stored): K-major loads stay unmasked, vectorised
        rows = tl.minimum(offs_m, M - 1) - m0
        cols = tl.minimum(offs_n, N - 1) - n0
    else:  # bf16 operands may be MN-major, whose contiguity a clamp would hide: masked loads instead
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * s_bn + offs_k[:, None] * s_bk
    sfa_ptrs = sfa_ptr + (m0 + rows) * s_sam
    if SFB_GRAN_N >= BLOCK_N:  # the tile lies in one 128-wide weight block: one scalar scale per K block
        sfb_ptrs = sfb_ptr + (n0 // SFB_GRAN_N) * s_sbn
    else:
        sfb_ptrs = sfb_ptr + ((n0 + cols) // SFB_GRAN_N) * s_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(k_len, BLOCK_K)):  # counted from 0: a canonical loop the software pipeliner accepts
        if FP8:  # K is a multiple of 128 = BLOCK_K: no K mask
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sa = tl.load(sfa_ptrs)
            sb = tl.load(sfb_ptrs)
            if MX:  # power-of-two 1x32 scales on both sides, per row: applied by the MMA itself
                acc = tl.dot_scaled(a, _ue8m0_bytes(sa), "e4m3", b, _ue8m0_bytes(sb), "e4m3", acc)
            else:
                if SFB_GRAN_N >= BLOCK_N:
                    scale = sa[:, None] * sb
                else:
                    scale = sa[:, None] * sb[None, :]
                acc = tl.fma(tl.dot(a, b), scale, acc)  # per-K-block promotion, one FFMA per element
            sfa_ptrs += s_sak
            sfb_ptrs += s_sbk
        else:
            k_ok = i * BLOCK_K + offs_k < k_len
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if INTERPRETED:  # the CPU interpreter multiplies bf16 bit patterns: go through fp32
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    return acc


@triton.jit
def _store(d_ptr, acc, m0, n0, row_ok, N, ACCUMULATE: tl.constexpr, ATOMIC: tl.constexpr, INTERPRETED: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the tile at (m0, n0) to row-major D with N columns, rows where ``row_ok``. ACCUMULATE adds the C
    that D holds; ATOMIC adds fp32 partial sums into D (split-K)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    d_ptrs = d_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    ok = row_ok[:, None] & (offs_n < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(d_ptrs, mask=ok, other=0.0).to(tl.float32)
    if ATOMIC:
        tl.atomic_add(d_ptrs, acc, mask=ok)
    else:
        if INTERPRETED and d_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter truncates fp32 -> bf16
            acc = round_to_bf16(acc)
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- one kernel per layout family


@_autotune("ACCUMULATE", "SPLIT_K")
@triton.jit
def _dense_kernel(a_ptr, b_ptr, d_ptr, M, N, K, M_BUCKET, s_am, s_ak, s_bn, s_bk, sfa_ptr, s_sam, s_sak,
                  sfb_ptr, s_sbn, s_sbk, FP8: tl.constexpr, MX: tl.constexpr, SFB_GRAN_N: tl.constexpr,
                  ACCUMULATE: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    m0, n0 = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k0 = 0
    k_len = K
    if SPLIT_K > 1:  # grid axis 1 is a slice of K; D is a fp32 workspace the slices add into
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k0 = tl.program_id(1) * k_per
        k_len = tl.minimum(K, k0 + k_per) - k0
    k64 = k0.to(tl.int64)
    acc = _mainloop(a_ptr + (m0.to(tl.int64) * s_am + k64 * s_ak), b_ptr + (n0.to(tl.int64) * s_bn + k64 * s_bk),
                    sfa_ptr + k0 // BLOCK_K * s_sak, sfb_ptr + k0 // BLOCK_K * s_sbk, m0, n0, M, N, k_len,
                    s_am, s_ak, s_bn, s_bk, s_sam, s_sak, s_sbn, s_sbk, FP8, MX, SFB_GRAN_N, INTERPRETED,
                    BLOCK_M, BLOCK_N, BLOCK_K)
    _store(d_ptr, acc, m0, n0, m0 + tl.arange(0, BLOCK_M) < M, N, ACCUMULATE, SPLIT_K > 1, INTERPRETED,
           BLOCK_M, BLOCK_N)


@_autotune()
@triton.jit
def _contiguous_kernel(a_ptr, b_ptr, d_ptr, m_indices_ptr, M, N, K, M_BUCKET, s_bg, s_bn, s_bk, sfa_ptr, s_sam, s_sak,
                       sfb_ptr, s_sbg, s_sbn, s_sbk, FP8: tl.constexpr, MX: tl.constexpr,
                       SFB_GRAN_N: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    m0, n0 = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ids = tl.load(m_indices_ptr + offs_m, mask=offs_m < M, other=-1)
    g = tl.max(ids, axis=0)  # BLOCK_M <= 128 rows lie in one group's 128-row block (or padding, -1)
    k_len = tl.where(g >= 0, K, 0)  # an all-padding tile does no work
    g = tl.maximum(g, 0).to(tl.int64)
    acc = _mainloop(a_ptr + m0.to(tl.int64) * K, b_ptr + (g * s_bg + n0.to(tl.int64) * s_bn), sfa_ptr,
                    sfb_ptr + g * s_sbg, m0, n0, M, N, k_len, K, 1, s_bn, s_bk, s_sam, s_sak, s_sbn, s_sbk,
                    FP8, MX, SFB_GRAN_N, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K)
    _store(d_ptr, acc, m0, n0, ids == g, N, False, False, INTERPRETED, BLOCK_M, BLOCK_N)


@_autotune()
@triton.jit
def _masked_kernel(a_ptr, b_ptr, d_ptr, masked_m_ptr, M, N, K, M_BUCKET, sfa_ptr, s_sag, s_sam, s_sak,
                   sfb_ptr, s_sbg, s_sbn, s_sbk, FP8: tl.constexpr, MX: tl.constexpr, SFB_GRAN_N: tl.constexpr,
                   INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    m0, n0 = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    g = tl.program_id(1)
    rows = tl.load(masked_m_ptr + g)
    acc = _mainloop(a_ptr + (g * M + m0).to(tl.int64) * K, b_ptr + (g * N + n0).to(tl.int64) * K,
                    sfa_ptr + g * s_sag, sfb_ptr + g * s_sbg, m0, n0, M, N, tl.where(m0 < rows, K, 0),
                    K, 1, K, 1, s_sam, s_sak, s_sbn, s_sbk, FP8, MX, SFB_GRAN_N, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    _store(d_ptr + (g * M).to(tl.int64) * N, acc, m0, n0, (offs_m < M) & (offs_m < rows), N, False, False,
           INTERPRETED, BLOCK_M, BLOCK_N)


@_autotune("ACCUMULATE", "PACKED")
@triton.jit
def _k_grouped_kernel(a_ptr, b_ptr, d_ptr, k_offsets_ptr, M, N, K, M_BUCKET, s_am, s_ak, s_bn, s_bk,
                      sfa_ptr, s_sam, s_sak, sfb_ptr, s_sbn, s_sbk, FP8: tl.constexpr, MX: tl.constexpr,
                      SFB_GRAN_N: tl.constexpr, ACCUMULATE: tl.constexpr, PACKED: tl.constexpr,
                      INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    m0, n0 = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    g = tl.program_id(1)
    k0 = tl.load(k_offsets_ptr + g)
    k_len = tl.load(k_offsets_ptr + g + 1) - k0
    if FP8:  # FP8 groups start on 128-row boundaries: say so, or the loads cannot be vectorised
        k0 = tl.multiple_of(k0, 128)
    k64 = k0.to(tl.int64)
    if PACKED:  # DeepGEMM's SM90 layout: group g's A is a row-major [M, k_len] block at k0 * M, B likewise
        s_am = tl.multiple_of(k_len, 128)
        s_bn = s_am
        a_ptr += k64 * M + m0.to(tl.int64) * s_am
        b_ptr += k64 * N + n0.to(tl.int64) * s_bn
    else:
        a_ptr += m0.to(tl.int64) * s_am + k64 * s_ak
        b_ptr += n0.to(tl.int64) * s_bn + k64 * s_bk
    kb0 = k0 // BLOCK_K
    acc = _mainloop(a_ptr, b_ptr, sfa_ptr + kb0 * s_sak, sfb_ptr + kb0 * s_sbk, m0, n0, M, N, k_len,
                    s_am, s_ak, s_bn, s_bk, s_sam, s_sak, s_sbn, s_sbk, FP8, MX, SFB_GRAN_N, INTERPRETED,
                    BLOCK_M, BLOCK_N, BLOCK_K)
    _store(d_ptr + (g * M).to(tl.int64) * N, acc, m0, n0, m0 + tl.arange(0, BLOCK_M) < M, N, ACCUMULATE, False,
           INTERPRETED, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------- wrappers: check, allocate, grid, launch


def require_fp8_hardware(fp8: bool = True) -> None:
    """FP8 kernels need e4m3 hardware (CUDA sm89+, MUSA 3.1+); elsewhere the registry uses the reference."""
    if fp8 and not accel.triton_interpreted() and not accel.fp8_native():
        raise registry.Unsupported(f"{accel.device_name()} has no FP8 (e4m3) tensor cores")


def _operands(a, b, transpose_a: bool = False, transpose_b: bool = False):
    """``(A, B, sfa, sfb, constexprs)``: logical ``[.., M, K]`` / ``[.., N, K]`` views of FP8 ``(tensor, scales)``
    pairs (scales along their K blocks) or of bf16 tensors (scales None)."""
    fp8 = isinstance(a, (tuple, list))
    require_fp8_hardware(fp8)
    (a, sfa), (b, sfb) = (a, b) if fp8 else ((a, None), (b, None))
    if transpose_a:
        a, sfa = a.mT, sfa.mT if fp8 else None
    if transpose_b:
        b, sfb = b.mT, sfb.mT if fp8 else None
    if fp8 and not accel.triton_interpreted():
        # Hopper's FP8 tensor cores (wgmma) take K-major operands only; an MN-major tile would be transposed in
        # registers and the loads would not pipeline. One fp8 copy (memory-bound, ~1% of the GEMM) makes nn,
        # tn and k-grouped layouts run as fast as nt.
        a = a if a.stride(-1) == 1 else a.contiguous()
        b = b if b.stride(-1) == 1 else b.contiguous()
    gran = 1 if fp8 and sfb.shape[-2] == b.shape[-2] else 128  # B scaled per row (1x128) or per 128x128 block
    mx = fp8 and sfa.dtype == torch.int32  # packed UE8M0 1x32 scales (MXFP8), as the public ops hand them over
    return a, b, sfa, sfb, dict(FP8=fp8, MX=mx, SFB_GRAN_N=gran, INTERPRETED=accel.triton_interpreted(),
                                BLOCK_K=block_k(fp8))


def _scales(sf: torch.Tensor | None, dims: int, d: torch.Tensor) -> tuple:
    """A scale tensor's kernel arguments: pointer and its last ``dims`` strides (bf16: ``d``, never read, and 0s)."""
    return (sf, *sf.stride()[-dims:]) if sf is not None else (d,) + (0,) * dims


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 8192)


def _grid(m: int, n: int, axis1: int):
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), axis1)


def split_k_for(m: int, n: int, k: int) -> int:
    """K slices for a dense problem with too few 128x128 output tiles to fill the GPU (small M, e.g. decode).

    Uses ``get_num_sms()`` (so ``set_num_sms`` also bounds it); 1 (no split) in the interpreter.
    """

    if accel.triton_interpreted():
        return 1
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    sms = get_num_sms()
    if 2 * tiles > sms:
        return 1
    return max(1, min(sms // tiles, k // 512, 16))  # keep >= 4 K blocks of 128 per slice


def gemm(layout: str, a, b, d: torch.Tensor, c: torch.Tensor | None = None, split_k: int | None = None):
    """``{fp8,bf16}_gemm_{layout}``: ``d = (c +) a @ b^T`` with A stored [m, k] (layout "n.") or [k, m] ("t."),
    B stored [n, k] (".t") or [k, n] (".n"). ``split_k``: K slices (None: ``split_k_for``'s choice)."""
    a, b, sfa, sfb, static = _operands(a, b, layout[0] == "t", layout[1] == "n")
    if c is not None and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    (m, k), n = a.shape, b.shape[0]
    split = split_k_for(m, n, k) if split_k is None else split_k
    out = d
    if split > 1:  # a fp32 workspace that holds c (or 0); the K slices add their partial sums into it
        out = d.float() if c is not None else torch.zeros(m, n, dtype=torch.float32, device=d.device)
    if d.numel():
        wrap_triton(_dense_kernel)[_grid(m, n, split)](
            a, b, out, m, n, k, _bucket(m), *a.stride(), *b.stride(), *_scales(sfa, 2, d), *_scales(sfb, 2, d),
            ACCUMULATE=c is not None and split == 1, SPLIT_K=split, **static)
    if out is not d:
        d.copy_(out)
    return d


gemm_nt, gemm_nn, gemm_tn, gemm_tt = (functools.partial(gemm, layout) for layout in ("nt", "nn", "tn", "tt"))


def m_grouped_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, nn: bool = False):
    """``m_grouped_{fp8,bf16}_gemm_{nt,nn}_contiguous``: ``d[r] = a[r] @ b[m_indices[r]]^T`` (``b[g]`` stored
    [k, n] when ``nn``); rows with ``m_indices[r] = -1`` are left untouched."""
    a, b, sfa, sfb, static = _operands(a, b, transpose_b=nn)
    (m, k), n = a.shape, b.shape[1]
    if d.numel():
        wrap_triton(_contiguous_kernel)[_grid(m, n, 1)](
            a, b, d, m_indices, m, n, k, _bucket(m), *b.stride(), *_scales(sfa, 2, d), *_scales(sfb, 3, d), **static)
    return d


m_grouped_contiguous_nn = functools.partial(m_grouped_contiguous, nn=True)


def m_grouped_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int | None = None):
    """``m_grouped_{fp8,bf16}_gemm_nt_masked``: ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T``."""
    a, b, sfa, sfb, static = _operands(a, b)
    groups, m, k = a.shape
    n = b.shape[1]
    if d.numel():
        wrap_triton(_masked_kernel)[_grid(m, n, groups)](a, b, d, masked_m, m, n, k, _bucket(m), *_scales(sfa, 3, d),
                                            *_scales(sfb, 3, d), **static)
    return d


def k_grouped(a, b, d: torch.Tensor, ks, ks_tensor=None, c: torch.Tensor | None = None, packed: bool = False):
    """``k_grouped_{fp8,bf16}_gemm_tn_contiguous``: ``d[g] = (c[g] +) a_g^T @ b_g`` over group g's ``ks[g]`` rows
    of ``a [sum_k, m]``, ``b [sum_k, n]``; ``packed``: DeepGEMM's SM90 ``k_grouped_fp8_gemm_nt_contiguous``, each
    group's A ``[m, ks[g]]`` K-major and packed one after another (B likewise)."""
    groups, m, n = d.shape
    sum_k = sum(ks)
    if packed:  # logical [m, sum_k] views: only the K stride (1) and the scales are read through them
        a, b, sfa, sfb, static = _operands((a[0].view(m, sum_k), a[1]), (b[0].view(n, sum_k), b[1]))
    else:
        a, b, sfa, sfb, static = _operands(a, b, transpose_a=True, transpose_b=True)
    if c is not None and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    if d.numel():
        offsets = torch.tensor(list(itertools.accumulate(ks, initial=0)), dtype=torch.int32, device=d.device)
        wrap_triton(_k_grouped_kernel)[_grid(m, n, groups)](
            a, b, d, offsets, m, n, sum_k, _bucket(m), *a.stride(), *b.stride(), *_scales(sfa, 2, d),
            *_scales(sfb, 2, d), ACCUMULATE=c is not None, PACKED=packed, **static)
    return d


k_grouped_packed = functools.partial(k_grouped, packed=True)
