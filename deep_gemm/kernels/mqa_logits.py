"""Triton lightning-indexer logits: ``fp8_mqa_logits`` (contiguous keys) and ``fp8_paged_mqa_logits`` (paged cache).

A program scores ``BLOCK_Q`` queries x all their heads against a tile of keys in one FP8 tensor-core dot: the
query rows ``[BLOCK_Q * H, d]`` (token-major, as ``q`` is laid out) times the keys ``[BLOCK_N, d]``, fp32
accumulation. Then ``ReLU(score * k_scale) * w``, summed over each query's ``H`` rows, gives the
``[BLOCK_Q, BLOCK_N]`` logits tile; positions outside a query's range are written ``-inf``. Each program walks
``TILES`` key tiles so its query tile is loaded once for ``TILES * BLOCK_N`` keys, and a tile no query of the
program can see is written ``-inf`` without being read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from accel.backend import triton_interpreted
from accel.registry import wrap_triton
from deep_gemm.mqa_logits import split_paged_cache


@triton.jit
def _load_queries(Q, W, t0, s_q, stride_qt, stride_qh, stride_wt, stride_wh, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_Q: tl.constexpr):
    """(q ``[BLOCK_Q * H, D]`` e4m3, w ``[BLOCK_Q * H]`` fp32) of queries ``t0 .. t0 + BLOCK_Q``; rows past s_q 0."""
    r = tl.arange(0, BLOCK_Q * H)
    t = t0 + r // H
    h = r % H
    ok = t < s_q
    q = tl.load(Q + t.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=ok[:, None], other=0.0)
    return q, tl.load(W + t.to(tl.int64) * stride_wt + h * stride_wh, mask=ok, other=0.0)


@triton.jit
def _score_tile(q, w, k, k_scale, H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """``sum_h w * ReLU(q . k * k_scale)`` per (query, key): ``[BLOCK_Q, BLOCK_N]`` fp32."""
    s = tl.dot(q, tl.trans(k))  # fp8 x fp8 -> fp32
    s = tl.maximum(s * k_scale[None, :], 0.0) * w[:, None]
    return tl.sum(tl.reshape(s, (BLOCK_Q, H, BLOCK_N)), 1)


@triton.jit
def _mqa_logits_kernel(Q, K, KS, W, KSTART, KEND, OUT, s_q, s_kv, stride_qt, stride_qh, stride_k, stride_wt,
                       stride_wh, stride_ot, H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_Q
    q, w = _load_queries(Q, W, t0, s_q, stride_qt, stride_qh, stride_wt, stride_wh, H, D, BLOCK_Q)
    rows = t0 + tl.arange(0, BLOCK_Q)
    row_ok = rows < s_q
    ks = tl.load(KSTART + rows, mask=row_ok, other=0)
    ke = tl.load(KEND + rows, mask=row_ok, other=0)
    lo = tl.min(tl.where(row_ok, ks, s_kv))
    hi = tl.max(ke)
    for i in range(TILES):
        n0 = (tl.program_id(1) * TILES + i) * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        logits = tl.full([BLOCK_Q, BLOCK_N], float("-inf"), tl.float32)
        if (n0 < hi) & (n0 + BLOCK_N > lo):  # some query of the tile sees some key of it
            n_ok = cols < s_kv
            k = tl.load(K + cols.to(tl.int64)[:, None] * stride_k + tl.arange(0, D)[None, :], mask=n_ok[:, None],
                        other=0.0)
            k_scale = tl.load(KS + cols, mask=n_ok, other=0.0)
            inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
            logits = tl.where(inside, _score_tile(q, w, k, k_scale, H, BLOCK_Q, BLOCK_N), float("-inf"))
        tl.store(OUT + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], logits,
                 mask=row_ok[:, None] & (cols < s_kv)[None, :])


@triton.jit
def _paged_mqa_logits_kernel(Q, KV, KS, W, LENS, BT, OUT, max_model_len, stride_qt, stride_qh, stride_blk, stride_tok,
                             stride_sblk, stride_wt, stride_wh, stride_bt, stride_ot, H: tl.constexpr, D: tl.constexpr,
                             NEXT_N: tl.constexpr, LENS_2D: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr,
                             TILES: tl.constexpr):
    """One sequence's ``NEXT_N`` queries (padded to ``BLOCK_Q``) against ``TILES`` of its pages."""
    b = tl.program_id(0)
    t0 = b * NEXT_N
    q, w = _load_queries(Q, W, t0, t0 + NEXT_N, stride_qt, stride_qh, stride_wt, stride_wh, H, D, BLOCK_Q)
    j = tl.arange(0, BLOCK_Q)
    row_ok = j < NEXT_N
    if LENS_2D:  # lengths per query
        ends = tl.load(LENS + t0 + j, mask=row_ok, other=0)
    else:  # query j of NEXT_N sees positions <= len - NEXT_N + j
        ends = tl.where(row_ok, tl.load(LENS + b) - NEXT_N + 1 + j, 0)
    ends = tl.minimum(ends, max_model_len)
    hi = tl.max(ends)
    for i in range(TILES):
        page = tl.program_id(1) * TILES + i
        cols = page * PAGE + tl.arange(0, PAGE)
        logits = tl.full([BLOCK_Q, PAGE], float("-inf"), tl.float32)
        if page * PAGE < hi:
            blk = tl.load(BT + b * stride_bt + page).to(tl.int64)
            tok = tl.arange(0, PAGE)
            k = tl.load(KV + blk * stride_blk + tok[:, None] * stride_tok + tl.arange(0, D)[None, :])
            k_scale = tl.load(KS + blk * stride_sblk + tok)
            logits = tl.where(cols[None, :] < ends[:, None], _score_tile(q, w, k, k_scale, H, BLOCK_Q, PAGE),
                              float("-inf"))
        tl.store(OUT + (t0 + j).to(tl.int64)[:, None] * stride_ot + cols[None, :], logits,
                 mask=row_ok[:, None] & (cols < max_model_len)[None, :])


