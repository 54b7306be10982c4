"""DeepSeek-V4's operations for the time model (``planner.costs`` calls these for a V4 ``ModelArgs``).

Per block of ``tokens`` tokens in sequences of ``seq_len`` (forward FLOPs and bytes; ``planner.costs`` splits
them into F, I and W as V3's):

- **attention**: the low-rank query (``wq_a``, ``q_norm``, ``wq_b``, the weightless per-head norm), the shared
  K = V head (``wkv``, ``kv_norm``), RoPE; the core ``4 h d`` FLOPs per (query, key) (``q.k`` and ``p.v`` over the
  512-wide head) over the keys a query reads: its sliding window (``min(t + 1, window)``), plus for HCA (ratio
  128) every closed compressed entry (``(t + 1) // 128``) and for CSA (ratio 4) the indexer's top-k of them
  (``min(topk, (t + 1) // 4)``); the grouped low-rank output (``wo_a``: ``o_groups`` blocks, then ``wo_b``).
- **compressor** (CSA, HCA): its ``wkv`` / ``wgate`` projections (two series of ``head_dim`` for CSA's overlapping
  windows, one for HCA), the gated pooling (a multiply-add per projected value), norm and RoPE of the entries.
- **indexer** (CSA): ``wq_b`` on the query residual, ``weights_proj``, its own ratio-4 compressor at
  ``index_head_dim``, and its logits ``2 H_I D_I`` FLOPs per (query, visible entry), forward only (no gradient
  flows through a selection; its own loss is V3.2's, not counted here).
- **mHC** (both sublayers): the mixing GEMM ``(2 + hc) hc x hc dim`` on the normed streams, Sinkhorn
  (``4 hc^2`` FLOPs per iteration), the collapse ``2 hc dim`` and the spread-and-mix ``2 hc dim + 2 hc^2 dim``;
  memory-bound, they move the 4 streams (the residual is ``hc_mult`` x V3's).
- **MoE** on every layer: the router GEMM (hash-routed layers look their experts up instead of a top-k), the
  routed experts of this EP rank (``tokens x top-k x imbalance`` rows), the shared expert, permutes.

``flops_per_token`` adds them up for one token at a given context (decode) or averaged over a sequence (training).
"""

from __future__ import annotations

import functools

import torch

from models.deepseek_v4 import ModelArgs as V4Args
from planner import costs  # (planner.costs calls back here: names taken at call time)

HCA, CSA = 128, 4
BF16 = 2  # bytes of a BF16 value (planner.costs.BF16)


def keys_per_query(args: V4Args, ratio: int, seq_len: int, position: int | None = None) -> tuple[float, float]:
    """(sliding-window keys, compressed entries) one query reads, at ``position`` or averaged over the positions
    ``0..seq_len-1`` of a sequence; the entries are every closed one for HCA, the indexer's top-k of them for CSA."""
    return _keys(args.window_size, ratio, args.index_topk if ratio == CSA else None, seq_len, position)


@functools.lru_cache(maxsize=256)
def _keys(window: int, ratio: int, topk: int | None, seq_len: int, position: int | None) -> tuple[float, float]:
    t = (torch.arange(seq_len, dtype=torch.float64) if position is None
         else torch.tensor([float(position)], dtype=torch.float64))
    near = torch.clamp(t + 1, max=window).mean().item()
    if not ratio:
        return near, 0.0
    closed = torch.div(t + 1, ratio, rounding_mode="floor")
    return near, (closed if topk is None else torch.clamp(closed, max=topk)).mean().item()


def visible_entries(ratio: int, seq_len: int, position: int | None = None) -> float:
    """Closed compressed entries a query at ``position`` can see (averaged over a sequence without it)."""
    return _keys(1, ratio, None, seq_len, position)[1]


