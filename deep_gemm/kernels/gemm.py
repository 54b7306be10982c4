"""One Triton GEMM kernel for every deep_gemm layout: D = A @ B^T (+ D), FP8 with block scales or bf16.

Modes (a constexpr, so each compiles to its own specialised kernel):
  DENSE      one problem; A [M, K], B [N, K] through arbitrary strides (nt, nn and tn are views).
  CONTIGUOUS MoE rows grouped by expert: each M tile reads its group from ``m_indices`` and
             multiplies by that group's B; rows whose index differs (-1 padding) are not stored,
             tiles with no row of a group skip all work.
  MASKED     grid axis 1 is the group; rows >= ``masked_m[g]`` of group g are skipped.
  (DENSE with SPLIT_K > 1: grid axis 1 slices K and programs add fp32 partials atomically into a
  zeroed workspace: small-M problems would otherwise leave most SMs idle.)
  K_GROUPED  grid axis 1 is the group; group g reduces over its own K range (weight gradients);
             with FLAT_K_MAJOR, group g's operands are K-major [M, K_g] blocks packed one after another
             (DeepGEMM's SM90 ``k_grouped_fp8_gemm_nt_contiguous`` layout).

FP8 numerics are DeepGEMM's: each 128-wide K block is accumulated exactly in fp32 by ``tl.dot``,
then multiplied by ``sfa[m, kb] * sfb[n or n // 128, kb]`` and added into the main fp32
accumulator (per-K-block scale promotion). Programs are ordered in groups of GROUP_M tile rows so
neighbouring programs share B tiles in L2.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

import accel
from accel import autotune, registry
from deep_gemm.kernels.rounding import round_to_bf16

DENSE, CONTIGUOUS, MASKED, K_GROUPED = 0, 1, 2, 3
AUTOTUNE_ENV = "DSV3_DEEP_GEMM_AUTOTUNE"  # "0": skip autotuning (first config), e.g. for GPU correctness tests


def _configs(fp8: bool) -> list[triton.Config]:
    """Autotune candidates per backend. MUSA's Triton wants single-stage pipelines."""
    if accel.triton_interpreted():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 4}, num_warps=4,
                              num_stages=1)]
    bk = 128 if fp8 else 64
    # (BLOCK_M, BLOCK_N, num_warps, num_stages), Hopper-sized tiles first: each warp group (4 warps) holds a
    # 64-row slice, so the fp32 accumulator and one K block's partial product fit in registers. 128 x 256 is
    # left out: it spills (benchmarks/kernels_compiled.md).
    shapes = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3)]
    if os.environ.get(AUTOTUNE_ENV, "1") == "0":  # correctness runs: one config, no tuning time
        shapes = shapes[:1]
    musa = accel.backend() == "musa"
    return autotune.shard([
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w,
                      num_stages=1 if musa else s)
        for bm, bn, w, s in shapes
    ])


