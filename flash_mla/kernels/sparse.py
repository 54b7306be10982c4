"""Triton sparse MLA (DSA): forward over gathered latent rows, its backward, and sparse decode on the FP8 cache.

One program owns one query token and a tile of ``BLOCK_H`` of its heads: all heads of a token share the token's
top-k keys (MQA over the latent), so each gathered key tile serves ``BLOCK_H`` query rows at once and the
products are ``[BLOCK_H, d] x [d, BLOCK_K]`` tensor-core dots. A key row is split at ``d_v`` into the value part
(``kv[:, :d_v]``, also the first part of the key) and the rest (the RoPE columns), so the value tile is the key
tile already on chip. Invalid slots (-1, ``>= s_kv``) load nothing and score ``-inf``.

The backward recomputes P from the saved base-2 lse. ``dq`` stays in registers; ``dkv`` is scattered with fp32
atomics: the rows a query selects are arbitrary, so there is no key-block structure a transposed pass could
walk without first building the inverse index (a sort of ``s_q x topk`` entries) and recomputing P a second time
per key, as a matrix-vector product. The atomics add each program's ``BLOCK_H``-head partial sum once per key,
so ``h_q / BLOCK_H`` adds per (query, key); their order varies, so ``dkv`` is not bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import autotune, registry
from accel.registry import wrap_triton
from flash_mla.fp8_cache import D_NOPE, D_ROPE, split_fp8_cache
from flash_mla.kernels.common import cast_out, interpreted, pipeline_stages
from flash_mla.kernels.decode import _dequant_fp8

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _gather_rows(base, rows, valid, stride_row, cols, limit, UPCAST: tl.constexpr):
    """``[BLOCK_K, len(cols)]`` tile of the rows ``rows`` (columns ``< limit``); invalid rows load zeros."""
    x = tl.load(base + rows[:, None] * stride_row + cols[None, :], mask=valid[:, None] & (cols < limit)[None, :],
                other=0.0)
    return x.to(tl.float32) if UPCAST else x


@triton.jit
def _load_indices(IDX, t, stride_it, k0, topk, s_kv, BLOCK_K: tl.constexpr):
    """(rows int64, valid) of top-k slots ``k0 .. k0 + BLOCK_K`` of query ``t``; invalid rows point at row 0."""
    slots = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(IDX + t * stride_it + slots, mask=slots < topk, other=-1)
    valid = (idx >= 0) & (idx < s_kv)
    return tl.where(valid, idx, 0).to(tl.int64), valid


@triton.jit
def _attend(acc, m_i, l_i, q_v, q_r, k_v, k_r, valid, qk_scale_log2, HAS_ROPE: tl.constexpr):
    """One online-softmax step over a gathered key tile (scores in log2 units; value tile = ``k_v``; without
    RoPE columns, d_qk = d_v as in V4, the key is the value tile alone)."""
    if HAS_ROPE:
        s = tl.dot(q_v, tl.trans(k_v), tl.dot(q_r, tl.trans(k_r)))
    else:
        s = tl.dot(q_v, tl.trans(k_v))
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet stay at 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(k_v.dtype), k_v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _load_heads(X, t, heads, h_q, stride_t, stride_h, cols, limit, UPCAST: tl.constexpr):
    """``[BLOCK_H, len(cols)]`` tile of token ``t``'s rows ``heads`` of a ``[tokens, heads, d]`` tensor."""
    x = tl.load(X + t * stride_t + heads[:, None] * stride_h + cols[None, :],
                mask=(heads < h_q)[:, None] & (cols < limit)[None, :], other=0.0)
    return x.to(tl.float32) if UPCAST else x


@triton.jit
def _store_out(OUT, MAXL, LSE, acc, m_i, m_keys, l_i, t, heads, h_q, stride_ot, stride_oh, stride_st, stride_sh,
               cols_v, lse_scale, D_V: tl.constexpr, UPCAST: tl.constexpr):
    """out = acc / l (0 for a query with no valid key), max_logits = ``m_keys`` (-inf there), lse = (m + log2 l) *
    ``lse_scale`` (+inf there): base 2 with lse_scale 1, natural with ln 2. ``m_i`` is ``m_keys`` unless a sink
    joined the softmax (then l > 0 on every row and the lse counts the sink)."""
    live = l_i > 0
    h_ok = heads < h_q
    o = tl.where(live[:, None], acc / tl.where(live, l_i, 1.0)[:, None], 0.0)
    tl.store(OUT + t * stride_ot + heads[:, None] * stride_oh + cols_v[None, :], cast_out(o, OUT.dtype.element_ty,
             UPCAST), mask=h_ok[:, None] & (cols_v < D_V)[None, :])
    lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * lse_scale, float("inf"))
    tl.store(LSE + t * stride_st + heads * stride_sh, lse, mask=h_ok)
    tl.store(MAXL + t * stride_st + heads * stride_sh, m_keys, mask=h_ok)


