"""Training losses of V4's lightning indexer, V3.2's two stages on CSA's compressed entries.

The indexer picks compressed entries, so its target is the main attention's distribution over them: the
attention probabilities of the compressed entries (window keys and the sink left out), summed over heads and
L1-normalised over the candidates. The loss is ``KL(p || softmax(I))`` over the same candidates, averaged over
the queries that have any.

- warm-up (``sparse=False``): the candidates are every causally visible entry, the attention dense over them;
- sparse (``sparse=True``): the candidates are the indexer's own top-k (what the attention then reads).

Only the indexer is trained by it: the layer input, the query residual and the target are detached (in the
sparse stage the main model learns from the LM loss alone, as V3.2).
"""

from __future__ import annotations

import torch

from models.deepseek_v4.model import Attention, apply_rope, compressed_visible, rms_scale, select_topk, window_visible


def indexer_loss(attn: Attention, x: torch.Tensor, angles: torch.Tensor, sparse: bool) -> torch.Tensor:
    """The indexer's KL loss for a CSA layer's attention ``attn`` on its input ``x [b, s, dim]`` (after
    ``attn_norm``), with ``angles`` the compressed rope angles of positions ``0..s-1``."""
    if attn.indexer is None:
        raise ValueError("indexer_loss: the layer has no indexer (compress ratio 4 layers only)")
    x = x.detach()
    b, s, _ = x.shape
    with torch.no_grad():
        qr = attn.q_norm(attn.wq_a(x))
        q = apply_rope(rms_scale(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), attn.eps), angles)
        kv = apply_rope(attn.kv_norm(attn.wkv(x)), angles)
        ckv = attn.compressor(x, angles)
    iq, ik, iw = attn.indexer.parts(x, qr, angles)
    scores = attn.indexer.scores(iq, ik, iw)  # [b, s, n], -inf where not visible
    n = scores.shape[-1]
    visible = compressed_visible(s, n, attn.ratio, x.device).expand(b, s, n)
    rows = visible.any(dim=-1)  # queries with at least one closed window
    if sparse:
        candidates = select_topk(scores.detach(), attn.indexer.topk) & visible
    else:
        candidates = visible
    with torch.no_grad():
        keys = torch.cat([kv, ckv], dim=1)
        mask = torch.cat([window_visible(s, attn.window, x.device).expand(b, s, s), candidates], dim=-1)
        logits = torch.einsum("bshd,bnd->bhsn", q.float(), keys.float()) * attn.softmax_scale
        logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
        sinks = attn.attn_sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., s:-1].sum(dim=1)  # [b, s, n]
        p = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    # rows without candidates get finite logits so that log_softmax's backward stays finite there
    log_q = scores.masked_fill(~candidates, float("-inf")).masked_fill(~rows.unsqueeze(-1), 0.0).log_softmax(dim=-1)
    terms = torch.where(candidates & (p > 0), p * (p.clamp_min(torch.finfo(p.dtype).tiny).log() - log_q),
                        torch.zeros_like(p))
    return terms.sum(dim=-1)[rows].sum() / rows.sum().clamp_min(1)
