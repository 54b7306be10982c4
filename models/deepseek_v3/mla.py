"""Multi-head Latent Attention (MLA), in its naive (training) and absorbed (decode) forms.

Queries go through a low-rank bottleneck (``wq_a`` -> RMSNorm -> ``wq_b``; a plain ``wq`` when
``q_lora_rank`` is 0). Keys and values are compressed into one ``kv_lora_rank`` latent plus a
``qk_rope_head_dim`` RoPE key shared by every head (``wkv_a``), and expanded per head by ``wkv_b``.

* Naive form (training, prefill without a cache): expand K/V per head and run ordinary attention
  with q/k head dim 192 and v head dim 128 through ``flash_mla.mla_attention``.
* Absorbed form (decode): fold ``wkv_b``'s key half into the query and its value half into the
  output, so attention runs directly on the cached 576-wide latent ``[kv_norm(c_kv), rope(k_pe)]``
  through ``flash_mla.flash_mla_with_kvcache`` (MQA with one KV head, dv = 512).
* Sparse form (DeepSeek-V3.2, ``index_topk > 0`` outside the dense warm-up): the lightning indexer
  (``indexer.py``) picks each query's top-k causal keys and the absorbed form attends to those only,
  through ``flash_mla.sparse_mla_attention`` (training and prefill) over the batch's latents flattened
  to ``[b * s, 576]``. In training the indexer's KL loss rides on the attention output's backward
  (``balancing.attach_aux_loss``), so every pipeline schedule carries it as it carries the output.

Under context parallelism (``cp``, a ``context_parallel.ContextParallel`` the trainer hands the layer once)
the naive form's keys and values come from the whole sequence's latents, all-gathered over the CP group,
and the local queries attend them with the global causal mask (``docs/context_parallel.md``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

import flash_mla
import fused_ops
from deep_gemm import linear
from deep_gemm.linear import out_is_view
from flash_mla.attention import keeps_output
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.balancing import attach_aux_loss
from models.deepseek_v3.context_parallel import ContextParallel, Posted
from models.deepseek_v3.indexer import (
    Indexer,
    attention_target,
    causal_rows,
    causal_topk,
    dense_chunk,
    dense_indexer_kl,
    index_scores,
    indexer_kl,
    record_recall,
    select_rows,
)
from models.deepseek_v3.layers import Linear, Precast, RMSNorm
from models.deepseek_v3.rope import apply_rotary_emb


class LatentCache(Protocol):
    """What the absorbed path needs from a paged latent KV cache (``generate.LatentKVCache``)."""

    def write(self, layer_id: int, start_pos: int, latent: torch.Tensor) -> None: ...
    def attention_args(self, layer_id: int) -> dict: ...
    def slots(self, positions: torch.Tensor) -> torch.Tensor: ...
    def index_keys(self, layer_id: int, start_pos: int, keys: torch.Tensor) -> torch.Tensor: ...


class InnerAttention(nn.Module):
    """The naive form's attention core, no parameters: per-head ``q, k [b, s, h, qk_head_dim]``, ``v [b, s, h,
    v_head_dim]`` -> ``[b, s, h * v_head_dim]``, causal. A module of its own so that what reaches it is visible from
    outside: V3's up-projection recompute (``training.memory_policy``) keeps the latents instead of q, k, v."""

    def __init__(self, softmax_scale: float):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.cp: ContextParallel | None = None  # context parallelism, set once (``wire_context_parallel``)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cp is not None:  # this rank's queries over the whole sequence's keys, the global causal mask
            return self.cp.attention(q, k, v, self.softmax_scale).flatten(2)
        return flash_mla.mla_attention(q, k, v, causal=True, softmax_scale=self.softmax_scale).flatten(2)