def _kernel_body():
    """Returns the jitted kernel; built per dtype family so each has its own autotune configs."""

    @triton.jit
    def kernel(
        a_ptr, b_ptr, d_ptr, sfa_ptr, sfb_ptr, grp_ptr,
        M, N, K, M_BUCKET,
        s_ag, s_am, s_ak, s_bg, s_bn, s_bk, s_dg, s_dm, s_dn,
        s_sag, s_sam, s_sak, s_sbg, s_sbn, s_sbk,
        MODE: tl.constexpr, FP8: tl.constexpr, SFB_GRAN_N: tl.constexpr, ACCUMULATE: tl.constexpr,
        FLAT_K_MAJOR: tl.constexpr, SPLIT_K: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        # Grouped ordering: GROUP_M consecutive tile rows sweep the tile columns together.
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows_here
        pid_n = (pid % per_group) // rows_here

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_lo = 0
        k_hi = K
        if MODE == 0 and SPLIT_K > 1:  # split-K: grid axis 1 is a slice of K; partial sums are added atomically
            k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
            k_lo = g * k_per
            k_hi = tl.minimum(K, k_lo + k_per)
            g = g * 0
        elif MODE == 1:  # CONTIGUOUS: the tile's group is the largest index among its rows
            gids = tl.load(grp_ptr + offs_m, mask=m_ok, other=-1)
            g = tl.max(gids, axis=0)
            m_ok = m_ok & (gids == g) & (gids >= 0)
            k_hi = tl.where(g >= 0, K, 0)  # an all-padding tile does no work
            g = tl.maximum(g, 0)
        elif MODE == 2:  # MASKED
            m_ok = m_ok & (offs_m < tl.load(grp_ptr + g))
            k_hi = tl.where(pid_m * BLOCK_M < tl.load(grp_ptr + g), K, 0)
        elif MODE == 3:  # K_GROUPED: grp_ptr holds the G + 1 prefix sums of the groups' K
            k_lo = tl.load(grp_ptr + g)
            k_hi = tl.load(grp_ptr + g + 1)
            if FP8:  # FP8 groups start on 128-row boundaries: say so, or the loads cannot be vectorised
                k_lo = tl.multiple_of(k_lo, 128)

        # Addresses: a 64-bit tile base plus row offsets (once, before the loop: a view's row stride may be
        # huge), 32-bit K offsets, pointers advanced by BLOCK_K per step. Rows / columns past M / N read row
        # M-1 / column N-1 (FP8) instead of masking the loads: their results are never stored.
        g64 = g.to(tl.int64)
        if FP8:  # K-major operands: clamping rows keeps the K-contiguous loads vectorised
            rows = tl.minimum(offs_m, M - 1) - pid_m * BLOCK_M
            cols = tl.minimum(offs_n, N - 1) - pid_n * BLOCK_N
        else:  # bf16 operands may be MN-major, whose contiguity a clamp would hide: masked loads instead
            rows = tl.arange(0, BLOCK_M)
            cols = tl.arange(0, BLOCK_N)
        m0 = (pid_m * BLOCK_M).to(tl.int64)
        n0 = (pid_n * BLOCK_N).to(tl.int64)
        if FLAT_K_MAJOR:  # K_GROUPED, DeepGEMM's SM90 layout: group g's A is a K-major [M, K_g] block at k_lo * M
            k_len = tl.multiple_of(k_hi - k_lo, 128)
            a_ptrs = (a_ptr + k_lo.to(tl.int64) * M + m0 * k_len + rows[:, None].to(tl.int64) * k_len
                      + offs_k[None, :] * s_ak)
            b_ptrs = (b_ptr + k_lo.to(tl.int64) * N + n0 * k_len + cols[None, :].to(tl.int64) * k_len
                      + offs_k[:, None] * s_bk)
        else:
            a_ptrs = (a_ptr + (g64 * s_ag + m0 * s_am + k_lo.to(tl.int64) * s_ak) + rows[:, None].to(tl.int64) * s_am
                      + offs_k[None, :] * s_ak)
            b_ptrs = (b_ptr + (g64 * s_bg + n0 * s_bn + k_lo.to(tl.int64) * s_bk) + cols[None, :].to(tl.int64) * s_bn
                      + offs_k[:, None] * s_bk)
        kb0 = k_lo // BLOCK_K
        sfa_ptrs = sfa_ptr + g64 * s_sag + (pid_m * BLOCK_M + rows) * s_sam + kb0 * s_sak
        if SFB_GRAN_N >= BLOCK_N:  # the tile lies in one 128-wide weight block: one scalar scale per K block
            sfb_ptrs = sfb_ptr + g64 * s_sbg + (pid_n * BLOCK_N // SFB_GRAN_N) * s_sbn + kb0 * s_sbk
        else:
            sfb_ptrs = sfb_ptr + g64 * s_sbg + ((pid_n * BLOCK_N + cols) // SFB_GRAN_N) * s_sbn + kb0 * s_sbk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Count iterations from 0 (a canonical loop the software pipeliner accepts for any k_lo).
        for it in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
            if FP8:  # K is a multiple of 128 = BLOCK_K: no K mask
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                sa = tl.load(sfa_ptrs)
                sb = tl.load(sfb_ptrs)
                if SFB_GRAN_N >= BLOCK_N:
                    scale = sa[:, None] * sb
                else:
                    scale = sa[:, None] * sb[None, :]
                acc = tl.fma(tl.dot(a, b), scale, acc)  # per-K-block promotion, one FFMA per element
                sfa_ptrs += s_sak
                sfb_ptrs += s_sbk
            else:
                k_ok = it * BLOCK_K + offs_k < k_hi - k_lo
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                if INTERPRETED:  # the CPU interpreter multiplies bf16 bit patterns: go through fp32
                    acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
                else:
                    acc += tl.dot(a, b)
            a_ptrs += BLOCK_K * s_ak
            b_ptrs += BLOCK_K * s_bk

        d_ptrs = d_ptr + g64 * s_dg + offs_m[:, None].to(tl.int64) * s_dm + offs_n[None, :] * s_dn
        store_ok = m_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:  # D already holds C (copied by the launcher when C is a separate tensor)
            acc += tl.load(d_ptrs, mask=store_ok, other=0.0).to(tl.float32)
        if SPLIT_K > 1:  # D is a zeroed fp32 workspace
            tl.atomic_add(d_ptrs, acc, mask=store_ok)
        else:
            if INTERPRETED and d_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter truncates fp32 -> bf16
                acc = round_to_bf16(acc)
            tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=store_ok)

    return kernel


def _autotuned(fp8: bool):
    return triton.autotune(
        configs=_configs(fp8),
        key=["M_BUCKET", "N", "K", "MODE", "SFB_GRAN_N", "ACCUMULATE", "FLAT_K_MAJOR", "SPLIT_K"],
        restore_value=["d_ptr"],  # tuning reruns the kernel; accumulation and untouched rows need D restored
    )(_kernel_body())


_fp8_kernel = _autotuned(True)
_bf16_kernel = _autotuned(False)


def _bucket(m: int) -> int:
    """Autotune key for M: the next power of two (capped), so varying token counts share tunings."""
    return min(triton.next_power_of_2(max(m, 1)), 8192)


def split_k_for(m: int, n: int, k: int) -> int:
    """K slices for a dense problem with too few 128x128 output tiles to fill the GPU (small M, e.g. decode).

    Uses ``get_num_sms()`` (so ``set_num_sms`` also bounds it); 1 (no split) in the interpreter.
    """
    from deep_gemm.utils import get_num_sms

    if accel.triton_interpreted():
        return 1
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    sms = get_num_sms()
    if 2 * tiles > sms:
        return 1
    return max(1, min(sms // tiles, k // 512, 16))  # keep >= 4 K blocks of 128 per slice


def require_fp8_hardware(fp8: bool = True) -> None:
    """FP8 kernels need e4m3 hardware (CUDA sm89+, MUSA 3.1+); elsewhere the registry uses the reference."""
    if fp8 and not accel.triton_interpreted() and not accel.fp8_native():
        raise registry.Unsupported(f"{accel.device_name()} has no FP8 (e4m3) tensor cores")


def launch(mode: int, a, b, d, *, sfa=None, sfb=None, sfb_gran_n: int = 128, grp=None, num_groups: int = 1,
           accumulate: bool = False, flat_k_major: bool = False, split_k: int = 1) -> None:
    """Run the kernel on logical views ``a [G?, M, K]``, ``b [G?, N, K]``, ``d [G?, M, N]``.

    2-D views get group strides of 0. ``sfa`` [G?, M, K/128] and ``sfb`` [G?, N or ceil(N/128), K/128]
    are read through their strides, so transposed scale views (nn, tn, MN-major) need no copy.
    """
    fp8 = sfa is not None
    require_fp8_hardware(fp8)
    if fp8 and not accel.triton_interpreted():
        # Hopper's FP8 tensor cores (wgmma) take K-major operands only; an MN-major tile would be
        # transposed in registers and the loads would not pipeline. One fp8 copy (memory-bound,
        # ~1% of the GEMM) makes nn, tn and k-grouped layouts run as fast as nt.
        a = a if a.stride(-1) == 1 else a.contiguous()
        b = b if b.stride(-1) == 1 else b.contiguous()

    def strides3(t):
        return (0, *t.stride()) if t.dim() == 2 else tuple(t.stride())

    m, k = a.shape[-2:]
    n = b.shape[-2]
    s_a, s_b, s_d = strides3(a), strides3(b), strides3(d)
    s_sa = strides3(sfa) if fp8 else (0, 0, 0)
    s_sb = strides3(sfb) if fp8 else (0, 0, 0)
    dummy = d  # any pointer for the unused arguments
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), max(num_groups, split_k))
    kernel = _fp8_kernel if fp8 else _bf16_kernel
    kernel[grid](
        a, b, d, sfa if fp8 else dummy, sfb if fp8 else dummy, grp if grp is not None else dummy,
        m, n, k, _bucket(m),
        *s_a, *s_b, *s_d, *s_sa, *s_sb,
        MODE=mode, FP8=fp8, SFB_GRAN_N=sfb_gran_n, ACCUMULATE=accumulate, FLAT_K_MAJOR=flat_k_major, SPLIT_K=split_k,
        INTERPRETED=accel.triton_interpreted(),
    )