def _check_tile(heads: int, d: int) -> None:
    if heads & (heads - 1) or d & (d - 1) or d < 16:
        raise registry.Unsupported(f"the Triton kernel needs power-of-two heads and head dim >= 16, got {heads}, {d}")


def fp8_mqa_logits_triton(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True):
    """Triton path of ``deep_gemm.fp8_mqa_logits`` (arguments already validated)."""
    k, k_scale = kv
    s_q, heads, d = q.shape
    _check_tile(heads, d)
    if q.stride(2) != 1 or k.stride(1) != 1 or k_scale.stride(0) != 1:
        raise registry.Unsupported("q and k need a unit stride along d, k_scale along keys")
    out = registry.empty(s_q, k.shape[0], dtype=torch.float32, device=q.device)
    block_q = max(1, 128 // heads)  # 128 query rows per dot (one wgmma M tile of 64 x 2)
    block_n, tiles = (16, 2) if triton_interpreted() else (128, 4)
    grid = (triton.cdiv(s_q, block_q), triton.cdiv(k.shape[0], block_n * tiles))
    if s_q and k.shape[0]:
        wrap_triton(_mqa_logits_kernel)[grid](q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, s_q, k.shape[0],
                                 q.stride(0), q.stride(1), k.stride(0), weights.stride(0), weights.stride(1),
                                 out.stride(0), H=heads, D=d, BLOCK_Q=block_q, BLOCK_N=block_n, TILES=tiles,
                                 num_warps=8, num_stages=1)
    return out


def fp8_paged_mqa_logits_triton(q, kv_cache, weights, context_lens, block_table, schedule_metadata, max_model_len,
                                clean_logits=True):
    """Triton path of ``deep_gemm.fp8_paged_mqa_logits`` (arguments already validated)."""
    b, next_n, heads, d = q.shape
    _check_tile(heads, d)
    page = kv_cache.shape[1]
    if page & (page - 1) or page < 16:
        raise registry.Unsupported(f"the Triton kernel needs a power-of-two block size >= 16, got {page}")
    if q.stride(3) != 1 or q.stride(1) != heads * q.stride(2):
        raise registry.Unsupported("q must be contiguous in its heads and d")
    keys, scales = split_paged_cache(kv_cache)
    q2 = q.view(b * next_n, heads, d)
    out = registry.empty(b * next_n, max_model_len, dtype=torch.float32, device=q.device)
    tiles = 2 if triton_interpreted() else 4
    grid = (b, triton.cdiv(triton.cdiv(max_model_len, page), tiles))
    # at least 16 query rows per dot (the tensor-core minimum); the padding rows are masked
    block_q = max(triton.next_power_of_2(next_n), triton.cdiv(16, heads))
    wrap_triton(_paged_mqa_logits_kernel)[grid](q2, keys, scales, weights, context_lens, block_table, out,
                                   max_model_len,
                                   q2.stride(0), q2.stride(1), keys.stride(0), keys.stride(1), scales.stride(0),
                                   weights.stride(0), weights.stride(1), block_table.stride(0), out.stride(0),
                                   H=heads, D=d, NEXT_N=next_n, LENS_2D=context_lens.dim() == 2, BLOCK_Q=block_q,
                                   PAGE=page, TILES=tiles, num_warps=8, num_stages=1)
    return out