class SparseInnerAttention(nn.Module):
    """The sparse form's attention core, no parameters: absorbed queries ``[t, h, 576]`` over the latent rows
    ``[t, 576]`` each selected (``rows [t, 1, topk]``) -> ``[t, h, kv_lora_rank]`` (``InnerAttention``'s role)."""

    def __init__(self, softmax_scale: float, d_v: int):
        super().__init__()
        self.softmax_scale, self.d_v = softmax_scale, d_v

    def forward(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return flash_mla.sparse_mla_attention(q, kv, rows, self.softmax_scale, d_v=self.d_v)


class GatheredLatent(nn.Module):
    """Under context parallelism, the landed all-gather of the 576-wide latents split into ``(c_kv, k_pe)`` of every
    position, no parameters: a module of its own so that the memory policy sees what the up-projections read (it
    keeps these instead of the per-head q, k, v)."""

    def __init__(self, kv_lora_rank: int, rope_dim: int):
        super().__init__()
        self.widths = [kv_lora_rank, rope_dim]

    def forward(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_kv, k_pe = latent.split(self.widths, dim=-1)
        return c_kv, k_pe.unsqueeze(2)


class MLA(nn.Module):
    """MLA. What backward keeps is the memory policy's, applied from outside: with V3's "mla_up" recompute
    (report 3.2.3) the up-projections (``up_project`` / ``absorb``: both norms, ``wq_b``, ``wkv_b``, RoPE) are
    remade for the attention backward from the latents, so the per-head q, k, v (``n_heads * 512`` values per
    token at V3's sizes) are never kept."""

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.dim, self.n_heads = args.dim, args.n_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        self.softmax_scale = args.softmax_scale
        # The GEMMs whose input the memory policy remakes (the norms' outputs under "norm", the up-projections'
        # inputs under "mla_up") keep no FP8 copy of it.
        input_recomputed = args.recomputes("norm", layer_id)
        up_recomputed = args.recomputes("mla_up", layer_id) or input_recomputed
        fp8, cache = args.fp8, args.fp8_cache
        if self.q_lora_rank:
            self.wq_a = Linear(self.dim, self.q_lora_rank, fp8=fp8, fp8_cache=cache and not input_recomputed)
            self.q_norm = RMSNorm(self.q_lora_rank, args.norm_eps, args.fused_ops)
            self.wq_b = Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, fp8=fp8,
                               fp8_cache=cache and not up_recomputed)
        else:
            self.wq = Linear(self.dim, self.n_heads * self.qk_head_dim, fp8=fp8,
                             fp8_cache=cache and not input_recomputed)
        self.wkv_a = Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, fp8=fp8,
                            fp8_cache=cache and not input_recomputed)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps, args.fused_ops)
        self.fused = args.fused_ops  # RoPE through fused_ops where its kernel runs
        # RoPE in place into the queries, unless they are a view made in an autograd.Function (deep_gemm's padded
        # FP8 output: N not 128n)
        self.q_is_view = out_is_view(fp8, self.n_heads * self.qk_head_dim)
        self.wkv_b = Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), fp8=fp8,
                            fp8_cache=cache and not up_recomputed)
        self.wo = Linear(self.n_heads * self.v_head_dim, self.dim, fp8=fp8, fp8_cache=cache)
        self.sparse = args.sparse
        self.fp8_index = args.indexer_qk == "fp8"  # the selection scores in FP8 (DeepGEMM's fp8_mqa_logits)
        self.indexer = Indexer(args) if args.index_topk else None
        self.inner_attention = InnerAttention(self.softmax_scale)
        self.sparse_attention = SparseInnerAttention(self.softmax_scale, self.kv_lora_rank) if self.indexer else None
        self.gathered_latent = GatheredLatent(self.kv_lora_rank, self.qk_rope_head_dim)
        self.cp: ContextParallel | None = None  # context parallelism, set once (``wire_context_parallel``)

    # ---- shared by both forms ---------------------------------------------------------------------
    def _q_latent(self, x: torch.Tensor, x_fp8: Precast | None = None) -> torch.Tensor:
        """The query latent before ``q_norm`` (``x`` itself without q LoRA)."""
        return self.wq_a(x, x_fp8) if self.q_lora_rank else x

    def _q_up(self, q_latent: torch.Tensor) -> torch.Tensor:
        """Per-head queries ``[b, s, h, qk_head_dim]`` from the latent before ``q_norm``."""
        if self.q_lora_rank:
            q = self.wq_b(self.q_norm(q_latent))
        else:
            q = self.wq(q_latent)
        return q.unflatten(-1, (self.n_heads, self.qk_head_dim))

    def _kv_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   x_fp8: Precast | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c_kv [b, s, kv_lora] before kv_norm, rope(k_pe) [b, s, 1, rope_dim])``."""
        return self.kv_parts(self.wkv_a(x, x_fp8), cos, sin)

    def kv_parts(self, kv_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_a``'s output split into ``c_kv`` (before kv_norm) and the RoPE'd shared key ``k_pe``."""
        c_kv, k_pe = kv_latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return c_kv, apply_rotary_emb(k_pe.unsqueeze(2), cos, sin, self.fused)

    # ---- naive form -------------------------------------------------------------------------------
    def up_project(self, q_latent: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-head ``q, k, v`` of the naive form from the latents (q's before ``q_norm``)."""
        q = self._q_up(q_latent)
        # the rotary dims rotated where they sit in the heads where the kernel may write q (no second copy of q)
        q = fused_ops.rotary_tail_(q, self.qk_nope_head_dim, cos, sin, fused=self.fused, in_place=not self.q_is_view)
        kv = self.wkv_b(self.kv_norm(c_kv))
        k_nope, v = kv.unflatten(-1, (self.n_heads, self.qk_nope_head_dim + self.v_head_dim)).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0, x_fp8: Precast | None = None) -> torch.Tensor:
        """x ``[b, s, dim]``; cos/sin for positions ``start_pos .. start_pos+s``. With ``cache``: absorbed form.
        ``x_fp8``: x's 1x128 cast made by its producer (the norm), read by ``wq_a`` and ``wkv_a`` instead of
        casting x twice (where their recipe takes a 1x128 cast: the GEMM decides). Without q LoRA ``wq`` runs inside the
        recomputed up-projection and casts x itself (a precast held for it would be kept until backward)."""
        if cache is not None:
            return self.forward_absorbed(x, cos, sin, cache, start_pos, x_fp8)
        c_kv, k_pe = self._kv_latent(x, cos, sin, x_fp8)
        # under CP: the 576-wide latents of the whole sequence (RoPE at each token's global position), gathered
        # while the query projection runs
        posted = self.cp.post_gather(torch.cat([c_kv, k_pe.squeeze(2)], dim=-1)) if self.cp is not None else None
        q_latent = self._q_latent(x, x_fp8)
        if posted is not None:
            c_kv, k_pe = self._landed(*posted)
        learn = self.indexer is not None and self.training and torch.is_grad_enabled()
        if self.indexer is None or not (self.sparse or learn):  # dense attention, no indexer loss to compute
            return self._output(self.inner_attention(*self.up_project(q_latent, c_kv, k_pe, cos, sin)))
        # the indexer reads the layer's input and query residual detached: only its own loss trains it
        q_i, k_i, w = self._index(x.detach(), q_latent.detach(), cos, sin)
        b, s = x.shape[:2]
        qpos = None
        if self.cp is not None:  # the indexer's keys of the whole sequence; queries at this rank's positions
            k_i, qpos = self.cp.gather(k_i), self.cp.positions(x.device, s)
        if self.sparse:
            rows = select_rows(q_i, k_i, w, self.indexer.topk, fp8=self.fp8_index, positions=qpos)
            out = self._attend_sparse(*self.absorb(q_latent, c_kv, k_pe, cos, sin), rows).unflatten(0, (b, s))
        else:
            rows = None  # the warm-up's candidates: every causal key (``dense_indexer_kl`` makes them per chunk)
            out = self.inner_attention(*self.up_project(q_latent, c_kv, k_pe, cos, sin))
        out = self._output(out)
        if learn:
            out = attach_aux_loss(out, self._indexer_loss(q_latent, c_kv, k_pe, cos, sin, q_i, k_i, w, rows, qpos))
        return out

    def _landed(self, buffer: torch.Tensor, posted: Posted) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c_kv, k_pe)`` of every position of the sequence, from the CP group's posted latent all-gather."""
        return self.gathered_latent(self.cp.landed(buffer, posted))

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """``wo(out)``; the flash kernel keeps ``out`` for its backward: wo then saves that same tensor, not an
        FP8 copy beside it."""
        cache = self.wo.fp8_cache and not keeps_output(out.device)
        return linear(out, self.wo.weight, fp8=self.wo.fp8, fp8_cache=cache, health=self.wo.health)

    # ---- sparse form (DSA) ------------------------------------------------------------------------
    def _index(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's queries ``[b, s, H, D]``, keys ``[b, s, D]`` and head weights ``[b, s, H]``."""
        q_resid = self.q_norm(q_latent).detach()  # q_norm's weight belongs to the main graph
        return self.indexer.queries(q_resid, cos, sin), self.indexer.keys(x, cos, sin), self.indexer.head_weights(x)

    def absorb(self, q_latent: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed queries ``[b * s, h, 576]`` and latents ``[b * s, 576]`` (``[kv_norm(c_kv), rope(k_pe)]``)."""
        kv = torch.cat([self.kv_norm(c_kv), k_pe.squeeze(2)], dim=-1)
        return self._absorb_queries(q_latent, cos, sin).flatten(0, 1), kv.flatten(0, 1)

    def _absorb_queries(self, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[q_nope W_uk, rope(q_pe)]``, ``[b, s, h, 576]``, from the query latent before ``q_norm``; cos/sin
        ``[s, rope/2]`` or per row ``[b, s, rope/2]``."""
        q_nope, q_pe = self._q_up(q_latent).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        w_uk, _ = self._absorbed_weights()
        return torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk.to(q_nope.dtype)),
                          apply_rotary_emb(q_pe, cos, sin, self.fused)], dim=-1)

    def _attend_sparse(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each query over its selected latent rows, then ``wkv_b``'s value half: ``[b * s, h * v_head_dim]``."""
        out = self.sparse_attention(q, kv, rows)
        _, w_uv = self._absorbed_weights()
        return torch.einsum("thc,hdc->thd", out, w_uv.to(out.dtype)).flatten(1)

    def _indexer_loss(self, q_latent: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor,
                      rows: torch.Tensor | None, qpos: torch.Tensor | None = None) -> torch.Tensor:
        """KL of the indexer to the main attention over each query's candidates: the selected ``rows`` in the
        sparse stage, every causal key in the warm-up (``rows`` None); the main attention's side is detached.
        ``qpos`` (context parallelism): the queries' global positions among the gathered keys and latents; the
        loss is then this rank's share (its queries' mean weighted by their part of the CP group's queries)."""
        s, n = q_latent.shape[1], c_kv.shape[1]
        q_i, k_i, w = q_i.flatten(0, 1), k_i.flatten(0, 1), w.flatten(0, 1)
        stats = self.indexer.stats
        if rows is not None:
            with torch.no_grad():
                p = attention_target(*self.absorb(q_latent, c_kv, k_pe, cos, sin), rows, self.softmax_scale)
            loss = indexer_kl(p, q_i, k_i, w, rows)
            stats.record("kl", loss)
            return self._share(loss, q_i.shape[0])
        with torch.no_grad():  # what the target is remade from: the query latents and the 576-wide latents
            q_latent = q_latent.detach().flatten(0, 1)
            kv = torch.cat([self.kv_norm(c_kv), k_pe.squeeze(2)], dim=-1).flatten(0, 1)

        def target(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                pos = torch.arange(start, start + count, device=kv.device) % s
                q = self._absorb_queries(q_latent[None, start:start + count], cos[pos][None], sin[pos][None])[0]
                cand = causal_rows(start, count, n, kv.device, positions=qpos)
                return attention_target(q, kv, cand, self.softmax_scale, chunk=count), cand

        # each candidate costs a gathered latent and a logit per head (main side), or D + H (indexer side)
        chunk = dense_chunk(n, max(kv.shape[-1] + self.n_heads, self.indexer.head_dim + self.indexer.n_heads))
        loss = dense_indexer_kl(target, q_i, k_i, w, chunk)
        stats.record("kl", loss)
        last = max(0, q_i.shape[0] - chunk)  # recall on the last chunk: the longest contexts
        p, cand = target(last, q_i.shape[0] - last)
        record_recall(stats, p, q_i[last:], k_i, w[last:], cand, self.indexer.topk)
        return self._share(loss, q_i.shape[0])

    def _share(self, loss: torch.Tensor, queries: int) -> torch.Tensor:
        """``loss`` (a mean over this rank's ``queries``) as its share of the CP group's mean; itself without CP."""
        if self.cp is None:
            return loss
        total = self.cp.sum(torch.tensor([float(queries)], device=loss.device))[0]
        return loss * (queries / total)

    # ---- absorbed form ----------------------------------------------------------------------------
    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_b`` split per head into the key half ``[h, nope, kv_lora]`` and value half ``[h, v, kv_lora]``."""
        w = self.wkv_b.weight.view(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward_absorbed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache,
                         start_pos: int, x_fp8: Precast | None = None) -> torch.Tensor:
        """Write this step's latents at ``start_pos`` and attend over the whole cached prefix (causal)."""
        q_latent = self._q_latent(x, x_fp8)
        c_kv, k_pe = self._kv_latent(x, cos, sin, x_fp8)
        c_kv = self.kv_norm(c_kv)
        cache.write(self.layer_id, start_pos, torch.cat([c_kv, k_pe.squeeze(2)], dim=-1))
        _, w_uv = self._absorbed_weights()
        q_abs = self._absorb_queries(q_latent, cos, sin)
        if self.indexer is not None and self.sparse:
            out = self._attend_indexed_cache(x, q_latent, q_abs, cos, sin, cache, start_pos)
            return self.wo(torch.einsum("bshc,hdc->bshd", out, w_uv.to(out.dtype)).flatten(2))
        kwargs = cache.attention_args(self.layer_id)
        if q_abs.dtype == torch.float32:  # FlashMLA's kernels take bf16/fp16 only; fp32 (CPU) models take this path
            out = _latent_attention_fp32(q_abs, kwargs["k_cache"], kwargs["block_table"], kwargs["cache_seqlens"],
                                         self.kv_lora_rank, self.softmax_scale)
        else:
            out, _ = flash_mla.flash_mla_with_kvcache(q_abs, head_dim_v=self.kv_lora_rank,
                                                      softmax_scale=self.softmax_scale, causal=True, **kwargs)
        out = torch.einsum("bshc,hdc->bshd", out, w_uv.to(out.dtype))
        return self.wo(out.flatten(2))

    def _attend_indexed_cache(self, x: torch.Tensor, q_latent: torch.Tensor, q_abs: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, cache: LatentCache, start_pos: int) -> torch.Tensor:
        """Sparse decoding of this step's absorbed queries ``[b, s, h, 576]``: the indexer's keys join the cache's
        indexer key cache, each query takes its top-k cached positions, and FlashMLA's sparse decoding
        (``flash_mla_with_kvcache(..., indices=...)``) attends to those slots of the paged latent cache.
        Returns ``[b, s, h, 512]``."""
        q_i, k_i, w = self._index(x, q_latent, cos, sin)
        keys = cache.index_keys(self.layer_id, start_pos, k_i)
        slots = cache.slots(causal_topk(index_scores(q_i, keys, w), self.indexer.topk, start_pos))
        out, _ = flash_mla.flash_mla_with_kvcache(q_abs, head_dim_v=self.kv_lora_rank, softmax_scale=self.softmax_scale,
                                                  indices=slots, **cache.attention_args(self.layer_id))
        return out


def _latent_attention_fp32(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: float) -> torch.Tensor:
    """Absorbed MLA attention in fp32 for a batch whose sequences all hold ``cache_seqlens[0]`` tokens:
    q ``[b, s, h, 576]`` against the paged latents, bottom-right causal -> ``[b, s, h, head_dim_v]``."""
    b, s = q.shape[:2]
    n = int(cache_seqlens[0])
    block = k_cache.shape[1]
    kv = k_cache[block_table[:, : -(-n // block)].long()].reshape(b, -1, k_cache.shape[-1])[:, :n]  # [b, n, 576]
    scores = torch.einsum("bshc,bnc->bhsn", q, kv) * softmax_scale
    future = torch.arange(n, device=q.device)[None, :] > (n - s + torch.arange(s, device=q.device))[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhsn,bnc->bshc", probs, kv[..., :head_dim_v])