def mhc_ops(args: V4Args, tokens: int, name: str) -> list[costs.Op]:
    """One mHC unit around a sublayer: the mixing GEMM on the normed streams, Sinkhorn, collapse; then the spread
    of the sublayer's output and the mix of the old streams (``hc_post``)."""
    hc, d, t = args.hc_mult, args.dim, tokens
    mix = (2 + hc) * hc
    return [costs.memory_op(f"hc_{name}_norm", 2 * t * hc * d * BF16),
            costs.gemm(f"hc_{name}_fn", t, mix, hc * d),
            costs.Op(f"hc_{name}_sinkhorn", "memory", 4.0 * t * hc * hc * args.hc_sinkhorn_iters, 2 * t * mix * 4),
            costs.Op(f"hc_{name}_pre", "memory", 2.0 * t * hc * d, t * (hc + 1) * d * BF16),
            costs.Op(f"hc_{name}_post", "memory", 2.0 * t * (hc * d + hc * hc * d), t * (2 * hc + 1) * d * BF16)]


def compressor_ops(args: V4Args, tokens: int, ratio: int, width: int, name: str) -> list[costs.Op]:
    """A compressor: ``wkv`` and ``wgate`` (two series for CSA's overlapping windows), the gated pool, the norm
    and RoPE of its ``tokens / ratio`` entries."""
    coff = 2 if ratio == CSA else 1
    t, entries = tokens, tokens / ratio
    return [costs.gemm(f"{name}_wkv_wgate", t, 2 * coff * width, args.dim),
            costs.Op(f"{name}_pool", "memory", 2.0 * t * coff * width, 2 * t * coff * width * BF16 * 2),
            costs.memory_op(f"{name}_norm_rope", 4 * entries * width * BF16)]