@triton.jit
def _sparse_fwd_kernel(Q, KV, IDX, SINK, OUT, MAXL, LSE, s_kv, h_q, topk, qk_scale_log2, lse_scale,
                       stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_st, stride_sh,
                       D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                       HAS_ROPE: tl.constexpr, HAS_SINK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols_v = tl.arange(0, BLOCK_V)
    cols_r = D_V + tl.arange(0, BLOCK_R)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q_v = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols_v, D_V, UPCAST)
    q_r = q_v
    if HAS_ROPE:
        q_r = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols_r, D_QK, UPCAST)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        rows, valid = _load_indices(IDX, t, stride_it, k0, topk, s_kv, BLOCK_K)
        k_v = _gather_rows(KV, rows, valid, stride_kv, cols_v, D_V, UPCAST)
        k_r = k_v
        if HAS_ROPE:
            k_r = _gather_rows(KV, rows, valid, stride_kv, cols_r, D_QK, UPCAST)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_v, q_r, k_v, k_r, valid, qk_scale_log2, HAS_ROPE)
    m_keys = m_i
    if HAS_SINK:  # one more logit per head, with no value: it joins l (and the lse), never acc
        sink = tl.load(SINK + heads, mask=heads < h_q, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.maximum(m_keys, sink)
        alpha = tl.exp2(m_keys - m_i)
        l_i = l_i * alpha + tl.exp2(sink - m_i)
        acc = acc * alpha[:, None]
    _store_out(OUT, MAXL, LSE, acc, m_i, m_keys, l_i, t, heads, h_q, stride_ot, stride_oh, stride_st, stride_sh,
               cols_v, lse_scale, D_V, UPCAST)


@triton.jit
def _sparse_decode_fp8_kernel(Q, KN, KS, KR, IDX, OUT, MAXL, LSE, s_kv, h_q, topk, qk_scale_log2, lse_scale,
                              stride_qt, stride_qh, stride_kn, stride_ks, stride_kr, stride_it, stride_ot, stride_oh,
                              stride_st, stride_sh, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """The forward over FlashMLA's 656-byte FP8 cache: each gathered tile is dequantised to bf16 once (values x
    their 128-column scale, as FlashMLA does) and serves both products."""
    t = tl.program_id(0).to(tl.int64)
    cols_v = tl.arange(0, 512)
    cols_r = tl.arange(0, 64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q_v = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols_v, 512, UPCAST)
    q_r = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, 512 + cols_r, 576, UPCAST)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        rows, valid = _load_indices(IDX, t, stride_it, k0, topk, s_kv, BLOCK_K)
        k_v = tl.load(KN + rows[:, None] * stride_kn + cols_v[None, :], mask=valid[:, None], other=0.0)
        scale = tl.load(KS + rows[:, None] * stride_ks + tl.arange(0, 4)[None, :], mask=valid[:, None], other=0.0)
        k_v = _dequant_fp8(k_v, scale, BLOCK_K, UPCAST)
        k_r = _gather_rows(KR, rows, valid, stride_kr, cols_r, 64, UPCAST)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_v, q_r, k_v, k_r, valid, qk_scale_log2, True)
    _store_out(OUT, MAXL, LSE, acc, m_i, m_i, l_i, t, heads, h_q, stride_ot, stride_oh, stride_st, stride_sh, cols_v,
               lse_scale, 512, UPCAST)


