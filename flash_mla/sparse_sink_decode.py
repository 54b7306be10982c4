"""DeepSeek-V4 decoding over FlashMLA's V4 FP8 KV cache: ``sparse_sink_decode``, a ``torch.ops.dsv3`` op.

The attention of ``flash_mla.sparse_sink_attention`` (one 512-wide K = V head, a sink logit per head, per-query
index lists: the window's rows plus the compressed entries the layer shows the query) read from a cache in the
584-byte layout of ``flash_mla.v4_cache`` instead of bf16 rows: ``k_cache [..., 584]`` uint8 (any leading dims, a
paged pool flattened), ``indices int32 [s_q, topk]`` rows of the flattened cache (-1 or ``>= rows`` ignored).
Returns ``(out [s_q, h_q, 512] in q's dtype, lse [s_q, h_q] fp32, base 2, counting the sink)``. Inference only (no
gradient): the cache holds no trainable tensor.
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from flash_mla.sparse import poison_unselected, random_selection
from flash_mla.sparse_sink import sparse_sink_attention_reference
from flash_mla.v4_cache import BYTES_PER_TOKEN, check_cache, dequantize_kv_v4, quantize_kv_v4

OP = "flash_mla.sparse_sink_decode"


@registry.reference_for(OP)
def sparse_sink_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                                 sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache dequantised to q's dtype (exact), then ``sparse_sink_attention``'s reference."""
    kv = dequantize_kv_v4(k_cache.reshape(-1, BYTES_PER_TOKEN), q.dtype)
    return sparse_sink_attention_reference(q, kv, indices, sink, sm_scale)


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator().manual_seed(seed)
    s_q, rows, h, topk = shape["s_q"], shape["rows"], shape["h"], shape["topk"]
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    q = torch.randn(s_q, h, 512, generator=g).to(dtype)
    kv = torch.randn(rows, 512, generator=g) * torch.rand(rows, 1, generator=g) * 4  # row magnitudes vary
    if shape.get("bench"):
        idx = torch.randint(0, rows, (s_q, topk), generator=g, dtype=torch.int32)
    else:
        idx = random_selection(s_q, rows, topk, g, causal=s_q <= rows)
    cache = quantize_kv_v4(kv)
    if not shape.get("bench"):  # rows nobody lists: NaN in every part (e4m3 0x7f, bf16 rope, scale bytes 255)
        unused = torch.isnan(poison_unselected(torch.zeros(rows, 1), idx)[:, 0])
        cache[unused, :448] = 0x7F
        cache[unused, 448:] = 255
    sink = torch.randn(h, generator=g) * 2
    return Case(args=(q.to(device), cache.to(device), idx.to(device), sink.to(device), 512 ** -0.5))


def _bytes(shape: dict) -> float:
    return shape["s_q"] * (shape["topk"] * BYTES_PER_TOKEN + 2 * 2 * shape["h"] * 512)


_SHAPES = [dict(s_q=5, rows=70, h=5, topk=40), dict(s_q=3, rows=40, h=16, topk=17, dtype="float32")]
# V4-Flash decoding a batch of 64 sequences (64 heads, window 128 + top-512), Pro's 128 heads and top-1024
_BENCH = [dict(s_q=64, rows=65536, h=64, topk=640, bench=True), dict(s_q=64, rows=65536, h=128, topk=1152, bench=True)]

sparse_sink_decode_op = registry.register(
    OP, reference=sparse_sink_decode_reference, triton="flash_mla.kernels.v4_decode:sparse_sink_decode_triton",
    # the same dequantised (exact) rows; bf16: P rounded to bf16 for the second product and out rounded once
    # (calc_diff ~1e-6); fp32: summation order only
    verify=VerifySpec(make_case=_make_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-5,
                      bytes_moved=_bytes, flops=lambda s: 4.0 * s["s_q"] * s["h"] * s["topk"] * 512),
)


@registry.torch_op(sparse_sink_decode_op)
def _sparse_sink_decode_torch_op(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                                 sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_sink_decode_op(q, k_cache, indices, sink, sm_scale)


def sparse_sink_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 decode attention over the FP8 cache: ``(out [s_q, h_q, 512], lse [s_q, h_q] base 2)`` (module docstring)."""
    fn = "sparse_sink_decode"
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != 512:
        raise ValueError(f"{fn}: q must be [s_q, h_q, 512], got {tuple(getattr(q, 'shape', ()))}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{fn}: q must be bfloat16 or float32, got {q.dtype}")
    check_cache(k_cache, f"{fn}: k_cache")
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: indices must be int32 [{q.shape[0]}, topk], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if sink.dim() != 1 or sink.shape[0] != q.shape[1]:
        raise ValueError(f"{fn}: sink must have one logit per head (h_q={q.shape[1]}), got {tuple(sink.shape)}")
    for name, t in (("k_cache", k_cache), ("indices", indices), ("sink", sink)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} must be on q's device {q.device}, got {t.device}")
    return _sparse_sink_decode_torch_op(q, k_cache.reshape(-1, BYTES_PER_TOKEN), indices, sink, float(sm_scale))
