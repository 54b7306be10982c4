"""Incremental DeepSeek-V4 decoding with a KV cache, in the model's dtype or FlashMLA's FP8 V4 layout.

Per layer the cache holds each token's K = V row (what the 128-token window reads) and the compressed entries
(CSA / HCA), one pool ``[b, capacity + capacity // ratio, 512]`` (or ``584`` bytes a row with ``fp8``,
``flash_mla.v4_cache``): token t's row at t, entry w's at ``capacity + w``. A step runs one token through
every block as ``Block.forward`` does (mHC collapse, attention, spread; the same for the MoE), with the
attention's index list built as ``model.attention_rows`` builds it for the last row of a sequence: the window's
rows, then HCA's every closed entry or CSA's indexer top-k (the indexer's own compressed keys are kept
unquantised). When a token closes a window the layer's compressors pool it into a new entry from the last
``2 ratio`` inputs (the only ones an entry reads). The attention reads the cache through
``flash_mla.sparse_sink_attention`` (plain rows) or ``flash_mla.sparse_sink_decode`` (FP8 rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import flash_mla
from flash_mla.v4_cache import BYTES_PER_TOKEN, D_NOPE, D_ROPE
from models.deepseek_v4.model import (
    Attention,
    Block,
    Compressor,
    Transformer,
    apply_rope,
    hc_post,
    hc_pre,
    rms_scale,
    rope_angles,
    select_topk,
)


class LayerCache:
    """One layer's rows (tokens, then compressed entries), the compressors' last inputs and the indexer's keys."""

    def __init__(self, attn: Attention, batch: int, capacity: int, fp8: bool, dtype: torch.dtype,
                 device: torch.device):
        self.capacity, self.fp8 = capacity, fp8
        entries = capacity // attn.ratio if attn.ratio else 0
        width = BYTES_PER_TOKEN if fp8 else attn.head_dim
        self.rows = torch.zeros(batch, capacity + entries, width, dtype=torch.uint8 if fp8 else dtype, device=device)
        self.tail: torch.Tensor | None = None  # the last <= 2 ratio attention inputs (compressors)
        self.index_keys: torch.Tensor | None = None  # [b, n, index_head_dim]
        self.n_entries = 0

    def write(self, row: int, kv: torch.Tensor) -> None:
        """Store ``kv [b, 512]`` at ``row``, packed when the cache is FP8."""
        self.rows[:, row] = flash_mla.quantize_kv_v4(kv) if self.fp8 else kv.to(self.rows.dtype)


def _entry(compressor: Compressor, tail: torch.Tensor, first: int, args) -> torch.Tensor:
    """The entry the window ending at the tail's last token makes: the compressor over the tail (its first
    token at position ``first``), last entry kept ``[b, d]``."""
    positions = torch.arange(first, first + tail.shape[1], device=tail.device)
    return compressor(tail, rope_angles(args, positions, True))[:, -1]