@triton.jit
def _sparse_bwd_kernel(Q, KV, IDX, SINK, O, DO, LSE, DQ, DKV, DSINK, s_kv, h_q, topk, sm_scale, qk_scale_log2,
                       stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_dot, stride_doh,
                       stride_st, stride_sh, stride_dqt, stride_dqh, stride_dkv,
                       D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                       HAS_ROPE: tl.constexpr, HAS_SINK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols_v = tl.arange(0, BLOCK_V)
    cols_r = D_V + tl.arange(0, BLOCK_R)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q_v = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols_v, D_V, UPCAST)
    q_r = q_v
    if HAS_ROPE:
        q_r = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols_r, D_QK, UPCAST)
    do = _load_heads(DO, t, heads, h_q, stride_dot, stride_doh, cols_v, D_V, True)
    o = _load_heads(O, t, heads, h_q, stride_ot, stride_oh, cols_v, D_V, True)
    delta = tl.sum(o * do, 1)  # rowsum(dO * O): the softmax-gradient term
    do = do.to(q_v.dtype)
    # a query with no valid key saved lse = +inf: its P is 0 and it adds nothing anywhere
    lse = tl.load(LSE + t * stride_st + heads * stride_sh, mask=heads < h_q, other=float("inf"))
    if HAS_SINK:  # d lse / d sink = P_sink, so d loss / d sink = -P_sink * rowsum(dO * O), summed over queries
        sink = tl.load(SINK + heads, mask=heads < h_q, other=0.0).to(tl.float32) * 1.4426950408889634
        tl.atomic_add(DSINK + heads, -tl.exp2(sink - lse) * delta, mask=heads < h_q)
    dq_v = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        rows, valid = _load_indices(IDX, t, stride_it, k0, topk, s_kv, BLOCK_K)
        k_v = _gather_rows(KV, rows, valid, stride_kv, cols_v, D_V, UPCAST)
        if HAS_ROPE:
            k_r = _gather_rows(KV, rows, valid, stride_kv, cols_r, D_QK, UPCAST)
            s = tl.dot(q_v, tl.trans(k_v), tl.dot(q_r, tl.trans(k_r)))
        else:
            s = tl.dot(q_v, tl.trans(k_v))
        p = tl.where(valid[None, :], tl.exp2(s * qk_scale_log2 - lse[:, None]), 0.0)
        ds = (p * (tl.dot(do, tl.trans(k_v)) - delta[:, None])).to(q_v.dtype)
        # each dkv part is added as soon as it exists, so the two never hold registers at once
        dkv_rows = DKV + rows[:, None] * stride_dkv
        dk_v = tl.dot(tl.trans(ds), q_v) * sm_scale + tl.dot(tl.trans(p.to(do.dtype)), do)
        tl.atomic_add(dkv_rows + cols_v[None, :], dk_v, mask=valid[:, None] & (cols_v < D_V)[None, :])
        if HAS_ROPE:
            dk_r = tl.dot(tl.trans(ds), q_r) * sm_scale
            tl.atomic_add(dkv_rows + cols_r[None, :], dk_r, mask=valid[:, None] & (cols_r < D_QK)[None, :])
            dq_r = tl.dot(ds, k_r, dq_r)
        dq_v = tl.dot(ds, k_v, dq_v)
    dq_ptr = DQ + t * stride_dqt + heads[:, None] * stride_dqh
    h_ok = (heads < h_q)[:, None]
    tl.store(dq_ptr + cols_v[None, :], cast_out(dq_v * sm_scale, DQ.dtype.element_ty, UPCAST),
             mask=h_ok & (cols_v < D_V)[None, :])
    if HAS_ROPE:
        tl.store(dq_ptr + cols_r[None, :], cast_out(dq_r * sm_scale, DQ.dtype.element_ty, UPCAST),
                 mask=h_ok & (cols_r < D_QK)[None, :])


