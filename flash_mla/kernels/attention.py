"""Flash-attention forward and backward for MLA training (Q/K head dim != V head dim), varlen layout.

Tensors are ``[total_tokens, heads, d]`` with ``cu_seqlens`` bounds (the dense ``[b, s, h, d]`` form
is folded into this). The forward keeps a running max / sum per query row and stores only ``out``
and the natural-log ``lse`` ``[heads, total]``. The backward recomputes P from ``lse``: one kernel
walks query blocks for each key block (dK, dV), another walks key blocks for each query block (dQ),
so no atomics and no S x S buffer. The Q/K head dim is covered by two power-of-two tiles
(``common.split_head_dim``), so 192 costs 128 + 64 rather than 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import autotune, registry
from accel.registry import wrap_triton
from flash_mla.kernels.common import cast_out, cuda_capability, interpreted, pipeline_stages, split_head_dim

LOG2E = 1.4426950408889634


def _configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=pipeline_stages(s))
            for m, n, w, s in blocks]


# (BLOCK_M, BLOCK_N, warps, stages) per architecture (``accel.autotune.for_capability``); the interpreter gets one
# small config (autotuning would run them all). The forward and dQ walk key blocks inside a query block
# (BLOCK_M % BLOCK_N == 0, so the diagonal is whole key blocks); dK/dV walks query blocks inside a key block
# (BLOCK_N % BLOCK_M == 0). Each list holds only configs that compile for its target without register spills at the
# V3 head dims, in Triton 3.6 and 3.9 (benchmarks/kernels_compiled.md). Four of Hopper's spill 8-24 B on sm_100a in
# one version or both (forward 128 x 32 s3, dK/dV 16 x 128, dQ 128 x 32 and 64 x 64); Blackwell's lists swap them
# for tiles that fit in both and still issue tcgen05: a 3-stage 128 x 64 forward, a 32 x 128 dK/dV tile (128-row
# MMAs), 128 x 16 and 3-stage 64 x 32 dQ tiles.
FWD_CONFIGS = {90: [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2)],
               100: [(128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (64, 32, 4, 2)]}
DKDV_CONFIGS = {90: [(32, 64, 8, 2), (16, 64, 8, 2), (16, 128, 8, 2)],
                100: [(32, 64, 8, 2), (16, 64, 8, 2), (32, 128, 8, 2)]}
DQ_CONFIGS = {90: [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 16, 4, 2)],
              100: [(64, 32, 4, 2), (128, 16, 8, 2), (64, 32, 4, 3), (64, 16, 4, 2)]}
_INTERP_CONFIG = [(16, 16, 1, 1)]


def _pick(lists: dict[int, list]) -> list[triton.Config]:
    """This device's configs from a per-architecture dict (one small config under the interpreter)."""
    blocks = _INTERP_CONFIG if interpreted() else autotune.for_capability(lists, cuda_capability())
    return autotune.shard(_configs(blocks))