class V4Decoder:
    """Feeds a batch one token at a time; ``step(tokens [b])`` returns the next-token logits ``[b, vocab]``."""

    def __init__(self, model: Transformer, batch: int, capacity: int, fp8: bool):
        args = model.args
        if fp8 and (args.head_dim, args.rope_head_dim) != (D_NOPE + D_ROPE, D_ROPE):
            raise ValueError(f"V4Decoder: an FP8 cache (FlashMLA's V4 layout) needs head_dim {D_NOPE + D_ROPE} and "
                             f"rope_head_dim {D_ROPE}, got {args.head_dim} and {args.rope_head_dim}")
        self.model, self.pos, self.capacity = model, 0, capacity
        p = model.embed.weight
        self.caches = [LayerCache(blk.attn, batch, capacity, fp8, p.dtype, p.device) for blk in model.layers]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pos >= self.capacity:
            raise ValueError(f"V4Decoder: the cache holds {self.capacity} tokens; all are used")
        args, t = self.model.args, self.pos
        tok = tokens.view(-1, 1)
        h = self.model.embed(tok).unsqueeze(2).repeat(1, 1, args.hc_mult, 1)
        for blk, cache in zip(self.model.layers, self.caches):
            h = self._block(blk, cache, h, tok, t)
        self.pos += 1
        return self.model.final(h)[:, -1]

    def _block(self, blk: Block, cache: LayerCache, h: torch.Tensor, tok: torch.Tensor, t: int) -> torch.Tensor:
        x, post, comb = hc_pre(h, blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base, blk.norm_eps, blk.hc_eps,
                               blk.iters)
        h = hc_post(self._attention(blk.attn, cache, blk.attn_norm(x), t), h, post, comb)
        x, post, comb = hc_pre(h, blk.hc_ffn_fn, blk.hc_ffn_scale, blk.hc_ffn_base, blk.norm_eps, blk.hc_eps,
                               blk.iters)
        return hc_post(blk.ffn(blk.ffn_norm(x), tok), h, post, comb)

    def _attention(self, attn: Attention, cache: LayerCache, x: torch.Tensor, t: int) -> torch.Tensor:
        """``x [b, 1, dim]`` at position ``t``: the new row (and entry) cached, then attention over the list."""
        args = self.model.args
        b = x.shape[0]
        angles = rope_angles(args, torch.tensor([t], device=x.device), attn.ratio > 0)
        qr = attn.q_norm(attn.wq_a(x))
        q = apply_rope(rms_scale(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), attn.eps), angles)
        cache.write(t, apply_rope(attn.kv_norm(attn.wkv(x)), angles)[:, 0])
        rows = torch.arange(max(0, t - attn.window + 1), t + 1, device=x.device)
        if attn.compressor is not None:
            m = attn.ratio
            cache.tail = x if cache.tail is None else torch.cat([cache.tail, x], dim=1)[:, -2 * m:]
            if (t + 1) % m == 0:  # a window closed: its entry (and the indexer's key)
                first = t + 1 - cache.tail.shape[1]
                cache.write(cache.capacity + cache.n_entries, _entry(attn.compressor, cache.tail, first, args))
                if attn.indexer is not None:
                    key = _entry(attn.indexer.compressor, cache.tail, first, args)[:, None]
                    cache.index_keys = key if cache.index_keys is None else torch.cat([cache.index_keys, key], 1)
                cache.n_entries += 1
            entries = torch.arange(cache.n_entries, device=x.device).expand(b, -1)
            if attn.indexer is not None and cache.n_entries:
                entries = self._selected(attn, cache, x, qr, angles)
            rows = torch.cat([rows.expand(b, -1), entries + cache.capacity], dim=1)
        offsets = torch.arange(b, device=x.device)[:, None] * cache.rows.shape[1]
        rows = rows.expand(b, -1)
        indices = torch.where(rows >= 0, rows + offsets, -1).int()
        pool = cache.rows.flatten(0, 1)
        if cache.fp8:
            o = flash_mla.sparse_sink_decode(q[:, 0], pool, indices, attn.attn_sink, attn.softmax_scale)[0]
        else:
            o = flash_mla.sparse_sink_attention(q[:, 0], pool, indices, attn.attn_sink, attn.softmax_scale)
        o = apply_rope(o.view(b, 1, attn.n_heads, attn.head_dim), angles, inverse=True)
        wo_a = attn.wo_a.weight.view(attn.o_groups, -1, attn.wo_a.in_features)
        o = torch.einsum("bsgd,grd->bsgr", o.reshape(b, 1, attn.o_groups, -1), wo_a)
        return attn.wo_b(o.flatten(2))

    @staticmethod
    def _selected(attn: Attention, cache: LayerCache, x: torch.Tensor, qr: torch.Tensor,
                  angles: torch.Tensor) -> torch.Tensor:
        """CSA: the indexer's top-k of the closed entries ``[b, <= topk]`` (every cached entry is visible)."""
        ix = attn.indexer
        q = apply_rope(ix.wq_b(qr).unflatten(-1, (ix.n_heads, ix.head_dim)), angles)[:, 0]  # [b, h, d]
        w = ix.weights_proj(x).float()[:, 0] * ix.n_heads ** -0.5
        logits = torch.einsum("bhd,bnd->bhn", q.float(), cache.index_keys.float())
        scores = (F.relu(logits) * ix.head_dim ** -0.5 * w.unsqueeze(-1)).sum(dim=1)
        chosen = select_topk(scores, ix.topk)
        marked = chosen.to(torch.uint8).sort(dim=-1, descending=True, stable=True)
        width = min(ix.topk, scores.shape[-1])
        return torch.where(marked.values[:, :width] > 0, marked.indices[:, :width], -cache.capacity - 1)