@triton.jit
def _cast_kernel(SRC, DST, n, UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    """The fp32 atomics buffer -> kv's dtype (round to nearest under the interpreter too)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(SRC + offs, mask=offs < n)
    tl.store(DST + offs, cast_out(x, DST.dtype.element_ty, UPCAST), mask=offs < n)


# (BLOCK_H, BLOCK_K, warps, stages). Only configs that compile for sm_90a without register spills at d_qk 576 /
# d_v 512 (tests/test_kernel_compile.py, benchmarks/kernels_compiled.md); the interpreter runs one small config.
# FlashMLA's 64-head tile (two warp groups on a 64 x 512 fp32 accumulator, wgmma) fits in Triton 3.6 (the H200
# image's) and spills in 3.9 for the reason flash_mla/kernels/decode.py gives (per-thread wgmma descriptors over the
# 36 K steps of 576), so 3.9 gets 32/16-head tiles (mma.sync). The FP8 decode's dequantisation adds registers:
# 16 heads in both. The backward holds dq (heads x 576 fp32) besides the recomputed tiles: 32 heads per program
# fit in 3.6 (half the atomics of 16), 16 in 3.9.
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    FWD_CONFIGS = [(64, 32, 8, 2), (32, 32, 8, 2), (16, 32, 4, 3)]
    BWD_CONFIGS = [(32, 16, 8, 1), (32, 16, 8, 2), (16, 32, 8, 1)]
else:
    FWD_CONFIGS = [(32, 32, 8, 2), (16, 32, 4, 3), (16, 64, 4, 2)]
    BWD_CONFIGS = [(16, 32, 8, 1), (16, 16, 8, 1)]
DECODE_FP8_CONFIGS = [(16, 32, 8, 2), (16, 16, 4, 2), (16, 16, 4, 1)]
_INTERP = [(16, 16, 1, 1)]
_tuned: dict = {}


def _kernel(name: str, fn, configs, reset_to_zero: list[str] | None = None):
    """``fn`` autotuned over ``configs`` (built once per kernel); ``reset_to_zero``: accumulators the autotuner
    must zero before each timed config (the backward's atomics would otherwise add every trial's result)."""
    if name not in _tuned:
        chosen = _INTERP if interpreted() else configs
        _tuned[name] = triton.autotune(
            autotune.shard([triton.Config({"BLOCK_H": h, "BLOCK_K": k}, num_warps=w, num_stages=pipeline_stages(s))
                            for h, k, w, s in chosen]),
            key=["D_QK", "D_V"] if name != "decode_fp8" else ["UPCAST"], reset_to_zero=reset_to_zero,
        )(fn)
    return _tuned[name]


def tile_args(d_qk: int, d_v: int) -> dict:
    """Constexprs of the bf16 kernels: the value part padded to a power of two, the rest (RoPE columns; none when
    d_qk = d_v, V4's shared K = V head) likewise."""
    return dict(D_QK=d_qk, D_V=d_v, BLOCK_V=max(16, triton.next_power_of_2(d_v)),
                BLOCK_R=max(16, triton.next_power_of_2(max(d_qk - d_v, 1))), HAS_ROPE=d_qk > d_v,
                UPCAST=interpreted())


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _head_grid(s_q: int, h_q: int):
    return lambda meta: (s_q, triton.cdiv(h_q, meta["BLOCK_H"]))


def sparse_forward(q, kv, indices, sm_scale: float, d_v: int, lse_scale: float = 1.0, sink=None):
    """q [s_q, h_q, d_qk], kv [s_kv, d_qk], indices [s_q, topk] -> (out, max_logits, lse) (lse x ``lse_scale``);
    ``sink [h_q]``: a natural-log logit per head joining every row's softmax (max_logits stays the keys')."""
    q, kv, indices = _unit(q), _unit(kv), _unit(indices)
    s_q, h_q, d_qk = q.shape
    out = registry.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = registry.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = registry.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q:
        wrap_triton(_kernel("fwd", _sparse_fwd_kernel, FWD_CONFIGS))[_head_grid(s_q, h_q)](
            q, kv, indices, lse if sink is None else sink, out, max_logits, lse, kv.shape[0], h_q, indices.shape[1],
            sm_scale * LOG2E, lse_scale, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0),
            out.stride(1), lse.stride(0), lse.stride(1), HAS_SINK=sink is not None, **tile_args(d_qk, d_v))
    return out, max_logits, lse


def sparse_fwd_triton(q, kv, indices, sm_scale, d_v=512):
    """Triton path of ``flash_mla.flash_mla_sparse_fwd`` (arguments already validated)."""
    return sparse_forward(q, kv[:, 0], indices[:, 0], float(sm_scale), d_v)


def sparse_backward(dout, q, kv, indices, out, lse, sm_scale: float, d_v: int, sink=None):
    """(dq, dkv, dsink fp32 [h_q] or None) from the forward's out and base-2 lse (which counts ``sink``)."""
    if lse.numel() == 0:
        raise registry.Unsupported("no log-sum-exp: the forward ran the reference, which keeps none")
    q, kv, indices, dout, out = (_unit(t) for t in (q, kv, indices, dout, out))
    s_q, h_q, d_qk = q.shape
    dq = registry.empty(q.shape, dtype=q.dtype, device=q.device)
    dkv = registry.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the atomics' accumulator
    # always a buffer of its own: the autotuner zeroes DSINK between trials, so it must never alias another argument
    dsink = torch.zeros(h_q, dtype=torch.float32, device=q.device)
    if s_q:
        wrap_triton(_kernel("bwd", _sparse_bwd_kernel, BWD_CONFIGS, reset_to_zero=["DKV", "DSINK"]))[
            _head_grid(s_q, h_q)](
            q, kv, indices, lse if sink is None else sink, out, dout, lse, dq, dkv32,
            dsink, kv.shape[0], h_q, indices.shape[1], sm_scale,
            sm_scale * LOG2E, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
            dout.stride(0), dout.stride(1), lse.stride(0), lse.stride(1), dq.stride(0), dq.stride(1), dkv32.stride(0),
            HAS_SINK=sink is not None, **tile_args(d_qk, d_v))
    block = 1024
    wrap_triton(_cast_kernel)[(triton.cdiv(dkv.numel(), block),)](dkv32, dkv, dkv.numel(), UPCAST=interpreted(),
                                                                   BLOCK=block)
    return dq, dkv, None if sink is None else dsink


def sparse_backward_triton(dout, q, kv, indices, out, lse, sm_scale, d_v):
    """Triton path of the backward op: (dq, dkv) from the forward's out and base-2 lse."""
    return sparse_backward(dout, q, kv, indices, out, lse, sm_scale, d_v)[:2]


def sparse_sink_attention_triton(q, kv, indices, sink, sm_scale):
    """Triton path of ``flash_mla.sparse_sink_attention`` (V4: K = V = ``kv``, a sink logit per head):
    ``(out, lse)``, lse base 2 and counting the sink."""
    out, _, lse = sparse_forward(q, kv, indices, float(sm_scale), kv.shape[-1], sink=_unit(sink))
    return out, lse


def sparse_sink_attention_backward_triton(dout, q, kv, indices, sink, out, lse, sm_scale):
    """Triton path of ``flash_mla.sparse_sink_attention_backward``: (dq, dkv, dsink in sink's dtype)."""
    dq, dkv, dsink = sparse_backward(dout, q, kv, indices, out, lse, float(sm_scale), kv.shape[-1], _unit(sink))
    return dq, dkv, dsink.to(sink.dtype)


def sparse_mla_attention_triton(q, kv, indices, sm_scale, d_v=512):
    """Triton path of ``flash_mla.sparse_mla_attention`` (arguments already validated): ``(out, lse)``, the
    base-2 log-sum-exp the backward reads."""
    out, _, lse = sparse_forward(q, kv, indices, float(sm_scale), d_v)
    return out, lse


def sparse_decode_triton(q, k_cache, head_dim_v, softmax_scale, is_fp8_kvcache, indices):
    """Triton path of ``flash_mla_with_kvcache(..., indices=...)``: the sparse forward over the flattened cache
    (``indices`` are cache slots), natural-log lse ``[b, h_q, s_q]`` (a transposed view)."""
    b, s_q, h_q, d = q.shape
    if d != D_NOPE + D_ROPE or head_dim_v != D_NOPE:
        raise registry.Unsupported(f"sparse decoding is built for head dim {D_NOPE + D_ROPE} / v {D_NOPE}, got "
                                   f"{d} / {head_dim_v}")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    q2 = _unit(q).reshape(b * s_q, h_q, d)
    idx = _unit(indices).reshape(b * s_q, indices.shape[-1])
    if not is_fp8_kvcache:
        out, _, lse = sparse_forward(q2, k_cache.reshape(-1, d), idx, scale, head_dim_v, lse_scale=LN2)
        return out.view(b, s_q, h_q, head_dim_v), lse.view(b, s_q, h_q).transpose(1, 2)
    values, scales, rope = split_fp8_cache(k_cache.reshape(-1, k_cache.shape[-1]))
    out = registry.empty(b * s_q, h_q, D_NOPE, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(b * s_q, h_q, dtype=torch.float32, device=q.device)  # not returned by decoding
    lse = registry.empty(b * s_q, h_q, dtype=torch.float32, device=q.device)
    if b * s_q:
        wrap_triton(_kernel("decode_fp8", _sparse_decode_fp8_kernel, DECODE_FP8_CONFIGS))[_head_grid(b * s_q, h_q)](
            q2, values, scales, rope, idx, out, max_logits, lse, values.shape[0], h_q, idx.shape[1], scale * LOG2E,
            LN2, q2.stride(0), q2.stride(1), values.stride(0), scales.stride(0), rope.stride(0), idx.stride(0),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), UPCAST=interpreted())
    return out.view(b, s_q, h_q, D_NOPE), lse.view(b, s_q, h_q).transpose(1, 2)