@triton.jit
def _load_block(base, row0, limit, stride_t, cols, D: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """Rows ``row0 .. row0 + ROWS`` (< ``limit``) of a [tokens, d] view, columns ``cols`` (< D).

    The row base is 64-bit (``row0 * stride`` passes 2^31 at ~87K tokens x 128 heads x 192); offsets
    inside the tile stay 32-bit."""
    rows = tl.arange(0, ROWS)
    ptr = base + tl.cast(row0, tl.int64) * stride_t + rows[:, None] * stride_t + cols[None, :]
    x = tl.load(ptr, mask=(row0 + rows < limit)[:, None] & (cols < D)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _sequence_of_program(CU, H):
    """(head, first token (64-bit), length) of the sequence this program's axis-1 index (batch x heads) covers."""
    bh = tl.program_id(1)
    start = tl.load(CU + bh // H)
    return bh % H, start.to(tl.int64), tl.load(CU + bh // H + 1) - start


@triton.jit
def _fwd_inner(acc, m_i, l_i, q_a, q_b, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, length,
               qk_scale_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
               DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [lo, hi); ``MASKED`` applies the causal and length masks (diagonal and
    tail blocks only)."""
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        s = tl.dot(q_a, tl.trans(_load_block(k_base, start_n, length, stride_kt, cols_a, DQK, BLOCK_N, UPCAST)))
        if DB > 0:
            cols_b = DA + tl.arange(0, DB)
            s += tl.dot(q_b, tl.trans(_load_block(k_base, start_n, length, stride_kt, cols_b, DQK, BLOCK_N, UPCAST)))
        s = s * qk_scale_log2
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = (offs_n < length)[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_block(v_base, start_n, length, stride_vt, cols_v, DV, BLOCK_N, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU, qk_scale_log2,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_lh, H,
                CAUSAL: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    m0 = pid_m * BLOCK_M
    if m0 >= length:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    q_a = _load_block(q_base, m0, length, stride_qt, tl.arange(0, DA), DQK, BLOCK_M, UPCAST)
    q_b = q_a
    if DB > 0:
        q_b = _load_block(q_base, m0, length, stride_qt, DA + tl.arange(0, DB), DQK, BLOCK_M, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # causal: key blocks left of the diagonal unmasked, the diagonal ones masked; else full blocks, then the tail
    diag = m0 if CAUSAL else length // BLOCK_N * BLOCK_N
    hi = tl.minimum(length, m0 + BLOCK_M) if CAUSAL else length
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q_a, q_b, k_base, v_base, stride_kt, stride_vt, 0, diag, offs_m,
                               length, qk_scale_log2, False, CAUSAL, DQK, DV, DA, DB, BLOCK_DV, UPCAST, BLOCK_N)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q_a, q_b, k_base, v_base, stride_kt, stride_vt, diag, hi, offs_m,
                               length, qk_scale_log2, True, CAUSAL, DQK, DV, DA, DB, BLOCK_DV, UPCAST, BLOCK_N)
    acc = acc / l_i[:, None]
    cols_v = tl.arange(0, BLOCK_DV)
    rows = tl.arange(0, BLOCK_M)
    o_ptr = O + (start + m0) * stride_ot + h * stride_oh + rows[:, None] * stride_ot + cols_v[None, :]
    tl.store(o_ptr, cast_out(acc, O.dtype.element_ty, UPCAST), mask=(offs_m < length)[:, None] & (cols_v < DV)[None, :])
    # natural log: lse = (m + log2 l) * ln 2, with m in log2 units
    tl.store(LSE + h * stride_lh + start + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=offs_m < length)


@triton.jit
def _delta_kernel(O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh, total,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr):
    """delta[h, t] = rowsum(dO * O) in fp32: the softmax-gradient term the backward kernels subtract."""
    t0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_DV)
    o = _load_block(O + h * stride_oh, t0, total, stride_ot, cols, DV, BLOCK_T, True)
    do = _load_block(DO + h * stride_doh, t0, total, stride_dot, cols, DV, BLOCK_T, True)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    tl.store(DELTA + h * stride_lh + offs_t, tl.sum(o * do, 1), mask=offs_t < total)


@triton.jit
def _dkdv_inner(dk_a, dk_b, dv, k_a, k_b, v, q_base, do_base, LSE_h, DELTA_h, stride_qt, stride_dot, lo, hi,
                offs_n, length, qk_scale_log2, MASKED: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
                DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """dK, dV contributions of query blocks [lo, hi); ``MASKED`` applies the causal mask (diagonal blocks only).
    Query rows past the sequence load as zeros (q, dO, lse, delta), so they add exactly 0 unmasked."""
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        q_a = _load_block(q_base, start_m, length, stride_qt, cols_a, DQK, BLOCK_M, UPCAST)
        s_t = tl.dot(k_a, tl.trans(q_a))
        if DB > 0:
            cols_b = DA + tl.arange(0, DB)
            q_b = _load_block(q_base, start_m, length, stride_qt, cols_b, DQK, BLOCK_M, UPCAST)
            s_t += tl.dot(k_b, tl.trans(q_b))
        lse = tl.load(LSE_h + offs_m, mask=m_ok, other=0.0)
        p_t = tl.exp2(s_t * qk_scale_log2 - lse[None, :] * 1.4426950408889634)
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = _load_block(do_base, start_m, length, stride_dot, cols_v, DV, BLOCK_M, UPCAST)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        delta = tl.load(DELTA_h + offs_m, mask=m_ok, other=0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_a.dtype)
        dk_a += tl.dot(ds_t, q_a)
        if DB > 0:
            dk_b += tl.dot(ds_t, q_b)
    return dk_a, dk_b, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, CU, sm_scale, qk_scale_log2,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh, H,
                     CAUSAL: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                     BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    n0 = pid_n * BLOCK_N
    if n0 >= length:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    k_base = K + start * stride_kt + h * stride_kh
    k_a = _load_block(k_base, n0, length, stride_kt, cols_a, DQK, BLOCK_N, UPCAST)
    k_b = k_a
    dk_b = tl.zeros([BLOCK_N, DA], tl.float32)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        k_b = _load_block(k_base, n0, length, stride_kt, cols_b, DQK, BLOCK_N, UPCAST)
        dk_b = tl.zeros([BLOCK_N, DB], tl.float32)
    v = _load_block(V + start * stride_vt + h * stride_vh, n0, length, stride_vt, cols_v, DV, BLOCK_N, UPCAST)
    dk_a = tl.zeros([BLOCK_N, DA], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_base = Q + start * stride_qt + h * stride_qh
    do_base = DO + start * stride_dot + h * stride_doh
    lse_h = LSE + h * stride_lh + start
    delta_h = DELTA + h * stride_lh + start
    # causal: the query blocks on the diagonal (masked), then those below it; else every block unmasked
    diag_end = tl.minimum(n0 + BLOCK_N, length) if CAUSAL else 0
    if CAUSAL:
        dk_a, dk_b, dv = _dkdv_inner(dk_a, dk_b, dv, k_a, k_b, v, q_base, do_base, lse_h, delta_h, stride_qt,
                                     stride_dot, n0, diag_end, offs_n, length, qk_scale_log2, True, DQK, DV, DA, DB,
                                     BLOCK_DV, UPCAST, BLOCK_M)
    dk_a, dk_b, dv = _dkdv_inner(dk_a, dk_b, dv, k_a, k_b, v, q_base, do_base, lse_h, delta_h, stride_qt, stride_dot,
                                 diag_end, length, offs_n, length, qk_scale_log2, False, DQK, DV, DA, DB, BLOCK_DV,
                                 UPCAST, BLOCK_M)
    rows = tl.arange(0, BLOCK_N)
    n_ok = (offs_n < length)[:, None]
    dk_base = DK + (start + n0) * stride_dkt + h * stride_dkh + rows[:, None] * stride_dkt
    tl.store(dk_base + cols_a[None, :], cast_out(dk_a * sm_scale, DK.dtype.element_ty, UPCAST),
             mask=n_ok & (cols_a < DQK)[None, :])
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        tl.store(dk_base + cols_b[None, :], cast_out(dk_b * sm_scale, DK.dtype.element_ty, UPCAST),
                 mask=n_ok & (cols_b < DQK)[None, :])
    dv_ptr = DV_ + (start + n0) * stride_dvt + h * stride_dvh + rows[:, None] * stride_dvt + cols_v[None, :]
    tl.store(dv_ptr, cast_out(dv, DV_.dtype.element_ty, UPCAST), mask=n_ok & (cols_v < DV)[None, :])


@triton.jit
def _dq_inner(dq_a, dq_b, q_a, q_b, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, length,
              qk_scale_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
              DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """dQ contributions of key blocks [lo, hi); ``MASKED`` applies the causal and length masks."""
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        k_a = _load_block(k_base, start_n, length, stride_kt, cols_a, DQK, BLOCK_N, UPCAST)
        s = tl.dot(q_a, tl.trans(k_a))
        if DB > 0:
            cols_b = DA + tl.arange(0, DB)
            k_b = _load_block(k_base, start_n, length, stride_kt, cols_b, DQK, BLOCK_N, UPCAST)
            s += tl.dot(q_b, tl.trans(k_b))
        p = tl.exp2(s * qk_scale_log2 - lse[:, None] * 1.4426950408889634)
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = (offs_n < length)[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(_load_block(v_base, start_n, length, stride_vt, cols_v, DV, BLOCK_N, UPCAST)))
        ds = (p * (dp - delta[:, None])).to(k_a.dtype)
        dq_a += tl.dot(ds, k_a)
        if DB > 0:
            dq_b += tl.dot(ds, k_b)
    return dq_a, dq_b


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sm_scale, qk_scale_log2,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, stride_lh, H,
                   CAUSAL: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                   BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    m0 = pid_m * BLOCK_M
    if m0 >= length:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    cols_a = tl.arange(0, DA)
    q_base = Q + start * stride_qt + h * stride_qh
    q_a = _load_block(q_base, m0, length, stride_qt, cols_a, DQK, BLOCK_M, UPCAST)
    q_b = q_a
    dq_b = tl.zeros([BLOCK_M, DA], tl.float32)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        q_b = _load_block(q_base, m0, length, stride_qt, cols_b, DQK, BLOCK_M, UPCAST)
        dq_b = tl.zeros([BLOCK_M, DB], tl.float32)
    dq_a = tl.zeros([BLOCK_M, DA], tl.float32)
    do = _load_block(DO + start * stride_dot + h * stride_doh, m0, length, stride_dot, tl.arange(0, BLOCK_DV), DV,
                     BLOCK_M, UPCAST)
    lse = tl.load(LSE + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    diag = m0 if CAUSAL else length // BLOCK_N * BLOCK_N
    hi = tl.minimum(length, m0 + BLOCK_M) if CAUSAL else length
    dq_a, dq_b = _dq_inner(dq_a, dq_b, q_a, q_b, do, lse, delta, k_base, v_base, stride_kt, stride_vt, 0, diag,
                           offs_m, length, qk_scale_log2, False, CAUSAL, DQK, DV, DA, DB, BLOCK_DV, UPCAST, BLOCK_N)
    dq_a, dq_b = _dq_inner(dq_a, dq_b, q_a, q_b, do, lse, delta, k_base, v_base, stride_kt, stride_vt, diag, hi,
                           offs_m, length, qk_scale_log2, True, CAUSAL, DQK, DV, DA, DB, BLOCK_DV, UPCAST, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    dq_base = DQ + (start + m0) * stride_dqt + h * stride_dqh + rows[:, None] * stride_dqt
    tl.store(dq_base + cols_a[None, :], cast_out(dq_a * sm_scale, DQ.dtype.element_ty, UPCAST),
             mask=m_ok[:, None] & (cols_a < DQK)[None, :])
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        tl.store(dq_base + cols_b[None, :], cast_out(dq_b * sm_scale, DQ.dtype.element_ty, UPCAST),
                 mask=m_ok[:, None] & (cols_b < DQK)[None, :])


_fwd = None
_bwd_dkdv = None
_bwd_dq = None


def _kernels():
    """Autotuned kernels, built once (the config list depends on whether we are interpreted)."""
    global _fwd, _bwd_dkdv, _bwd_dq
    if _fwd is None:
        key = ["DQK", "DV", "CAUSAL"]
        _fwd = triton.autotune(_pick(FWD_CONFIGS), key=key)(_fwd_kernel)
        _bwd_dkdv = triton.autotune(_pick(DKDV_CONFIGS), key=key)(_bwd_dkdv_kernel)
        _bwd_dq = triton.autotune(_pick(DQ_CONFIGS), key=key)(_bwd_dq_kernel)
    return _fwd, _bwd_dkdv, _bwd_dq


def static_args(dqk: int, dv: int, causal: bool) -> dict:
    """The constexpr arguments every attention kernel takes for these head dims."""
    da, db = split_head_dim(dqk)
    return dict(CAUSAL=causal, DQK=dqk, DV=dv, DA=da, DB=db, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                UPCAST=interpreted())


def attention_forward(q, k, v, cu, max_seqlen: int, causal: bool, scale: float):
    """q/k [T, H, dqk], v [T, H, dv] (unit stride in d) -> (out [T, H, dv], lse fp32 [H, T])."""
    total, heads, dqk = q.shape
    dv = v.shape[-1]
    out = registry.empty(total, heads, dv, dtype=q.dtype, device=q.device)
    lse = registry.empty(heads, total, dtype=torch.float32, device=q.device)
    batch = cu.numel() - 1
    fwd, _, _ = _kernels()
    grid = lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch * heads)
    wrap_triton(fwd)[grid](q, k, v, out, lse, cu, scale * LOG2E,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              out.stride(0), out.stride(1), lse.stride(0), heads, **static_args(dqk, dv, causal))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, cu, max_seqlen: int, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ``attention_forward`` given dout [T, H, dv]."""
    total, heads, dqk = q.shape
    dv_dim = v.shape[-1]
    dout = unit_stride(dout)
    delta = torch.empty(heads, total, dtype=torch.float32, device=q.device)
    block_t = 16 if interpreted() else 64
    wrap_triton(_delta_kernel)[(triton.cdiv(total, block_t), heads)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0), total,
        DV=dv_dim, BLOCK_DV=max(16, triton.next_power_of_2(dv_dim)), BLOCK_T=block_t, num_warps=4)
    dq = registry.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = registry.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = registry.empty(v.shape, dtype=v.dtype, device=v.device)
    batch = cu.numel() - 1
    _, dkdv_kernel, dq_kernel = _kernels()
    static = static_args(dqk, dv_dim, causal)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              dout.stride(0), dout.stride(1))
    wrap_triton(dkdv_kernel)[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse, delta, dk, dv, cu, scale, scale * LOG2E, *common,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), heads, **static)
    wrap_triton(dq_kernel)[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch * heads)](
        q, k, v, dout, lse, delta, dq, cu, scale, scale * LOG2E, *common,
        dq.stride(0), dq.stride(1), lse.stride(0), heads, **static)
    return dq, dk, dv


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when its last dimension is strided (the kernels index d with stride 1)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flat(q, k, v, cu_seqlens, max_seqlen):
    """The varlen form the kernels take: ``[total, heads, d]`` views (unit stride in d), ``cu``, ``max_seqlen``."""
    if cu_seqlens is None:
        b, s, h, _ = q.shape
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        return [unit_stride(t).reshape(b * s, h, t.shape[-1]) for t in (q, k, v)], cu, s
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return [unit_stride(t) for t in (q, k, v)], cu_seqlens, max_seqlen


def mla_attention_triton(q, k, v, causal=True, softmax_scale=None, cu_seqlens=None, max_seqlen=None):
    """Triton path of ``flash_mla.mla_attention`` (arguments already validated): ``(out, lse [heads, total])``,
    the log-sum-exp the backward reads."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    (qf, kf, vf), cu, max_len = _flat(q, k, v, cu_seqlens, max_seqlen)
    out, lse = attention_forward(qf, kf, vf, cu, max_len, causal, scale)
    return out.view(*q.shape[:-1], v.shape[-1]), lse


def mla_attention_backward_triton(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    """Triton path of ``flash_mla.mla_attention_backward``, in either layout of the forward."""
    if lse.numel() == 0:
        raise registry.Unsupported("no log-sum-exp: the forward ran the reference, which keeps none")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    (qf, kf, vf), cu, max_len = _flat(q, k, v, cu_seqlens, max_seqlen)
    dq, dk, dv = attention_backward(dout.reshape(-1, *dout.shape[-2:]), qf, kf, vf, out.reshape(-1, *out.shape[-2:]),
                                    lse, cu, max_len, causal, scale)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
