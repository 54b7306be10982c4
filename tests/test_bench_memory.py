"""recipes.bench_memory: the recompute and FP8-caching options really drop what they say (issue 14).

Counts are exact byte sums of the storages autograd keeps, so the bounds are computed from shapes,
not tuned: ``v3`` must save at least every RMSNorm output that feeds a GEMM (attn_norm, ffn_norm,
q_norm, kv_norm, the final norm) and the MLA up-projections' q, k, v, minus the RoPE'd key it keeps
as the up-projection's input instead.
"""

from __future__ import annotations

import torch

from recipes.bench_memory import measure


def test_v3_fp8_cache_and_block_save_what_the_shapes_say():
    options = {"none": {}, "v3": {"recompute": ("v3",)}, "v3 + fp8 cache": {"recompute": ("v3",), "fp8": True},
               "block": {"recompute": ("block",)}}
    rows, info = measure("debug_tiny", batch=2, seq=24, dtype=torch.float32, options=options, with_transformers=False)
    a, n = info["args"], info["tokens"]
    kept = {r["option"]: r["KiB_per_token"] * 1024 * n for r in rows}
    assert len({round(r["loss"], 5) for r in rows}) <= 2  # fp32 options agree; fp8 differs a little
    per_layer = (2 * a.dim + a.q_lora_rank + a.kv_lora_rank + 2 * a.n_heads * a.qk_head_dim
                 + a.n_heads * (a.qk_nope_head_dim + a.v_head_dim) - a.qk_rope_head_dim)
    expected = (a.n_layers * per_layer + a.dim) * 4 * n  # fp32 bytes
    assert kept["none"] - kept["v3"] >= expected, (kept, expected)
    # FP8 caching: every FP8 GEMM input that is still kept shrinks from 4 to ~1 byte per value
    assert kept["v3 + fp8 cache"] < 0.8 * kept["v3"], kept
    # whole-block recompute keeps each block's input and the loss path's: a few dim-wide rows per token
    assert kept["block"] <= (a.n_layers + 3) * a.dim * 4 * n, kept
