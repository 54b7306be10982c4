"""DeepSeek-V4 decoding over FlashMLA's V4 FP8 KV cache (flash_mla.v4_cache, flash_mla.sparse_sink_decode) and the
KV-cached generation that uses it (models.deepseek_v4.decode via generate(cache=...)).

- the 584-byte layout: bytes where FlashMLA puts them, UE8M0 scales the power of two at or above amax / 448, the
  round trip within e4m3's rounding (2^-4 relative, 2^-10 x scale below the normal range), rope bits exact;
- the decode op (reference and Triton in the interpreter) against float64 attention over the dequantised rows,
  unlisted rows NaN in every byte, and against the unquantised rows within a bound derived from the rows' error;
- generation: the plain cache's decode equals recomputing the prefix (tokens, and logits to fp32 rounding), and
  the FP8 cache's equals the plain cache's with rows rounded through the FP8 layout (the FP8 rounding and nothing
  else).
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_mla
from accel import registry
from flash_mla.sparse import random_selection
from flash_mla.v4_cache import BYTES_PER_TOKEN, dequantize_kv_v4, fp8_error_bound, quantize_kv_v4, scales_of
from models.deepseek_v4 import ModelArgs, Transformer
from models.deepseek_v4 import decode as v4_decode
from models.deepseek_v4.generate import generate
from tests.test_flash_mla_sparse_sink import _dense_float64
from verifier.verify import calc_diff


def _rows(n: int, g: torch.Generator) -> torch.Tensor:
    kv = torch.randn(n, 512, generator=g) * torch.rand(n, 1, generator=g) * 8  # magnitudes vary by row
    kv[0, :64] = 0  # an all-zero tile
    kv[1, 64:128] *= 1e-4  # a tile below e4m3's normal range at the row's scale
    return kv


def test_layout_and_round_trip():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    kv = _rows(33, g)
    cache = quantize_kv_v4(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (33, BYTES_PER_TOKEN) == (33, 584)
    scale = scales_of(cache[:, 576:583])
    amax = kv[:, :448].reshape(33, 7, 64).abs().amax(-1)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    live = amax > 0
    assert (scale[live] >= amax[live] / 448).all() and (scale[live] < 2 * amax[live] / 448).all()
    assert (cache[:, 583] == 0).all()
    assert torch.equal(cache[:, 448:576].view(torch.bfloat16), kv[:, 448:].to(torch.bfloat16))
    back = dequantize_kv_v4(cache, torch.float32)
    assert ((back - kv).abs() <= fp8_error_bound(kv)).all()
    assert torch.equal(dequantize_kv_v4(cache, torch.bfloat16).float(), back)  # exact in bf16


def _case(s_q, rows, h, topk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, 512, generator=g).to(dtype)
    kv = _rows(rows, g)
    idx = random_selection(s_q, rows, topk, g, causal=True)
    idx[s_q // 2] = -1  # a query with no valid row: out 0, lse = the sink
    cache = quantize_kv_v4(kv)
    listed = torch.zeros(rows, dtype=torch.bool)
    flat = idx.reshape(-1).long()
    listed[flat[(flat >= 0) & (flat < rows)]] = True
    cache[~listed, :448] = 0x7F  # e4m3 NaN
    cache[~listed, 448:] = 255  # bf16 NaN rope, scale byte 255 (NaN in E8M0)
    sink = torch.randn(h, generator=g) * 2
    return q, kv, cache, idx, sink, listed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("s_q,rows,h,topk,dtype", [(5, 70, 5, 40, torch.bfloat16), (3, 40, 16, 17, torch.float32),
                                                   (4, 30, 20, 33, torch.bfloat16)])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode_matches_float64_over_the_dequantised_rows(impl, s_q, rows, h, topk, dtype):
    """fp32: summation order only (calc_diff ~1e-14; 1e-10). bf16: P rounded to bf16 for the value product and
    out rounded (2 roundings of 2^-8: calc_diff <= (2 * 2^-8)^2 / 2 = 3e-5)."""
    q, kv, cache, idx, sink, listed = _case(s_q, rows, h, topk, dtype, int(torch.randint(1 << 30, ())))
    scale = 512 ** -0.5
    with registry.force(impl), registry.poisoned_outputs():
        out, lse = flash_mla.sparse_sink_decode(q, cache, idx, sink, scale)
    assert registry.get("flash_mla.sparse_sink_decode").last_impl == impl
    rows64 = torch.where(listed[:, None], dequantize_kv_v4(cache.clone().masked_fill(~listed[:, None], 0)).double(),
                         math.nan)
    want, want_lse = _dense_float64(q, rows64, idx, sink, scale)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = 1e-10 if dtype == torch.float32 else (2 * 2.0 ** -8) ** 2 / 2
    assert calc_diff(out, want) < tol, calc_diff(out, want)
    assert (lse.double() - want_lse).abs().max() < 1e-4  # fp32 base-2 lse of O(10) scores
    assert (out[s_q // 2] == 0).all() and torch.allclose(lse[s_q // 2], sink * 1.4426950408889634)

    # against the unquantised rows: |d out| <= max |d v| + (exp(2 delta) - 1) max |v|, delta = the largest score
    # error scale * sum_i |q_i| bound_i over the listed rows (first order in the rows' error, the softmax moving
    # each weight by at most a factor exp(+-2 delta))
    exact, _ = _dense_float64(q, torch.where(listed[:, None], kv.double(), math.nan), idx, sink, scale)
    bound = fp8_error_bound(kv).double()
    delta = (torch.einsum("thd,sd->ths", q.double().abs(), bound[:, :]) * scale)[..., listed].max()
    limit = bound[listed].max() + math.expm1(2 * delta) * kv[listed].abs().max() + 2.0 ** -7 * exact.abs().max()
    assert (out.double() - exact).abs().max() <= limit


def _model(head_dim: int) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs.preset("debug_v4", vocab_size=256, n_heads=2, head_dim=head_dim,
                            rope_head_dim=min(64, head_dim // 2), index_head_dim=64, index_n_heads=4)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
    return model.eval()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_cache_generation_equals_recomputing_the_prefix():
    """Greedy tokens equal; the cached decode's logits equal the whole-sequence forward's (fp32: the same math in
    other shapes, ~1e-6 relative measured; 1e-4) over 136 tokens: CSA and HCA windows close, the indexer's top-k
    (8) chooses among more entries than it keeps."""
    model = _model(32)
    prompt = torch.randint(0, 256, (2, 125))
    assert torch.equal(generate(model, prompt, 11, cache="plain"), generate(model, prompt, 11))
    tokens = torch.randint(0, 256, (2, 136))
    dec = v4_decode.V4Decoder(model, 2, 136, fp8=False)
    steps = torch.stack([dec.step(tokens[:, t]) for t in range(136)], dim=1)
    with torch.no_grad():
        full = model(tokens)
    assert ((steps - full).norm() / full.norm()).item() < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp8_cache_generation_equals_the_plain_cache_with_fp8_rounded_rows(monkeypatch):
    """The FP8 cache's decode (V4's 512-wide head in FlashMLA's layout) against the plain cache whose rows are
    rounded through the layout: the FP8 rounding is the only difference, so tokens are equal and logits agree to
    fp32 rounding (1e-5). The FP8 rounding itself moves these logits by a few percent (reported, not asserted:
    e4m3 keeps 3 mantissa bits)."""
    model = _model(512)
    prompt = torch.randint(0, 256, (2, 125))
    fp8 = generate(model, prompt, 11, cache="fp8")
    plain_write = v4_decode.LayerCache.write

    def rounded(self, row, kv):
        plain_write(self, row, dequantize_kv_v4(quantize_kv_v4(kv), kv.dtype))

    monkeypatch.setattr(v4_decode.LayerCache, "write", rounded)
    assert torch.equal(generate(model, prompt, 11, cache="plain"), fp8)
    tokens = torch.randint(0, 256, (2, 40))  # CSA's entries and top-k (generation above crossed HCA's window)
    logits = {}
    for name in ("rounded", "fp8"):
        dec = v4_decode.V4Decoder(model, 2, 40, fp8=name == "fp8")
        logits[name] = torch.stack([dec.step(tokens[:, t]) for t in range(40)], dim=1)
    assert ((logits["fp8"] - logits["rounded"]).norm() / logits["rounded"].norm()).item() < 1e-5


def test_bad_input_is_named():
    q, _, cache, idx, sink, _ = _case(2, 10, 2, 4, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="k_cache must be a uint8"):
        flash_mla.sparse_sink_decode(q, cache[:, :512], idx, sink, 0.1)
    with pytest.raises(ValueError, match="indices must be int32"):
        flash_mla.sparse_sink_decode(q, cache, idx.long(), sink, 0.1)
    with pytest.raises(ValueError, match="kv must have last dim 512"):
        quantize_kv_v4(torch.zeros(3, 576))
    with pytest.raises(ValueError, match="needs head_dim 512"):
        generate(_model(32), torch.zeros(1, 3, dtype=torch.long), 1, cache="fp8")
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(_model(32), torch.zeros(1, 3, dtype=torch.long), 1, cache="bf16")
