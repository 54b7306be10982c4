"""flash_mla decode: FlashMLA's own numerics checks on the Triton kernel (interpreter) and the reference.

Cases follow FlashMLA's tests: cache slots a sequence does not own are NaN (0xFF bytes in FP8 caches),
pages sit in a random order, lengths vary within a batch and include 0 (out 0, lse +inf), causal
s_q=2 uses the bottom-right mask, long sequences are split across several chunks and combined.
"""

import math

import pytest
import torch

import flash_mla
from accel import registry
from flash_mla.decode import compare_decode, flash_mla_with_kvcache_reference, make_paged_case
from flash_mla.fp8_cache import dequantize_kv_fp8, quantize_kv_fp8, split_fp8_cache
from flash_mla.metadata import BLOCK_SIZE
from verifier.verify import calc_diff


def _case(seqlens, s_q=1, h_q=16, h_kv=1, fp8=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q, cache, table, lens = make_paged_case(len(seqlens), s_q, h_q, h_kv, seqlens, fp8, g, "cpu", dtype=dtype)
    meta, splits = flash_mla.get_mla_metadata(lens, s_q * h_q // h_kv, h_kv)
    return q, cache, table, lens, meta, splits


def _float64_attention(q, cache, table, seqlens, causal, fp8):
    """Independent check of the reference: one query row at a time, visible keys sliced explicitly."""
    kv_all = (dequantize_kv_fp8(cache) if fp8 else cache).double()
    b, s_q, h_q, d = q.shape
    h_kv = kv_all.shape[2]
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i, n in enumerate(seqlens):
        kv = torch.cat([kv_all[int(blk)] for blk in table[i, : -(-n // BLOCK_SIZE)]])[:n] if n else None
        for t in range(s_q):
            visible = max(0, n - s_q + t + 1) if causal else n
            for h in range(h_q):
                if visible == 0:
                    continue
                keys = kv[:visible, h // (h_q // h_kv)]
                scores = keys @ q[i, t, h].double() * d ** -0.5
                lse[i, h, t] = torch.logsumexp(scores, 0)
                out[i, t, h] = torch.softmax(scores, 0) @ keys[:, :512]
    return out, lse


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_reference_matches_float64_per_row(fp8):
    seqlens = [70, 0, 1, 130]
    q, cache, table, lens, meta, splits = _case(seqlens, s_q=2, h_q=4, fp8=fp8, seed=3)
    out, lse = flash_mla_with_kvcache_reference(q, cache, table, lens, 512, meta, splits, causal=True,
                                                is_fp8_kvcache=fp8)
    ref_out, ref_lse = _float64_attention(q, cache, table, seqlens, causal=True, fp8=fp8)
    # out is bf16 (rounding: cos diff ~1e-6); lse is fp32 (relative ~1e-7)
    assert calc_diff(out.double(), ref_out) < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)  # lse of 1 key can be ~0
    assert torch.all(out[1] == 0) and torch.all(torch.isinf(lse[1]))  # empty sequence
    assert torch.all(torch.isinf(lse[2, :, 0])) and torch.all(out[2, 0] == 0)  # seqlen 1 < s_q: row 0 sees nothing


# (seqlens, s_q, h_q, h_kv, fp8 (True / False / "fp32": an fp32 q and cache), causal): zero-length and
# multi-split sequences, MTP (s_q=2) causal, grouped KV heads, FP8 cache, a sequence shorter than s_q.
CASES = [
    ([0, 300, 45], 1, 16, 1, False, False),
    ([70, 3], 2, 4, 1, "fp32", True),  # fp32 models (beyond FlashMLA, which takes bf16/fp16 only)
    ([129, 77], 2, 8, 1, False, True),
    ([1, 190], 2, 4, 2, False, True),
    ([200, 64, 0], 1, 16, 1, True, False),
    ([150, 5], 2, 8, 1, True, True),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seqlens,s_q,h_q,h_kv,fp8,causal", CASES)
def test_triton_decode_matches_reference(seqlens, s_q, h_q, h_kv, fp8, causal):
    dtype = torch.float32 if fp8 == "fp32" else torch.bfloat16
    fp8 = fp8 is True
    q, cache, table, lens, meta, splits = _case(seqlens, s_q, h_q, h_kv, fp8, seed=len(seqlens) + s_q, dtype=dtype)
    with registry.force("triton"), registry.poisoned_outputs():
        got = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, splits, causal=causal,
                                               is_fp8_kvcache=fp8)
    assert registry.get("flash_mla.flash_mla_with_kvcache").last_impl == "triton"
    want = flash_mla_with_kvcache_reference(q, cache, table, lens, 512, meta, splits, causal=causal,
                                            is_fp8_kvcache=fp8)
    # FlashMLA's pass marks: out cosine diff < 1e-5, lse relative < 1e-5, Inf/NaN in the same places
    for name, (err, tol) in compare_decode(got, want).items():
        assert err < tol, f"{name}: {err} >= {tol}"
    assert got[0].dtype == q.dtype and got[1].dtype == torch.float32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [(16, 64, 1, 1), (64, 16, 1, 1)], ids=["page-per-step", "64-rows"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_triton_decode_other_tilings(monkeypatch, fp8, config):
    """The interpreter's default config walks pages in 32-token tiles with 16-row tiles; run one whole
    64-token page per step (BLOCK_N = PAGE), and the GPU's FlashMLA-shaped 64-row tile with 16-token steps
    (here 16 rows of 64 are real, the rest masked)."""
    from flash_mla.kernels import decode as kernels

    monkeypatch.setattr(kernels, "_INTERP_DECODE_CONFIG", [config])
    monkeypatch.setattr(kernels, "_decode", None)  # rebuild the autotuned kernel with that config
    q, cache, table, lens, meta, splits = _case([100, 0, 260], s_q=2, h_q=8, fp8=fp8, seed=11)
    with registry.force("triton"), registry.poisoned_outputs():
        got = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, splits, causal=True,
                                               is_fp8_kvcache=fp8)
    want = flash_mla_with_kvcache_reference(q, cache, table, lens, 512, meta, splits, causal=True,
                                            is_fp8_kvcache=fp8)
    for name, (err, tol) in compare_decode(got, want).items():  # FlashMLA's pass marks, as above
        assert err < tol, f"{name}: {err} >= {tol}"


def test_split_plan_covers_each_sequence_once():
    lens = torch.tensor([0, 1000, 64, 65], dtype=torch.int32)
    meta, splits = flash_mla.get_mla_metadata(lens, 16, 1)
    assert splits.tolist()[0] == 0 and splits.shape == (5,)
    per_seq = torch.diff(splits).tolist()
    assert per_seq[0] == 0 and per_seq[1] > 1  # empty sequence: no chunk; the long one is split
    for b, n in enumerate(lens.tolist()):
        rows = meta[meta[:, 0] == b].tolist()
        ranges = sorted((r[1], r[2]) for r in rows)
        assert sum(e - s for s, e in ranges) == -(-n // BLOCK_SIZE)
        assert all(a[1] == b_[0] for a, b_ in zip(ranges, ranges[1:]))  # contiguous, no overlap
        assert sorted(r[3] for r in rows) == list(range(splits[b], splits[b + 1]))
    # the plan's size depends on the batch only (so a captured device graph can take a new plan in place)
    other, _ = flash_mla.get_mla_metadata(torch.tensor([5000, 0, 1, 9], dtype=torch.int32), 16, 1)
    assert other.shape == meta.shape


def test_fp8_cache_layout_and_error():
    kv = torch.randn(3, BLOCK_SIZE, 1, 576) * torch.logspace(-3, 2, 576)  # tiles of very different ranges
    kv[0, 0, 0, :128] = 0  # an all-zero tile must not produce NaN
    cache = quantize_kv_fp8(kv.bfloat16())
    assert cache.shape == (3, BLOCK_SIZE, 1, 656) and cache.dtype == torch.float8_e4m3fn
    values, scales, rope = split_fp8_cache(cache)
    amax = kv[..., :512].bfloat16().float().reshape(3, BLOCK_SIZE, 1, 4, 128).abs().amax(-1)
    assert torch.allclose(scales[amax > 0], amax[amax > 0] / 448)
    assert torch.equal(rope, kv[..., 512:].bfloat16())  # RoPE part stays bf16, bit for bit
    back = dequantize_kv_fp8(cache).float()
    x = kv.bfloat16().float()
    tile_scale = scales.repeat_interleave(128, -1)
    # e4m3 rounding: half an ulp is 2^-4 relative for normals, 2^-10 x scale for subnormals; plus the bf16 rounding
    bound = x[..., :512].abs() * (2 ** -4 + 2 ** -8) + tile_scale * 2 ** -10 * 1.01
    assert torch.all((back[..., :512] - x[..., :512]).abs() <= bound)
    assert torch.all(back[0, 0, 0, :128] == 0)


def test_triton_decode_refuses_misaligned_rope_rows():
    """The kernel declares the RoPE rows 16-byte aligned; a cache view whose rows are not must go elsewhere."""
    from flash_mla.kernels.decode import flash_mla_decode_triton

    q, cache, table, lens, meta, splits = _case([70], h_q=4, seed=2)
    wide = torch.zeros(*cache.shape[:-1], 580, dtype=cache.dtype)  # rows of 1160 bytes: not 16-byte multiples
    wide[..., :576] = cache
    with pytest.raises(registry.Unsupported, match="16 bytes"):
        flash_mla_decode_triton(q, wide[..., :576], table, lens, 512, meta, splits, None, False, False)
