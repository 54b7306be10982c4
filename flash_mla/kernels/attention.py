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

from accel import registry
from flash_mla.kernels.common import cast_out, interpreted, pipeline_stages, split_head_dim

LOG2E = 1.4426950408889634


def _configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=pipeline_stages(s))
            for m, n, w, s in blocks]


# (BLOCK_M, BLOCK_N, warps, stages); the interpreter gets one small config (autotuning would run them all).
_FWD_CONFIGS = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3)]
_BWD_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)]
_INTERP_CONFIG = [(16, 16, 1, 1)]


def _pick(configs):
    return _configs(_INTERP_CONFIG if interpreted() else configs)


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_t, cols, col_ok, UPCAST: tl.constexpr):
    x = tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _sequence_of_program(CU, H):
    """(head, first token, length) of the sequence this program's axis-1 index (batch x heads) covers."""
    bh = tl.program_id(1)
    start = tl.load(CU + bh // H)
    return bh % H, start, tl.load(CU + bh // H + 1) - start


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU, qk_scale_log2,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_lh, H, DQK, DV,
                CAUSAL: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    v_ok = cols_v < DV
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    q_a = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_a, cols_a < DQK, UPCAST)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        q_b = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_b, cols_b < DQK, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M) if CAUSAL else length
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < length
        k_a = _load_rows(k_base, offs_n, n_ok, stride_kt, cols_a, cols_a < DQK, UPCAST)
        s = tl.dot(q_a, tl.trans(k_a))
        if DB > 0:
            k_b = _load_rows(k_base, offs_n, n_ok, stride_kt, cols_b, cols_b < DQK, UPCAST)
            s += tl.dot(q_b, tl.trans(k_b))
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, offs_n, n_ok, stride_vt, cols_v, v_ok, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_ptr = O + start * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + cols_v[None, :]
    tl.store(o_ptr, cast_out(acc, O.dtype.element_ty, UPCAST), mask=m_ok[:, None] & v_ok[None, :])
    # natural log: lse = (m + log2 l) * ln 2, with m in log2 units
    tl.store(LSE + h * stride_lh + start + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, CU, sm_scale, qk_scale_log2,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh, H, DQK, DV,
                     CAUSAL: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    if pid_n * BLOCK_N >= length:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < length
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    v_ok = cols_v < DV
    q_base = Q + start * stride_qt + h * stride_qh
    do_base = DO + start * stride_dot + h * stride_doh
    k_a = _load_rows(K + start * stride_kt + h * stride_kh, offs_n, n_ok, stride_kt, cols_a, cols_a < DQK, UPCAST)
    v = _load_rows(V + start * stride_vt + h * stride_vh, offs_n, n_ok, stride_vt, cols_v, v_ok, UPCAST)
    dk_a = tl.zeros([BLOCK_N, DA], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        k_b = _load_rows(K + start * stride_kt + h * stride_kh, offs_n, n_ok, stride_kt, cols_b, cols_b < DQK,
                         UPCAST)
        dk_b = tl.zeros([BLOCK_N, DB], tl.float32)
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, length, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        q_a = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_a, cols_a < DQK, UPCAST)
        s_t = tl.dot(k_a, tl.trans(q_a))
        if DB > 0:
            q_b = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_b, cols_b < DQK, UPCAST)
            s_t += tl.dot(k_b, tl.trans(q_b))
        lse = tl.load(LSE + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
        keep = m_ok[None, :] & n_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(keep, tl.exp2(s_t * qk_scale_log2 - lse[None, :] * 1.4426950408889634), 0.0)
        do = _load_rows(do_base, offs_m, m_ok, stride_dot, cols_v, v_ok, UPCAST)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        delta = tl.load(DELTA + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_a.dtype)
        dk_a += tl.dot(ds_t, q_a)
        if DB > 0:
            dk_b += tl.dot(ds_t, q_b)
    dk_base = DK + start * stride_dkt + h * stride_dkh + offs_n[:, None] * stride_dkt
    tl.store(dk_base + cols_a[None, :], cast_out(dk_a * sm_scale, DK.dtype.element_ty, UPCAST),
             mask=n_ok[:, None] & (cols_a < DQK)[None, :])
    if DB > 0:
        tl.store(dk_base + cols_b[None, :], cast_out(dk_b * sm_scale, DK.dtype.element_ty, UPCAST),
                 mask=n_ok[:, None] & (cols_b < DQK)[None, :])
    dv_ptr = DV_ + start * stride_dvt + h * stride_dvh + offs_n[:, None] * stride_dvt + cols_v[None, :]
    tl.store(dv_ptr, cast_out(dv, DV_.dtype.element_ty, UPCAST), mask=n_ok[:, None] & v_ok[None, :])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sm_scale, qk_scale_log2,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, stride_lh, H, DQK, DV,
                   CAUSAL: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h, start, length = _sequence_of_program(CU, H)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    cols_a = tl.arange(0, DA)
    cols_v = tl.arange(0, BLOCK_DV)
    v_ok = cols_v < DV
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    q_a = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_a, cols_a < DQK, UPCAST)
    dq_a = tl.zeros([BLOCK_M, DA], tl.float32)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        q_b = _load_rows(q_base, offs_m, m_ok, stride_qt, cols_b, cols_b < DQK, UPCAST)
        dq_b = tl.zeros([BLOCK_M, DB], tl.float32)
    do = _load_rows(DO + start * stride_dot + h * stride_doh, offs_m, m_ok, stride_dot, cols_v, v_ok, UPCAST)
    lse = tl.load(LSE + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + h * stride_lh + start + offs_m, mask=m_ok, other=0.0)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M) if CAUSAL else length
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < length
        k_a = _load_rows(k_base, offs_n, n_ok, stride_kt, cols_a, cols_a < DQK, UPCAST)
        s = tl.dot(q_a, tl.trans(k_a))
        if DB > 0:
            k_b = _load_rows(k_base, offs_n, n_ok, stride_kt, cols_b, cols_b < DQK, UPCAST)
            s += tl.dot(q_b, tl.trans(k_b))
        keep = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp2(s * qk_scale_log2 - lse[:, None] * 1.4426950408889634), 0.0)
        v = _load_rows(v_base, offs_n, n_ok, stride_vt, cols_v, v_ok, UPCAST)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k_a.dtype)
        dq_a += tl.dot(ds, k_a)
        if DB > 0:
            dq_b += tl.dot(ds, k_b)
    dq_base = DQ + start * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt
    tl.store(dq_base + cols_a[None, :], cast_out(dq_a * sm_scale, DQ.dtype.element_ty, UPCAST),
             mask=m_ok[:, None] & (cols_a < DQK)[None, :])
    if DB > 0:
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
        _fwd = triton.autotune(_pick(_FWD_CONFIGS), key=key)(_fwd_kernel)
        _bwd_dkdv = triton.autotune(_pick(_BWD_CONFIGS), key=key)(_bwd_dkdv_kernel)
        _bwd_dq = triton.autotune(_pick(_BWD_CONFIGS), key=key)(_bwd_dq_kernel)
    return _fwd, _bwd_dkdv, _bwd_dq


