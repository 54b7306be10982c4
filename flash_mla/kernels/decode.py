"""Triton split-KV MLA decode over a paged cache (bf16/fp16 or FlashMLA's FP8 layout), and the combine step.

One program handles one work item of the plan (a range of 64-token pages of one sequence) for one
KV head and a tile of query rows (the ``s_q x h_q / h_kv`` heads that share the KV head, so each
page is read once per tile, not once per head), FlashMLA's shape: the whole Q tile and each K tile
sit in shared memory (the wgmma operands), scores use the 512 latent + 64 RoPE columns, and the same
latent K tile is V, at its full 512 width (no V slices, no second read). An FP8 tile is dequantised
to bf16 once and serves both products. The block-table entries of the chunk are read up front,
``PAGE_IDS`` pages per load, before the tiles that use them. A sequence planned as one chunk writes
``out``/``lse`` directly; otherwise each chunk writes an fp32 partial and its lse, and
``_combine_kernel`` merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import autotune, registry
from accel.registry import wrap_triton
from flash_mla.fp8_cache import D_NOPE, D_ROPE, split_fp8_cache
from flash_mla.kernels.common import cast_out, cuda_capability, interpreted, pipeline_stages, round_to_bf16_grid
from flash_mla.metadata import BLOCK_SIZE

LOG2E = 1.4426950408889634


@triton.jit
def _dequant_fp8(x, scale, ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """e4m3 tile [ROWS, 512] times its per-token scales [ROWS, 4] (one per 128 columns) -> bf16 values (fp32 on
    the bf16 grid under the interpreter): FlashMLA dequantises each K tile to bf16 for bf16 MMAs too."""
    x = tl.reshape(tl.reshape(x.to(tl.float32), (ROWS, 4, 128)) * scale[:, :, None], (ROWS, 512))
    return round_to_bf16_grid(x) if UPCAST else x.to(tl.bfloat16)


@triton.jit
def _decode_kernel(Q, KN, KR, KS, BT, META, OUT, LSE, OACC, LACC,
                   stride_qb, stride_qs, stride_qh,
                   stride_kn_blk, stride_kn_tok, stride_kn_h, stride_kr_blk, stride_kr_tok, stride_kr_h,
                   stride_ks_blk, stride_ks_tok, stride_ks_h, stride_bt,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                   stride_pa_slot, stride_pa_h, stride_pa_row, stride_pl_slot, stride_pl_h,
                   rows, ngroups, s_q, qk_scale_log2,
                   CAUSAL: tl.constexpr, FP8: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr,
                   PAGE: tl.constexpr, PAGE_IDS: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    item = tl.program_id(1)
    g = tl.program_id(2)
    splits = tl.load(META + item * 6 + 5)
    if splits == 0:  # padding row of the plan
        return
    b = tl.load(META + item * 6)
    first = tl.load(META + item * 6 + 1)
    end = tl.load(META + item * 6 + 2)
    seqlen = tl.load(META + item * 6 + 4)

    offs_r = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok = offs_r < rows
    tok = offs_r // ngroups
    head = g * ngroups + offs_r % ngroups
    cols = tl.arange(0, D_NOPE)
    cols_r = tl.arange(0, D_ROPE)
    q_ptr = Q + b.to(tl.int64) * stride_qb + tok * stride_qs + head * stride_qh
    q_n = tl.load(q_ptr[:, None] + cols[None, :], mask=r_ok[:, None], other=0.0)
    q_r = tl.load(q_ptr[:, None] + D_NOPE + cols_r[None, :], mask=r_ok[:, None], other=0.0)
    if UPCAST:
        q_n = q_n.to(tl.float32)
        q_r = q_r.to(tl.float32)
    last_visible = seqlen - s_q + tok  # bottom-right causal: query token i sees keys <= seqlen - s_q + i

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_NOPE], tl.float32)
    tiles_per_page: tl.constexpr = PAGE // BLOCK_N
    kn_head = KN + g * stride_kn_h
    ks_head = KS + g * stride_ks_h
    slots = tl.arange(0, PAGE_IDS)
    for p0 in range(first, end, PAGE_IDS):
        # the next PAGE_IDS page ids of the block-table row in one load, ahead of the tiles that use them
        ids = tl.load(BT + b * stride_bt + p0 + slots, mask=p0 + slots < end, other=0)
        for t in range(p0 * tiles_per_page, tl.minimum(end, p0 + PAGE_IDS) * tiles_per_page):
            page = tl.sum(tl.where(slots == t // tiles_per_page - p0, ids, 0), 0).to(tl.int64)  # ids[t's page]
            offs_t = (t % tiles_per_page) * BLOCK_N + tl.arange(0, BLOCK_N)  # token slots within the page
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)  # token positions within the sequence
            n_ok = offs_n < seqlen
            k_n = tl.load(kn_head + page * stride_kn_blk + offs_t[:, None] * stride_kn_tok + cols[None, :],
                          mask=n_ok[:, None], other=0.0)
            # RoPE rows start on 16 bytes (checked by the launcher; FP8 rows are 656 B, bf16 1152 B): vector copies
            kr_rows = tl.multiple_of(g * stride_kr_h + page * stride_kr_blk + offs_t * stride_kr_tok, 8)
            k_r = tl.load(KR + kr_rows[:, None] + cols_r[None, :],
                          mask=n_ok[:, None], other=0.0)
            if FP8:
                scale = tl.load(ks_head + page * stride_ks_blk + offs_t[:, None] * stride_ks_tok
                                + tl.arange(0, D_NOPE // 128)[None, :], mask=n_ok[:, None], other=0.0)
                k_n = _dequant_fp8(k_n, scale, BLOCK_N, UPCAST)
            if UPCAST:
                k_n = k_n.to(tl.float32)
                k_r = k_r.to(tl.float32)
            s = tl.dot(q_n, tl.trans(k_n), tl.dot(q_r, tl.trans(k_r)))
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= last_visible[:, None])
            s = tl.where(keep, s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(k_n.dtype), k_n, acc * alpha[:, None])  # V is the latent K tile, already on chip
            m_i = m_new

    live = l_i > 0
    # The store's indices are derived afresh (b and slot reloaded, rows in 64 bits) rather than kept from before
    # the loop: values live across the loop cost registers the 64 x 512 accumulator needs (spills otherwise).
    b = tl.load(META + item * 6, volatile=True).to(tl.int64)
    slot = tl.load(META + item * 6 + 3, volatile=True).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_H).to(tl.int64) + tile * BLOCK_H
    r_ok = offs_r < rows
    tok = offs_r // ngroups
    head = g * ngroups + offs_r % ngroups
    o = tl.where(live[:, None], acc / tl.where(live, l_i, 1.0)[:, None], 0.0)
    lse = (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453
    if splits == 1:
        o_ptr = OUT + b * stride_ob + tok * stride_os + head * stride_oh
        tl.store(o_ptr[:, None] + cols[None, :], cast_out(o, OUT.dtype.element_ty, UPCAST), mask=r_ok[:, None])
        tl.store(LSE + b * stride_lb + head * stride_lh + tok, tl.where(live, lse, float("inf")), mask=r_ok)
    else:
        pa = OACC + slot * stride_pa_slot + g * stride_pa_h + offs_r * stride_pa_row
        tl.store(pa[:, None] + cols[None, :], o, mask=r_ok[:, None])
        tl.store(LACC + slot * stride_pl_slot + g * stride_pl_h + offs_r, tl.where(live, lse, float("-inf")),
                 mask=r_ok)


@triton.jit
def _combine_kernel(NSPLITS, OACC, LACC, OUT, LSE,
                    stride_pa_slot, stride_pa_h, stride_pa_row, stride_pl_slot, stride_pl_h,
                    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, rows, ngroups,
                    D_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRETED: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    tile = tl.program_id(2)
    first = tl.load(NSPLITS + b).to(tl.int64)  # slot * stride may pass 2^31
    count = tl.load(NSPLITS + b + 1) - first
    if count == 1:  # the decode kernel already wrote this sequence
        return
    offs_r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    cols = tl.arange(0, D_NOPE)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(count):
        part = tl.load(LACC + (first + s) * stride_pl_slot + g * stride_pl_h + offs_r, mask=r_ok,
                       other=float("-inf"))
        m = tl.maximum(m, part)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_NOPE], tl.float32)
    for s in range(count):
        part = tl.load(LACC + (first + s) * stride_pl_slot + g * stride_pl_h + offs_r, mask=r_ok,
                       other=float("-inf"))
        w = tl.exp(part - m_use)
        total += w
        pa = OACC + (first + s) * stride_pa_slot + g * stride_pa_h + offs_r * stride_pa_row
        acc += w[:, None] * tl.load(pa[:, None] + cols[None, :], mask=r_ok[:, None] & (w > 0)[:, None], other=0.0)
    live = total > 0
    out = tl.where(live[:, None], acc / tl.where(live, total, 1.0)[:, None], 0.0)
    lse = tl.where(live, m_use + tl.log(tl.where(live, total, 1.0)), float("inf"))
    tok = offs_r // ngroups
    head = g * ngroups + offs_r % ngroups
    o_ptr = OUT + b * stride_ob + tok * stride_os + head * stride_oh
    tl.store(o_ptr[:, None] + cols[None, :], cast_out(out, OUT.dtype.element_ty, INTERPRETED), mask=r_ok[:, None])
    tl.store(LSE + b * stride_lb + head * stride_lh + tok, lse, mask=r_ok)


# (BLOCK_H, BLOCK_N, warps, stages) per architecture (``accel.autotune.for_capability``) and cache dtype: only configs
# that compile for their target without register spills (tests/test_kernel_compile.py, benchmarks/kernels_compiled.md).
# FlashMLA's shape is 64 query rows on two warp groups, each holding half of the 512-wide fp32 accumulator, Q and the
# K tile in shared memory, the K tile reused as V. On sm_90a it fits in Triton 3.6 (the H200 image's), which keeps the
# wgmma shared-memory descriptors in uniform registers; Triton 3.9 computes them per thread (the 36 K steps of Q K^T
# hold ~70 more registers across the loop) and every 64-row tile spills there, so 3.9 gets the 32/16-row tiles
# (mma.sync) that fit. On sm_100a every 64-row tile spills in both versions (the tcgen05 accumulator is rescaled
# through registers each tile; 16 warps or one stage spill too), so Blackwell gets the 32/16-row tiles as well.
_MMA_SYNC_TILES = {False: [(32, 16, 8, 3), (32, 32, 8, 3), (16, 16, 4, 2)], True: [(16, 16, 8, 3), (16, 16, 8, 2)]}
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    _HOPPER_TILES = {False: [(64, 16, 8, 3), (64, 32, 8, 2), (32, 16, 8, 3)],
                     True: [(64, 16, 8, 3), (64, 16, 8, 2), (16, 16, 8, 2)]}
else:
    _HOPPER_TILES = _MMA_SYNC_TILES
DECODE_CONFIGS = {90: _HOPPER_TILES, 100: _MMA_SYNC_TILES}
# the interpreter runs one config (tests swap in others) and reads page ids in windows of 2 pages, so that
# sub-page tiles and several windows per chunk are exercised
_INTERP_DECODE_CONFIG = [(16, 32, 1, 1)]
PAGE_IDS = 16  # block-table entries read ahead in one load (1024 tokens)
_INTERP_PAGE_IDS = 2
_decode = None  # {fp8: autotuned kernel}


def decode_configs(fp8: bool, capability: tuple[int, int] | int | None) -> list[tuple]:
    """The autotune list for a cache dtype on a CUDA capability (``(10, 0)`` or ``100``; None: Hopper's list, which
    MUSA and the CPU get too)."""
    return autotune.for_capability(DECODE_CONFIGS, capability)[fp8]


def config_kwargs(config: tuple) -> dict:
    """The meta-parameters of one ``DECODE_CONFIGS`` entry (its last two fields are warps and stages)."""
    return dict(zip(("BLOCK_H", "BLOCK_N"), config[:-2]))


def _decode_kernel_tuned(fp8: bool):
    global _decode
    if _decode is None:
        _decode = {}
    if fp8 not in _decode:
        configs = _INTERP_DECODE_CONFIG if interpreted() else decode_configs(fp8, cuda_capability())
        _decode[fp8] = triton.autotune(
            autotune.shard([triton.Config(config_kwargs(c), num_warps=c[-2], num_stages=pipeline_stages(c[-1]))
                            for c in configs]),
            key=["rows", "CAUSAL", "FP8"],
        )(_decode_kernel)
    return _decode[fp8]


def flash_mla_decode_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale,
                            causal, is_fp8_kvcache):
    """Triton path of ``flash_mla_with_kvcache`` (arguments already validated against the plan)."""
    b, s_q, h_q, d = q.shape
    if d != D_NOPE + D_ROPE or head_dim_v != D_NOPE:
        raise registry.Unsupported(f"the Triton kernel is built for head dim {D_NOPE + D_ROPE} / v {D_NOPE}, got "
                                   f"{d} / {head_dim_v}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    h_kv = k_cache.shape[2]
    ngroups = h_q // h_kv
    rows = s_q * ngroups
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if is_fp8_kvcache:
        k_nope, k_scale, k_rope = split_fp8_cache(k_cache)
    else:
        if k_cache.stride(-1) != 1:
            raise registry.Unsupported("k_cache's last dim must be contiguous")
        k_nope, k_rope, k_scale = k_cache[..., :D_NOPE], k_cache[..., D_NOPE:], k_cache
    if any(st % 8 for st in k_rope.stride()[:3]) or k_rope.data_ptr() % 16:  # the kernel's 16-byte RoPE rows
        raise registry.Unsupported(f"k_cache rows must start on 16 bytes, got strides {tuple(k_cache.stride())}")
    out = registry.empty(b, s_q, h_q, D_NOPE, dtype=q.dtype, device=q.device)
    lse = registry.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    slots = max(1, meta.shape[0])
    part_out = torch.empty(slots, h_kv, rows, D_NOPE, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(slots, h_kv, rows, dtype=torch.float32, device=q.device)
    part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    if meta.shape[0]:
        kernel = _decode_kernel_tuned(bool(is_fp8_kvcache))
        wrap_triton(kernel)[lambda m: (triton.cdiv(rows, m["BLOCK_H"]), meta.shape[0], h_kv)](
            q, k_nope, k_rope, k_scale, block_table, meta, out, lse, part_out, part_lse,
            q.stride(0), q.stride(1), q.stride(2),
            *k_nope.stride()[:3], *k_rope.stride()[:3], *k_scale.stride()[:3], block_table.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), *part_strides,
            rows, ngroups, s_q, scale * LOG2E,
            CAUSAL=bool(causal), FP8=bool(is_fp8_kvcache), D_NOPE=D_NOPE, D_ROPE=D_ROPE, PAGE=BLOCK_SIZE,
            PAGE_IDS=_INTERP_PAGE_IDS if interpreted() else PAGE_IDS, UPCAST=interpreted(),
        )
    block_r = 16 if interpreted() else 8
    wrap_triton(_combine_kernel)[(b, h_kv, triton.cdiv(rows, block_r))](
        num_splits, part_out, part_lse, out, lse, *part_strides,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), rows, ngroups,
        D_NOPE=D_NOPE, BLOCK_R=block_r, INTERPRETED=interpreted(), num_warps=4,
    )
    return out, lse


__all__ = ["flash_mla_decode_triton"]
