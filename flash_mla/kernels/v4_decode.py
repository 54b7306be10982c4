"""Triton sparse decode over DeepSeek-V4's FP8 KV cache (FlashMLA's 584-byte layout, ``flash_mla.v4_cache``).

One program owns one query token and ``BLOCK_H`` of its heads, as the sparse forward (``flash_mla.kernels.sparse``):
every head of a token reads the same listed rows. Each gathered tile is dequantised once, in registers, to the
query's dtype (e4m3 values x their 64-column tile's UE8M0 power of two, built from the exponent byte's bits, and
the bf16 RoPE columns: exact, so the tile equals ``dequantize_kv_v4``'s rows) and serves as key and value (K = V).
Online softmax in base 2 with the sink logit joining each head's denominator at the end; out = 0 and lse = sink
for a query with no valid row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from flash_mla.kernels.common import cast_out, interpreted
from flash_mla.kernels.sparse import _load_heads, _load_indices
from flash_mla.v4_cache import BYTES_PER_TOKEN, D_NOPE, ROPE_AT, SCALES_AT

LOG2E = 1.4426950408889634
BLOCK_H, BLOCK_K = 16, 16  # 32 keys a tile spill 24 B on sm_100a (Triton 3.9)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter's bf16 dot is wrong: fp32 operands (bf16 values, so the same products)
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _dequant_tile(KN, KR, KS, rows, valid, stride_row, cols, D_NOPE: tl.constexpr, ROPE_AT: tl.constexpr,
                  SCALES_AT: tl.constexpr):
    """``[BLOCK_K, 512]`` fp32 rows: columns < 448 from e4m3 x 2^(byte - 127), the rest from the bf16 RoPE part."""
    base = rows[:, None] * stride_row
    nope = valid[:, None] & (cols < D_NOPE)[None, :]
    x = tl.load(KN + base + cols[None, :], mask=nope, other=0.0).to(tl.float32)
    e = tl.load(KS + base + SCALES_AT + cols[None, :] // 64, mask=nope, other=127).to(tl.int32)
    x = x * (e << 23).to(tl.float32, bitcast=True)
    rope = valid[:, None] & (cols >= D_NOPE)[None, :]
    r = tl.load(KR + (base + ROPE_AT) // 2 + (cols[None, :] - D_NOPE), mask=rope, other=0.0).to(tl.float32)
    return tl.where((cols < D_NOPE)[None, :], x, r)


@triton.jit
def _v4_decode_kernel(Q, KN, KR, KS, IDX, SINK, OUT, LSE, s_kv, h_q, topk, qk_scale_log2,
                      stride_qt, stride_qh, stride_row, stride_it, stride_ot, stride_oh, stride_lt,
                      D_NOPE: tl.constexpr, ROPE_AT: tl.constexpr, SCALES_AT: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, 512)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q = _load_heads(Q, t, heads, h_q, stride_qt, stride_qh, cols, 512, False)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        rows, valid = _load_indices(IDX, t, stride_it, k0, topk, s_kv, BLOCK_K)
        kv = _dequant_tile(KN, KR, KS, rows, valid, stride_row, cols, D_NOPE, ROPE_AT, SCALES_AT).to(q.dtype)
        s = tl.where(valid[None, :], _dot(q, tl.trans(kv), UPCAST) * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(cast_out(p, kv.dtype, UPCAST), kv, UPCAST)
        m_i = m_new
    sink = tl.load(SINK + heads, mask=heads < h_q, other=0.0).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_all)
    l_i = l_i * alpha + tl.exp2(sink - m_all)
    h_ok = heads < h_q
    o = acc * alpha[:, None] / l_i[:, None]
    out = cast_out(o, OUT.dtype.element_ty, UPCAST)
    tl.store(OUT + t * stride_ot + heads[:, None] * stride_oh + cols[None, :], out, mask=h_ok[:, None])
    tl.store(LSE + t * stride_lt + heads, m_all + tl.log2(l_i), mask=h_ok)


def sparse_sink_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of ``flash_mla.sparse_sink_decode``: ``(out [s_q, h_q, 512], lse [s_q, h_q] base 2)``."""
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise registry.Unsupported(f"q must be bfloat16 or float32, got {q.dtype}")
    s_q, h_q, _ = q.shape
    cache = k_cache.reshape(-1, BYTES_PER_TOKEN)
    if not cache.is_contiguous():
        raise registry.Unsupported("the cache's rows must be contiguous")
    q, indices, sink = q.contiguous(), indices.contiguous(), sink.contiguous()
    out = registry.empty(s_q, h_q, 512, dtype=q.dtype, device=q.device)
    lse = registry.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q:
        grid = (s_q, triton.cdiv(h_q, BLOCK_H))
        registry.wrap_triton(_v4_decode_kernel)[grid](
            q, cache.view(torch.float8_e4m3fn), cache.view(torch.bfloat16), cache, indices, sink, out, lse,
            cache.shape[0], h_q, indices.shape[1], float(sm_scale) * LOG2E, q.stride(0), q.stride(1), cache.stride(0),
            indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), D_NOPE=D_NOPE, ROPE_AT=ROPE_AT,
            SCALES_AT=SCALES_AT, UPCAST=interpreted(), BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, num_warps=8)
    return out, lse