def _static(dqk: int, dv: int, causal: bool) -> dict:
    da, db = split_head_dim(dqk)
    return dict(CAUSAL=causal, DA=da, DB=db, BLOCK_DV=max(16, triton.next_power_of_2(dv)), UPCAST=interpreted())


def attention_forward(q, k, v, cu, max_seqlen: int, causal: bool, scale: float):
    """q/k [T, H, dqk], v [T, H, dv] (unit stride in d) -> (out [T, H, dv], lse fp32 [H, T])."""
    total, heads, dqk = q.shape
    dv = v.shape[-1]
    out = registry.empty(total, heads, dv, dtype=q.dtype, device=q.device)
    lse = registry.empty(heads, total, dtype=torch.float32, device=q.device)
    batch = cu.numel() - 1
    fwd, _, _ = _kernels()
    grid = lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch * heads)
    fwd[grid](q, k, v, out, lse, cu, scale * LOG2E,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              out.stride(0), out.stride(1), lse.stride(0), heads, dqk, dv, **_static(dqk, dv, causal))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, cu, max_seqlen: int, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ``attention_forward`` given dout [T, H, dv]."""
    total, heads, dqk = q.shape
    dv_dim = v.shape[-1]
    dout = dout.contiguous()
    delta = (out.float() * dout.float()).sum(-1).t().contiguous()  # rowsum(dO * O) [H, T]
    dq = registry.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = registry.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = registry.empty(v.shape, dtype=v.dtype, device=v.device)
    batch = cu.numel() - 1
    _, dkdv_kernel, dq_kernel = _kernels()
    static = _static(dqk, dv_dim, causal)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              dout.stride(0), dout.stride(1))
    dkdv_kernel[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse, delta, dk, dv, cu, scale, scale * LOG2E, *common,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), heads, dqk, dv_dim, **static)
    dq_kernel[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch * heads)](
        q, k, v, dout, lse, delta, dq, cu, scale, scale * LOG2E, *common,
        dq.stride(0), dq.stride(1), lse.stride(0), heads, dqk, dv_dim, **static)
    return dq, dk, dv


class _MLAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, causal, scale):
        out, lse = attention_forward(q, k, v, cu, max_seqlen, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.args = (max_seqlen, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_mla.attention import mla_attention_backward_op  # the registered op: verifiable, strict-aware

        q, k, v, out, lse, cu = ctx.saved_tensors
        max_seqlen, causal, scale = ctx.args
        dq, dk, dv = mla_attention_backward_op(dout, q, k, v, out, lse, cu, max_seqlen, causal, scale)
        return dq, dk, dv, None, None, None, None


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_attention_triton(q, k, v, causal=True, softmax_scale=None, cu_seqlens=None, max_seqlen=None):
    """Triton path of ``flash_mla.mla_attention`` (arguments already validated)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if cu_seqlens is None:
        b, s, h, _ = q.shape
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        flat = [_unit_stride(t).reshape(b * s, h, t.shape[-1]) for t in (q, k, v)]
        out = _MLAAttention.apply(*flat, cu, s, causal, scale)
        return out.view(b, s, h, v.shape[-1])
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return _MLAAttention.apply(_unit_stride(q), _unit_stride(k), _unit_stride(v), cu_seqlens, max_seqlen, causal,
                               scale)