def attention_ops(args: V4Args, layer_id: int, tokens: int, seq_len: int, fp8: bool) -> list[costs.Op]:
    """The attention sublayer of ``layer_id`` (mHC included) for ``tokens`` tokens of sequences of ``seq_len``."""
    d, h, hd, t = args.dim, args.n_heads, args.head_dim, tokens
    ratio = args.compress_ratios[layer_id]
    ops = mhc_ops(args, t, "attn") + [
        costs.memory_op("attn_norm", 2 * t * d * BF16, "norm"),
        costs.gemm("wq_a", t, args.q_lora_rank, d, fp8),
        costs.memory_op("q_norm", 2 * t * args.q_lora_rank * BF16, "norm"),
        costs.gemm("wq_b", t, h * hd, args.q_lora_rank, fp8),
        costs.memory_op("q_head_norm", 2 * t * h * hd * BF16),
        costs.gemm("wkv", t, hd, d, fp8),
        costs.memory_op("kv_norm", 2 * t * hd * BF16, "norm"),
        costs.memory_op("rope", 2 * t * (2 * h + 1) * args.rope_head_dim * BF16)]  # q, kv, the output's inverse
    if ratio:
        ops += compressor_ops(args, t, ratio, hd, "compressor")
    if ratio == CSA:
        hi, di = args.index_n_heads, args.index_head_dim
        ops += [costs.gemm("index_wq_b", t, hi * di, args.q_lora_rank, fp8), costs.gemm("index_weights", t, hi, d)]
        ops += compressor_ops(args, t, CSA, di, "index_compressor")
        visible = visible_entries(CSA, seq_len)
        ops.append(costs.Op("index_logits", "indexer", 2.0 * t * visible * hi * di,
                            t * (hi * di + visible * di) * BF16, f"{seq_len}x{hi}x{di}"))
    window, entries = keys_per_query(args, ratio, seq_len)
    keys = window + entries
    ops.append(costs.Op("attention", "attention", 4.0 * t * keys * h * hd, t * (2 * h + keys) * hd * BF16,
                  f"{seq_len}x{h}x{hd}"))
    g = args.o_groups
    ops += [costs.gemm("wo_a", t * g, args.o_lora_rank, h * hd // g, fp8, groups=g),
            costs.gemm("wo_b", t, d, g * args.o_lora_rank, fp8)]
    return ops


def ffn_ops(args: V4Args, layer_id: int, tokens: int, ep: int, fp8: bool, imbalance: float) -> list[costs.Op]:
    """The MoE sublayer of ``layer_id`` (mHC included): router (a table lookup instead of the top-k on the first
    ``n_hash_layers``), this EP rank's routed experts, the shared expert. Op names as V3's (``planner.costs``'s
    phases around the all-to-all go by them)."""
    d, t = args.dim, tokens
    e, k, i = args.n_routed_experts, args.n_activated_experts, args.moe_inter_dim
    rows = t * k * imbalance
    groups = max(1, e // ep)
    select = (costs.memory_op("hash_lookup", t * k * 8) if layer_id < args.n_hash_layers
              else costs.memory_op("topk", 3 * t * e * 4))
    ops = mhc_ops(args, t, "ffn") + [
        costs.memory_op("ffn_norm", 2 * t * d * BF16, "norm"), costs.gemm("router", t, e, d), select,
        costs.memory_op("permute", 2 * rows * d * BF16, kind="permute"),
        costs.gemm("experts_w13", rows, 2 * i, d, fp8, groups),
        costs.memory_op("experts_swiglu", 3 * rows * i * BF16, "swiglu"),
        costs.gemm("experts_w2", rows, d, i, fp8, groups),
        costs.memory_op("unpermute", 2 * rows * d * BF16, kind="permute")]
    if args.n_shared_experts:
        s = args.n_shared_experts * i
        ops += [costs.gemm("shared_w13", t, 2 * s, d, fp8),
                costs.memory_op("shared_swiglu", 3 * t * s * BF16, "swiglu"), costs.gemm("shared_w2", t, d, s, fp8)]
    return ops


def block_ops(args: V4Args, layer_id: int, tokens: int, seq_len: int, ep: int, fp8: bool,
              imbalance: float = 1.0) -> list[costs.Op]:
    """Every op of block ``layer_id`` (an MTP depth's block is layer ``n_layers + k``)."""
    return attention_ops(args, layer_id, tokens, seq_len, fp8) + ffn_ops(args, layer_id, tokens, ep, fp8, imbalance)


def head_ops(args: V4Args, tokens: int) -> list[costs.Op]:
    """``hc_head`` (collapse the streams: its mixing GEMM, sigmoid weights, weighted sum), the final norm, the output
    head and cross-entropy."""
    hc, d, v, t = args.hc_mult, args.dim, args.vocab_size, tokens
    return [costs.memory_op("hc_head_norm", 2 * t * hc * d * BF16), costs.gemm("hc_head_fn", t, hc, hc * d),
            costs.Op("hc_head_pre", "memory", 2.0 * t * hc * d, t * (hc + 1) * d * BF16),
            costs.memory_op("final_norm", 2 * t * d * BF16), costs.gemm("head", t, v, d),
            costs.memory_op("cross_entropy", t * v * (BF16 + 2 * 4), kind="cross_entropy")]


def mtp_extra_ops(args: V4Args, tokens: int) -> list[costs.Op]:
    """One MTP depth besides its block and its head: ``enorm`` / ``hnorm``, the embedding, ``e_proj`` on the next
    token's embedding and ``h_proj`` on each of the ``hc_mult`` streams."""
    d, hc, t = args.dim, args.hc_mult, tokens
    return [costs.memory_op("mtp_norms", 2 * t * (1 + hc) * d * BF16),
            costs.memory_op("mtp_embed", 2 * t * d * BF16), costs.gemm("e_proj", t, d, d),
            costs.gemm("h_proj", t * hc, d, d)]


def flops_per_token(args: V4Args, seq_len: int, position: int | None = None, mtp: bool = False) -> float:
    """Forward FLOPs of one token: at ``position`` of a context (decode: attention over what that query reads),
    or averaged over the positions of a sequence of ``seq_len`` (``position`` None); the MTP depths with ``mtp``."""
    layers = list(range(args.n_layers)) + ([args.n_layers + k for k in range(args.n_mtp_layers)] if mtp else [])
    total = sum(op.flops for op in head_ops(args, 1))
    if mtp:
        total += args.n_mtp_layers * sum(op.flops for op in mtp_extra_ops(args, 1) + head_ops(args, 1))
    for i in layers:
        if position is None:
            ops = block_ops(args, i, 1, seq_len, 1, False)
        else:  # one query at ``position``: its own keys, and the indexer over what it sees there
            ops = [op for op in block_ops(args, i, 1, position + 1, 1, False)
                   if op.name not in ("attention", "index_logits")]
            ratio = args.compress_ratios[i]
            window, entries = keys_per_query(args, ratio, seq_len, position)
            total += 4.0 * (window + entries) * args.n_heads * args.head_dim
            if ratio == CSA:
                total += 2.0 * visible_entries(CSA, seq_len, position) * args.index_n_heads * args.index_head_dim
        total += sum(op.flops for op in ops)
    return total
