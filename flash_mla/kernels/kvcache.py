"""Triton path of ``flash_mla.flash_mla_with_kvcache``: the paged decode kernel, or with ``indices`` the sparse
forward over the flattened cache."""

from __future__ import annotations

from flash_mla.kernels.decode import flash_mla_decode_triton
from flash_mla.kernels.sparse import sparse_decode_triton


def flash_mla_with_kvcache_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
    """Arguments as ``flash_mla_with_kvcache`` (already validated); ``(out, lse)``."""
    if indices is not None:
        return sparse_decode_triton(q, k_cache, head_dim_v, softmax_scale, is_fp8_kvcache, indices)
    return flash_mla_decode_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale, causal, is_fp8_kvcache)
