"""Training losses of V4's lightning indexer, V3.2's two stages on CSA's compressed entries.

The indexer picks compressed entries, so its target is the main attention's distribution over them: the
attention probabilities of the compressed entries (window keys and the sink left out), summed over heads and
L1-normalised over the candidates. The loss is ``KL(p || softmax(I))`` over the same candidates, averaged over
the queries that have any.

- warm-up (``ModelArgs.dsa_warmup``): the candidates are every causally visible entry, the attention dense over
  them, and only the indexers train (``training.loss.freeze_all_but_indexers``);
- sparse: the candidates are the indexer's own top-k (what the attention then reads).

Only the indexer is trained by it: it reads the layer input and the query residual detached, and the target is
made without gradient (in the sparse stage the main model learns from the LM loss alone, as V3.2). In training
``Attention.forward`` ties the loss to its output (``balancing.attach_aux_loss``), so every pipeline schedule
carries it as it carries the output. The target is made a chunk of queries at a time: no ``[heads, s, s]``
logits are held, only the indexer's own ``[s, n]`` scores (what its selection makes anyway).
"""

from __future__ import annotations

import torch

from models.deepseek_v3.indexer import CHUNK_BYTES, QUERY_CHUNK, IndexerStats, topk_recall

__all__ = ["indexer_kl", "indexer_loss"]


def _chunk(batch: int, heads: int, window: int, n: int) -> int:
    """Queries per chunk of the target: a chunk of c queries makes ``batch x heads x c x (c + window + n)`` fp32
    logits; at most ``QUERY_CHUNK`` queries, fewer when that would pass ``CHUNK_BYTES``."""
    return max(1, min(QUERY_CHUNK, CHUNK_BYTES // (4 * batch * heads * (QUERY_CHUNK + window + n))))


def indexer_kl(q: torch.Tensor, kv: torch.Tensor, ckv: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
               scores: torch.Tensor, candidates: torch.Tensor, topk: int,
               stats: IndexerStats | None = None, chunk: int | None = None) -> torch.Tensor:
    """Mean over queries with candidates of ``KL(p || softmax(scores))`` over each query's ``candidates``.

    ``q [b, s, h, d]``, ``kv [b, s, d]`` (window keys), ``ckv [b, n, d]`` (compressed entries), ``sink [h]``: the
    main attention's inputs, read without gradient; ``scores [b, s, n]`` the indexer's (differentiable, -inf where
    not visible); ``candidates [b, s, n]`` the entries the KL runs over (all visible ones or the top-k). ``stats``
    records the loss as ``kl`` and the share of the main attention's top-``topk`` entries the indexer's top-k
    holds as ``recall`` (over the last chunk's queries with more than ``topk`` candidates)."""
    b, s, h, _ = q.shape
    n = ckv.shape[1]
    chunk = chunk or _chunk(b, h, window, n)
    tiny = torch.finfo(torch.float32).tiny
    q, kv, ckv, sink = q.detach().float(), kv.detach().float(), ckv.detach().float(), sink.detach().float()
    cand = candidates.to(torch.bool)
    rows = cand.any(dim=-1)  # queries with at least one candidate
    total = scores.new_zeros((), dtype=torch.float32)
    p = None
    for a in range(0, s, chunk):
        e = min(s, a + chunk)
        lo = max(0, a - window + 1)  # the chunk's queries see window keys lo .. e-1
        with torch.no_grad():
            t = torch.arange(a, e, device=q.device).unsqueeze(1)
            u = torch.arange(lo, e, device=q.device)
            in_window = ((u <= t) & (u > t - window)).expand(b, -1, -1)
            mask = torch.cat([in_window, cand[:, a:e]], dim=-1)
            keys = torch.cat([kv[:, lo:e], ckv], dim=1)
            logits = torch.einsum("bshd,bnd->bhsn", q[:, a:e], keys) * scale
            logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
            sinks = sink.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
            probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., e - lo:-1].sum(dim=1)  # [b, c, n]
            p = probs / probs.sum(dim=-1, keepdim=True).clamp_min(tiny)
        c_cand, c_rows = cand[:, a:e], rows[:, a:e]
        # rows without candidates get finite logits so that log_softmax's backward stays finite there
        log_q = (scores[:, a:e].masked_fill(~c_cand, float("-inf")).masked_fill(~c_rows.unsqueeze(-1), 0.0)
                 .log_softmax(dim=-1))
        terms = torch.where(c_cand & (p > 0), p * (p.clamp_min(tiny).log() - log_q), torch.zeros_like(p))
        total = total + torch.where(c_rows, terms.sum(dim=-1), 0.0).sum()
    loss = total / rows.sum().clamp_min(1)
    if stats is not None and not loss.is_meta:  # metrics only (the memory model runs this on meta tensors)
        stats.record("kl", loss)
        if p is not None:
            c_cand = cand[:, a:e].flatten(0, 1)
            index = torch.arange(n, device=q.device).expand_as(c_cand)
            recall = topk_recall(p.flatten(0, 1), scores[:, a:e].detach().flatten(0, 1),
                                 torch.where(c_cand, index, -1), topk)
            if recall is not None:
                stats.record("recall", recall)
    return loss


def indexer_loss(attn: torch.nn.Module, x: torch.Tensor, angles: torch.Tensor, sparse: bool) -> torch.Tensor:
    """The indexer's KL loss for a CSA layer's attention ``attn`` on its input ``x [b, s, dim]`` (after
    ``attn_norm``), with ``angles`` the compressed rope angles of positions ``0..s-1``: what ``attn``'s forward
    attaches in training (``Attention.indexer_loss``)."""
    return attn.indexer_loss(x, angles, sparse)
