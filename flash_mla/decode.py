"""``flash_mla_with_kvcache``: MLA decoding on a paged KV cache (FlashMLA's API), reference and dispatch.

Absorbed MLA decoding attends every query head to one cached 576-wide vector per token (512
latent + 64 RoPE) per KV head; V is the first ``head_dim_v`` columns of the same cache row. The
cache is paged in blocks of 64 tokens addressed through ``block_table``.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from flash_mla.compare import compare_decode
from flash_mla.fp8_cache import BYTES_PER_TOKEN, D_NOPE, D_ROPE, dequantize_kv_fp8, quantize_kv_fp8
from flash_mla.metadata import BLOCK_SIZE, check_metadata, get_mla_metadata
from flash_mla.sparse import LOG2E, sparse_attention_math

OP_NAME = "flash_mla.flash_mla_with_kvcache"
HEAD_DIM = D_NOPE + D_ROPE  # 576


def _check_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                causal, is_fp8_kvcache, indices) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [batch, s_q, h_q, head_dim], got shape {tuple(getattr(q, 'shape', ()))}")
    b, s_q, h_q, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # fp32: beyond FlashMLA, for fp32 models
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, {BLOCK_SIZE}, h_kv, head_dim], got {tuple(k_cache.shape)}")
    if k_cache.shape[1] != BLOCK_SIZE:
        raise ValueError(f"k_cache block size must be {BLOCK_SIZE}, got {k_cache.shape[1]}")
    h_kv = k_cache.shape[2]
    if is_fp8_kvcache:
        if q.dtype != torch.bfloat16:
            raise ValueError(f"q must be bfloat16 with an FP8 KV cache, got {q.dtype}")
        if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8) or k_cache.shape[-1] != BYTES_PER_TOKEN:
            raise ValueError(f"an FP8 k_cache must be float8_e4m3fn/uint8 with last dim {BYTES_PER_TOKEN}, got "
                             f"{k_cache.dtype} {k_cache.shape[-1]}")
        if d != HEAD_DIM or head_dim_v != D_NOPE:
            raise ValueError(f"with an FP8 KV cache q's head dim must be {HEAD_DIM} and head_dim_v {D_NOPE}, got "
                             f"{d} and {head_dim_v}")
    else:
        if k_cache.dtype != q.dtype:
            raise ValueError(f"k_cache must have q's dtype {q.dtype}, got {k_cache.dtype} (FP8 caches need "
                             "is_fp8_kvcache=True)")
        if k_cache.shape[-1] != d:
            raise ValueError(f"k_cache head dim must equal q's head dim {d}, got {k_cache.shape[-1]}")
        if not 0 < head_dim_v <= d:
            raise ValueError(f"head_dim_v must be in [1, {d}], got {head_dim_v}")
    if h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of the cache's h_kv={h_kv}")
    if indices is not None:
        _check_sparse(indices, q, h_kv, causal)
        return
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be int32 [{b}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must be int32 [{b}], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    for name, t in (("k_cache", k_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                    ("tile_scheduler_metadata", tile_scheduler_metadata), ("num_splits", num_splits)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    check_metadata(tile_scheduler_metadata, num_splits, cache_seqlens, block_table, k_cache.shape[0])


def _check_sparse(indices, q: torch.Tensor, h_kv: int, causal: bool) -> None:
    b, s_q = q.shape[:2]
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 3 \
            or tuple(indices.shape[:2]) != (b, s_q):
        raise ValueError(f"indices must be int32 [{b}, {s_q}, topk], got {getattr(indices, 'dtype', None)} "
                         f"{tuple(getattr(indices, 'shape', ()))}")
    if indices.device != q.device:
        raise ValueError(f"indices must be on q's device {q.device}, got {indices.device}")
    if h_kv != 1:
        raise ValueError(f"sparse decoding (indices given) needs a cache with h_kv = 1, got {h_kv}")
    if causal:
        raise ValueError("causal must be False with indices: the indices already say which tokens each query sees")


def sparse_decode_reference(q, k_cache, head_dim_v, softmax_scale, is_fp8_kvcache, indices):
    """Sparse decoding as sparse prefill over the flattened cache: ``indices [b, s_q, topk]`` are cache slots
    ``page * 64 + offset`` (FlashMLA's format); -1 or past the cache is ignored. lse natural, +inf if empty."""
    b, s_q, h_q, d = q.shape
    cache = dequantize_kv_fp8(k_cache) if is_fp8_kvcache else k_cache
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out, _, lse2 = sparse_attention_math(q.reshape(b * s_q, h_q, d), cache.reshape(-1, d),
                                         indices.reshape(b * s_q, -1), scale, head_dim_v)
    lse = (lse2 / LOG2E).view(b, s_q, h_q).transpose(1, 2)
    return out.view(b, s_q, h_q, head_dim_v).to(q.dtype), lse


@registry.reference_for(OP_NAME)
def flash_mla_with_kvcache_reference(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                     num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                                     indices=None):
    """Per sequence in fp32: gather its pages, softmax(q k^T * scale) v; bottom-right causal mask.

    Zero-length sequences and fully masked rows give out 0 and lse +inf (FlashMLA's convention).
    An FP8 cache is dequantised to bf16 first, exactly as the kernel sees it.
    """
    if indices is not None:
        return sparse_decode_reference(q, k_cache, head_dim_v, softmax_scale, is_fp8_kvcache, indices)
    b, s_q, h_q, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    cache = dequantize_kv_fp8(k_cache) if is_fp8_kvcache else k_cache
    h_kv = cache.shape[2]
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    for i, n in enumerate(cache_seqlens.tolist()):
        if n == 0:
            continue
        pages = block_table[i, : -(-n // BLOCK_SIZE)].long()
        kv = cache[pages].reshape(-1, h_kv, d)[:n].float().repeat_interleave(h_q // h_kv, dim=1)  # [n, h_q, d]
        scores = torch.einsum("shd,nhd->hsn", q[i].float(), kv) * scale
        if causal:
            last_visible = n - s_q + torch.arange(s_q, device=q.device)
            allowed = torch.arange(n, device=q.device)[None, :] <= last_visible[:, None]
            scores = scores.masked_fill(~allowed, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [h_q, s_q]
        live = torch.isfinite(row_lse)
        probs = torch.where(live[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        out[i] = torch.einsum("hsn,nhd->shd", probs, kv[..., :head_dim_v])
        lse[i] = torch.where(live, row_lse, math.inf)
    return out.to(q.dtype), lse


def make_paged_case(b: int, s_q: int, h_q: int, h_kv: int, seqlens: list[int], fp8: bool, generator: torch.Generator,
                    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, extra_blocks: int = 1):
    """Fresh random decode inputs in FlashMLA's test style: pages in a random order, every cache slot a
    sequence does not own NaN-poisoned (bytes 0xFF in an FP8 cache), a spare column in the block table.

    Returns (q, k_cache, block_table, cache_seqlens).
    """
    blocks = [-(-n // BLOCK_SIZE) for n in seqlens]
    max_blocks = max(blocks + [1]) + extra_blocks
    num_blocks = sum(blocks) + extra_blocks
    # the large tensors are drawn on the target device (a GPU builds bench-sized caches in milliseconds)
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
    q = torch.randn(b, s_q, h_q, HEAD_DIM, generator=dev_gen, device=device).to(dtype)
    kv = torch.randn(num_blocks, BLOCK_SIZE, h_kv, HEAD_DIM, generator=dev_gen, device=device).to(dtype)
    cache = quantize_kv_fp8(kv).view(torch.uint8) if fp8 else kv
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    table = torch.full((b, max_blocks), num_blocks, dtype=torch.int32)  # ids past the cache: must never be read
    tokens_in_block = torch.zeros(num_blocks, dtype=torch.int64)
    used = 0
    for i, (n, nblk) in enumerate(zip(seqlens, blocks)):
        ids = order[used: used + nblk]
        table[i, :nblk] = ids
        tokens_in_block[ids.long()] = (n - BLOCK_SIZE * torch.arange(nblk)).clamp(max=BLOCK_SIZE)
        used += nblk
    owned = (torch.arange(BLOCK_SIZE)[None, :] < tokens_in_block[:, None]).to(device)
    cache[~owned] = 255 if fp8 else float("nan")
    if fp8:
        cache = cache.view(torch.float8_e4m3fn)
    return q, cache, table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device)


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, s_q, h_q, h_kv, s_k = shape["b"], shape["s_q"], shape["h_q"], shape.get("h_kv", 1), shape["s_k"]
    if shape.get("varlen", True):
        seqlens = [max(0, int(s_k * (0.5 + torch.rand(1, generator=g).item()))) for _ in range(b)]
        seqlens[0] = shape.get("first_len", seqlens[0])
    else:
        seqlens = [s_k] * b
    q, cache, table, lens = make_paged_case(b, s_q, h_q, h_kv, seqlens, shape.get("fp8", False), g, device)
    meta, splits = get_mla_metadata(lens, s_q * h_q // h_kv, h_kv)
    if shape.get("topk"):
        return Case(args=(q, cache, table, lens, D_NOPE, meta, splits),
                    kwargs={"is_fp8_kvcache": shape.get("fp8", False),
                            "indices": _sparse_slots(table.cpu(), seqlens, s_q, shape["topk"], g).to(device)})
    return Case(args=(q, cache, table, lens, D_NOPE, meta, splits),
                kwargs={"causal": shape.get("causal", s_q > 1), "is_fp8_kvcache": shape.get("fp8", False)})


def _sparse_slots(table: torch.Tensor, seqlens: list[int], s_q: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """int32 ``[b, s_q, topk]`` cache slots (page * 64 + offset) of random tokens each sequence owns, -1 past its
    length (so short sequences leave slots invalid)."""
    rows = []
    for i, n in enumerate(seqlens):
        pos = torch.stack([torch.randperm(max(n, 1), generator=g)[:topk] for _ in range(s_q)])
        pos = torch.nn.functional.pad(pos, (0, topk - pos.shape[1]), value=-1)
        slots = table[i].long()[pos.clamp(min=0) // BLOCK_SIZE] * BLOCK_SIZE + pos.clamp(min=0) % BLOCK_SIZE
        rows.append(torch.where((pos >= 0) & (pos < n), slots, -1))
    return torch.stack(rows).to(torch.int32)


def _decode_bytes(shape: dict) -> float:
    per_token = BYTES_PER_TOKEN if shape.get("fp8") else 2 * HEAD_DIM
    tokens_read = shape["s_q"] * shape["topk"] if shape.get("topk") else shape["s_k"] * shape.get("h_kv", 1)
    return shape["b"] * (tokens_read * per_token + shape["s_q"] * shape["h_q"] * 2 * (HEAD_DIM + D_NOPE))


def _decode_flops(shape: dict) -> float:
    keys = shape.get("topk") or shape["s_k"]  # sparse decoding attends to top-k keys per query
    return 2.0 * shape["b"] * shape["s_q"] * shape["h_q"] * keys * (HEAD_DIM + D_NOPE)


flash_mla_op = registry.register(
    OP_NAME,
    reference=flash_mla_with_kvcache_reference,
    triton="flash_mla.kernels.kvcache:flash_mla_with_kvcache_triton",
    verify=VerifySpec(
        make_case=_make_case,
        shapes=[dict(b=2, s_q=1, h_q=16, s_k=150, first_len=0), dict(b=2, s_q=2, h_q=8, s_k=100, causal=True),
                dict(b=2, s_q=1, h_q=16, s_k=130, fp8=True), dict(b=2, s_q=2, h_q=16, s_k=100, topk=40, fp8=True),
                dict(b=2, s_q=1, h_q=16, s_k=90, topk=24, first_len=10)],
        bench_shapes=[dict(b=128, s_q=1, h_q=128, s_k=8192, varlen=False), dict(b=128, s_q=2, h_q=64, s_k=4096),
                      dict(b=128, s_q=1, h_q=128, s_k=8192, fp8=True),
                      dict(b=128, s_q=1, h_q=128, s_k=8192, topk=2048, fp8=True, varlen=False)],
        compare=compare_decode,
        flops=_decode_flops,
        bytes_moved=_decode_bytes,
    ),
)


def _decode_fake(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                 softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, head_dim_v), q.new_empty(b, h_q, s_q, dtype=torch.float32)


# The torch op (docs/custom_ops.md): the reference walks each sequence's pages on the host, so it is opaque; lse is
# returned contiguous whichever implementation ran (the sparse path makes it as a transposed view).
@registry.torch_op(flash_mla_op, fake=_decode_fake, opaque=True)
def _flash_mla_with_kvcache_torch_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                                     cache_seqlens: torch.Tensor | None, head_dim_v: int,
                                     tile_scheduler_metadata: torch.Tensor | None, num_splits: torch.Tensor | None,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = flash_mla_op(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                            softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache, indices=indices)
    return out.contiguous(), lse.contiguous()


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged KV cache: ``(out [b, s_q, h_q, head_dim_v], lse fp32 [b, h_q, s_q])``.

    ``q [b, s_q, h_q, 576]`` (bf16/fp16; fp32 too, beyond FlashMLA); ``k_cache [num_blocks, 64, h_kv, 576]``
    in q's dtype, or ``[..., 656]``
    e4m3 bytes with ``is_fp8_kvcache``; ``block_table int32 [b, max_blocks]``; ``cache_seqlens int32
    [b]``; the plan from ``get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)``. ``causal`` with
    ``s_q > 1`` masks bottom-right (query i sees the first ``seqlen - s_q + i + 1`` tokens).
    ``softmax_scale`` defaults to ``head_dim ** -0.5``. lse is the natural log-sum-exp.

    Sparse decoding (DeepSeek-V3.2): ``indices int32 [b, s_q, topk]`` names the cache slots each query attends
    to, as ``page * 64 + offset`` into the whole cache (FlashMLA's format), -1 (or past the cache) for none;
    the cache needs ``h_kv = 1`` and ``causal`` must be False. ``block_table``, ``cache_seqlens`` and the plan
    are then not used (pass None or anything). A query with no valid index gets out 0 and lse +inf.
    """
    _check_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, causal,
                is_fp8_kvcache, indices)
    scale = None if softmax_scale is None else float(softmax_scale)
    if indices is not None:  # sparse decoding reads neither the table, the lengths nor the plan
        block_table = cache_seqlens = tile_scheduler_metadata = num_splits = None
    return _flash_mla_with_kvcache_torch_op(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                            tile_scheduler_metadata, num_splits, scale, causal, is_fp8_kvcache,
                                            indices)
