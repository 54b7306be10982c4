"""The DeepSeek-V4 Transformer, in the style of DeepSeek's ``inference/model.py``: each module's forward is the math.

Attention (``Attention``): a low-rank query with a weightless per-head RMSNorm, one shared 512-wide head that
is both K and V, interleaved RoPE on the last ``rope_head_dim`` dims (and the inverse rotation on the output),
a learned sink logit per head, a ``window_size`` sliding window on every layer, plus per layer either nothing,
CSA (``Compressor`` with ratio 4 over overlapping windows and an ``Indexer`` choosing the top-k compressed
entries) or HCA (``Compressor`` with ratio 128, every causally visible entry), and a grouped low-rank output
projection. The residual is ``hc_mult`` streams (mHC): ``hc_pre`` collapses them for a sublayer and
``hc_post`` spreads its output back and mixes the streams by a Sinkhorn-projected matrix. Every FFN is a
``MoE`` (the first ``n_hash_layers`` route by token id). ``MTPBlock`` predicts one more token ahead.

This is the training form: a whole sequence from position 0, attention computed densely under masks
(window, compressed-entry causality, the indexer's selection). Parameter names are the released
checkpoint's, except the routed experts, held as ``[E, ...]`` tensors (``Experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import deep_gemm
import flash_mla
import fused_ops
from deep_gemm.health import Fp8Health
from models.deepseek_v3.balancing import BalanceConfig, ExpertBalancer, attach_aux_loss
from models.deepseek_v3.expert_parallel import SendPlan, arrived
from models.deepseek_v3.indexer import IndexerStats, hadamard_fp4
from models.deepseek_v3.layers import Linear
from models.deepseek_v3.moe import Experts as V3Experts
from models.deepseek_v3.moe import MoE as V3MoE
from models.deepseek_v3.moe import Routing
from models.deepseek_v3.permute import group_weights
from models.deepseek_v3.rope import yarn_inv_freq
from models.deepseek_v4.args import ModelArgs
from models.deepseek_v4.indexer_loss import indexer_kl

__all__ = ["Attention", "Block", "Compressor", "Experts", "Gate", "Indexer", "MTPBlock", "MoE", "RMSNorm",
           "Transformer", "hc_post", "hc_pre"]


# ---------------------------------------------------------------------------------------------------- basics
class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The weightless RMSNorm (V4's per-head query norm and the mHC input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def inv_freq(args: ModelArgs, compressed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies ``[rope_head_dim / 2]``: theta ``rope_theta`` for window-only layers;
    ``compress_rope_theta`` with YaRN's ramp (no cos/sin scaling) for compressed layers, their compressors
    and indexers (V3's formula, ``models.deepseek_v3.rope.yarn_inv_freq``)."""
    base = args.compress_rope_theta if compressed else args.rope_theta
    return yarn_inv_freq(args, args.rope_head_dim, base, compressed and args.yarn, device)


def rope_angles(args: ModelArgs, positions: torch.Tensor, compressed: bool) -> torch.Tensor:
    """Rotation angles ``[len(positions), rope_head_dim / 2]`` (fp32)."""
    return positions.float().unsqueeze(-1) * inv_freq(args, compressed, positions.device)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the last ``2 * angles.shape[-1]`` dims of ``x [b, s, (h,) d]`` by
    ``angles [s, rd/2]`` (``inverse``: by minus the angles); the leading dims pass through. fp32 math."""
    rd = 2 * angles.shape[-1]
    shape = (1, angles.shape[0]) + (1,) * (x.dim() - 3) + (angles.shape[-1],)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    if inverse:
        sin = -sin
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


# ---------------------------------------------------------------------------------------------------- attention
class Compressor(nn.Module):
    """Gated pooling of every ``ratio`` tokens into one compressed entry (RMSNormed, RoPE at position i * ratio).

    ``overlap`` (CSA, ratio 4): each token projects two series, ``wkv``'s first ``head_dim`` features (Ca, for
    the next window) and its last (Cb, for its own); entry i pools window i-1's Ca with window i's Cb, 2 * ratio
    tokens with stride ratio. The pooling weights are a softmax over those tokens of ``wgate(x) + ape``.
    """

    def __init__(self, args: ModelArgs, ratio: int, head_dim: int):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.wgate = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """``x [b, s, dim]`` -> compressed entries ``[b, s // ratio, head_dim]``; ``angles`` are the compressed
        rope angles of positions ``0..s-1``."""
        b, s, _ = x.shape
        m, d = self.ratio, self.head_dim
        n = s // m
        if n == 0:
            return x.new_zeros(b, 0, d)
        pooled = fused_ops.gated_pool(self.wkv(x[:, : n * m]), self.wgate(x[:, : n * m]), self.ape, m, self.overlap)
        return apply_rope(self.norm(pooled), angles[: n * m : m])


class Indexer(nn.Module):
    """Lightning indexer over CSA's compressed entries: ``I[t, w] = sum_h wt[t, h] ReLU(q[t, h] . k[w])`` with
    ``q = wq_b(q residual)`` (RoPE at t), ``k`` its own compressor's entries, ``wt = weights_proj(x)`` scaled by
    ``(index_head_dim * index_n_heads) ** -0.5``; entry w is visible to query t when ``w < (t + 1) // ratio``.
    ``Attention`` selects the top ``topk`` by ``select_topk`` (no gradient) and trains it by ``indexer_kl``."""

    def __init__(self, args: ModelArgs, ratio: int = 4):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = (args.index_n_heads, args.index_head_dim,
                                                              args.index_topk, ratio)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8=args.fp8)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim)
        self.qk_fp4 = args.indexer_qk_format == "mxfp4_hadamard"  # V4's QAT of q and k (``hadamard_fp4``)
        self.health: Fp8Health | None = None  # deep_gemm.health.Fp8Health, set by its attach (with qk_fp4)
        self.stats = IndexerStats()  # the training loss and top-k recall, for the metrics stream

    def parts(self, x: torch.Tensor, qr: torch.Tensor, angles: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[b, s, h, d]``, compressed keys ``[b, n, d]`` and head weights ``[b, s, h]`` (fp32); with
        ``indexer_qk_format = "mxfp4_hadamard"`` q and k rotated and cast to FP4 as V4's release does."""
        q = apply_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), angles)
        k = self.compressor(x, angles)
        if self.qk_fp4:
            q, k = hadamard_fp4(q, self.health, self, "q"), hadamard_fp4(k, self.health, self, "k")
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return q, k, w

    def scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Index scores ``[b, s, n]`` (fp32), -inf where the entry is not yet visible."""
        return fused_ops.indexer_logits(q, k, w, self.ratio, self.head_dim ** -0.5)



def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest finite scores along the last dim, equal scores taken earliest entry first.

    Ties are common at small sizes (an entry whose every head's ReLU is 0 scores exactly 0); breaking them by
    position keeps a query's choice independent of how many entries the sequence has, so a prefix scores the
    same alone as inside a longer sequence (``torch.topk`` leaves the order of ties unspecified)."""
    n = scores.shape[-1]
    if n == 0:
        return scores.new_zeros(scores.shape, dtype=torch.bool)
    idx = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, n)]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    return chosen & scores.isfinite()


def compressed_visible(s: int, n: int, ratio: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[s, n]`` True where query t may see compressed entry w: its window has closed, ``w < (t + 1) // ratio``."""
    t = torch.arange(s, device=device).unsqueeze(1)
    return torch.arange(n, device=device) < (t + 1) // ratio


def window_visible(s: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[s, s]`` True where query t sees token u: ``t - window < u <= t``."""
    t = torch.arange(s, device=device).unsqueeze(1)
    u = torch.arange(s, device=device)
    return (u <= t) & (u > t - window)


class Attention(nn.Module):
    """V4 attention: sliding window + (optionally) compressed entries, one shared K = V head, sinks."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.window, self.eps, self.o_groups = args.window_size, args.norm_eps, args.o_groups
        self.ratio = args.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_a = Linear(args.dim, args.q_lora_rank, fp8=args.fp8)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8=args.fp8)
        self.wkv = Linear(args.dim, self.head_dim, fp8=args.fp8)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        # block-diagonal: group g maps heads [g*H/G, (g+1)*H/G) to rows [g*o_lora_rank, (g+1)*o_lora_rank)
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // args.o_groups, args.o_groups * args.o_lora_rank,
                              bias=False)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.dim, fp8=args.fp8)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.compressor = Compressor(args, self.ratio, self.head_dim) if self.ratio else None
        self.indexer = Indexer(args, self.ratio) if self.ratio == 4 else None
        self.warmup = args.dsa_warmup  # V3.2's dense warm-up: attend every visible entry, the indexer learns

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """``x [b, s, dim]`` at positions ``0..s-1``; ``angles`` the rope angles of this layer's kind. In training
        (grad enabled) a CSA layer's output carries its indexer's KL loss (``indexer_loss``)."""
        b, s, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(rms_scale(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), self.eps), angles)
        kv = apply_rope(self.kv_norm(self.wkv(x)), angles)  # [b, s, d]: keys and values
        if self.compressor is None:
            return self._output(q, kv, attention_rows(s, self.window, None, None, x.device), angles)
        ckv = self.compressor(x, angles)
        learn = self.indexer is not None and self.training and torch.is_grad_enabled()
        scores = None
        if learn or (self.indexer is not None and not self.warmup):
            with torch.set_grad_enabled(learn):  # a selection alone carries no gradient
                scores = self._index_scores(x, qr, angles)
        chosen, topk = self._chosen(scores, s, ckv.shape[1], b, x.device)
        rows = attention_rows(s, self.window, chosen, topk, x.device)
        out = self._output(q, torch.cat([kv, ckv], dim=1), rows, angles)
        if learn:
            loss = indexer_kl(q, kv, ckv, self.attn_sink, self.softmax_scale, self.window, scores, chosen,
                              self.indexer.topk, self.indexer.stats)
            out = attach_aux_loss(out, loss)
        return out

    def _index_scores(self, x: torch.Tensor, qr: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The indexer's scores ``[b, s, n]`` from the layer input and query residual, both detached (only the
        indexer's own loss trains it); differentiable in the indexer's weights when grad is enabled."""
        return self.indexer.scores(*self.indexer.parts(x.detach(), qr.detach(), angles))

    def _chosen(self, scores: torch.Tensor | None, s: int, n: int, b: int, device: torch.device
                ) -> tuple[torch.Tensor, int | None]:
        """The compressed entries each query attends ``[b, s, n]`` and the most per query (None: no limit):
        the indexer's top-k in a CSA layer, every visible entry in an HCA layer or in the warm-up."""
        if self.indexer is None or self.warmup:
            return compressed_visible(s, n, self.ratio, device).expand(b, -1, -1), None
        return select_topk(scores.detach(), self.indexer.topk), self.indexer.topk

    def _output(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Attention over each query's ``rows`` of ``kv``, the inverse RoPE, then the grouped low-rank output."""
        b, s = q.shape[:2]
        o = sparse_sink_attention(q, kv, rows, self.attn_sink, self.softmax_scale)
        o = apply_rope(o, angles, inverse=True)
        # grouped low-rank output: o_g [b, s, H*d/G] times wo_a's block g, then wo_b over all groups
        wo_a = self.wo_a.weight.view(self.o_groups, -1, self.wo_a.in_features)
        o = torch.einsum("bsgd,grd->bsgr", o.reshape(b, s, self.o_groups, -1), wo_a)
        return self.wo_b(o.flatten(2))

    def indexer_loss(self, x: torch.Tensor, angles: torch.Tensor, sparse: bool, chunk: int | None = None
                     ) -> torch.Tensor:
        """The indexer's KL loss on this layer's input ``x [b, s, dim]`` (after ``attn_norm``): over its top-k
        (``sparse``) or every visible entry (the warm-up), as the training forward attaches it; ``chunk``
        queries per chunk of the target (default: ``indexer_loss._chunk``'s bound)."""
        if self.indexer is None:
            raise ValueError("indexer_loss: the layer has no indexer (compress ratio 4 layers only)")
        x = x.detach()
        b, s, _ = x.shape
        with torch.no_grad():
            qr = self.q_norm(self.wq_a(x))
            q = apply_rope(rms_scale(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), self.eps), angles)
            kv = apply_rope(self.kv_norm(self.wkv(x)), angles)
            ckv = self.compressor(x, angles)
        scores = self._index_scores(x, qr, angles)
        n = ckv.shape[1]
        chosen = (select_topk(scores.detach(), self.indexer.topk) if sparse
                  else compressed_visible(s, n, self.ratio, x.device).expand(b, -1, -1))
        return indexer_kl(q, kv, ckv, self.attn_sink, self.softmax_scale, self.window, scores, chosen,
                          self.indexer.topk, chunk=chunk)


def attention_rows(s: int, window: int, chosen: torch.Tensor | None, topk: int | None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Each query's index list ``[b, s, width]`` (int32, -1 = unused slot) into its sequence's ``cat([kv, ckv])``:
    its window ``t - window < u <= t``, then ``s + w`` for every compressed entry w that ``chosen [b, s, n]``
    marks (the indexer's top-k: at most ``topk`` per row; ``None``: every marked entry, HCA's causal set).
    ``chosen`` None: a window-only layer (``b`` = 1, broadcast by the caller)."""
    t = torch.arange(s, device=device)[:, None]
    rows = t - torch.arange(min(window, s), device=device)
    rows = rows.masked_fill(rows < 0, -1)[None]
    if chosen is None:
        return rows.int()
    width = chosen.shape[-1] if topk is None else min(topk, chosen.shape[-1])
    marked = chosen.to(torch.uint8).sort(dim=-1, descending=True, stable=True)  # marked entries first
    entries = torch.where(marked.values[..., :width] > 0, marked.indices[..., :width] + s, -1)
    return torch.cat([rows.expand(chosen.shape[0], -1, -1), entries], dim=-1).int()


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """``softmax([q.k * scale | sink])`` over each query's listed keys, the sink dropped, times ``kv`` (K = V), by
    ``flash_mla.sparse_sink_attention`` over the batch flattened (each sequence's rows offset by its start).
    ``q [b, s, h, d]``, ``kv [b, n, d]``, ``rows [b or 1, s, width]`` -> ``[b, s, h, d]``."""
    b, s, h, d = q.shape
    offsets = torch.arange(b, device=q.device, dtype=torch.int32).view(b, 1, 1) * kv.shape[1]
    rows = torch.where(rows >= 0, rows + offsets, -1).flatten(0, 1)
    out = flash_mla.sparse_sink_attention(q.flatten(0, 1), kv.flatten(0, 1), rows, sink, scale)
    return out.view(b, s, h, d)


# ---------------------------------------------------------------------------------------------------- MoE
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (no clamp when limit is 0)."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """The shared expert: a clamped SwiGLU FFN (``w1`` gate, ``w3`` up, ``w2`` down)."""

    def __init__(self, dim: int, inter_dim: int, limit: float, fp8: bool | str = False):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter_dim, fp8=fp8)
        self.w2 = Linear(inter_dim, dim, fp8=fp8)
        self.w3 = Linear(dim, inter_dim, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class ClampedSwiGLU(nn.Module):
    """``swiglu(gate, up, limit)`` of the fused ``[..., 2 * inter]`` gate/up output, each row times its routing
    weight when given (in fp32, one rounding): V3's ``SwiGLU`` interface with V4's clamp."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def forward(self, gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out = swiglu(gate, up, self.limit)
        return out if weights is None else (out.float() * weights.float().unsqueeze(-1)).to(out.dtype)


class Experts(V3Experts):
    """The routed experts as grouped weights, V3's ``Experts`` (``w13 [E, 2 * inter, dim]``: gate rows, then up
    rows; ``w2 [E, dim, inter]``; one grouped GEMM each, FP8 under ``args.fp8``; an expert-parallel rank holds
    ``expert_ids``) with the clamped SwiGLU."""

    def __init__(self, args: ModelArgs, expert_ids: range | None = None):
        super().__init__(args, expert_ids)
        self.act = ClampedSwiGLU(args.swiglu_limit)


class Gate(nn.Module):
    """Router: fp32 scores ``sqrt(softplus(x W^T))`` (or sigmoid / softmax); top-k of scores + ``bias`` (not
    trained by gradients), or for a hash layer the token's fixed experts ``tid2eid[token]``; weights are the
    chosen unbiased scores, normalised, times ``route_scale``."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.topk, self.score_func, self.route_scale = args.n_activated_experts, args.score_func, args.route_scale
        self.layer_id, self.hash = layer_id, layer_id < args.n_hash_layers
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.long))
            self.bias = None
        else:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, dim]`` -> ``(weights, indices)`` ``[T, k]``, and the fp32 ``scores`` and ``logits`` ``[T, E]``."""
        logits = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            indices = self.tid2eid[tokens.flatten()]
        else:
            indices = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.score_func != "softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices, scores, logits


class MoE(V3MoE):
    """Routed experts (top-k per token, or the token's fixed experts in a hash layer) plus the shared expert.

    V3's ``MoE`` steps (permute / grouped experts / unpermute on one rank; ``send`` / ``expert_rows`` /
    ``combined`` around the expert-parallel all-to-alls, ``ep`` set by ``training.experts.wire_moe_layers``) with
    V4's router, which also reads the token ids. Its own parts are built here, not by V3's constructor (whose
    router and shared experts are V3's). A hash layer (``fixed_routing``) has no bias to balance: its
    balancer only measures.
    """

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        nn.Module.__init__(self)
        self.ep = None
        self.layer_id, self.dim = layer_id, args.dim
        self.gate = Gate(args, layer_id)
        self.experts = Experts(args, expert_ids)
        self.shared_experts = (Expert(args.dim, args.moe_inter_dim, args.swiglu_limit, args.fp8)
                               if args.n_shared_experts else None)
        self.n_routed_experts, self.fused = args.n_routed_experts, args.fused_ops
        self.m_alignment = deep_gemm.get_m_alignment_for_contiguous_layout()
        self.fixed_routing = self.gate.hash
        self.balancer = ExpertBalancer(args.n_routed_experts, args.n_activated_experts, BalanceConfig(strategy="none"))
        self.received_rows = None

    def route(self, x: torch.Tensor, tokens: torch.Tensor, seq_len: int | None = None) -> Routing:
        """``x [T, dim]`` and its token ids (any shape of T elements) -> ``Routing``, after the balancer."""
        weights, indices, scores, logits = self.gate(x, tokens)
        indices, weights = self.balancer(scores, logits, indices, weights, seq_len)
        return Routing(weights=weights, indices=indices, scores=scores, logits=logits)

    def shared(self, x: torch.Tensor, x_fp8: None = None) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)

    def send(self, x: torch.Tensor, tokens: torch.Tensor, seq_len: int | None = None
             ) -> tuple[torch.Tensor, SendPlan, torch.Tensor | None]:
        """Before the dispatch (V3's ``MoE.send`` with the token ids): route, gather the rows to send, run the
        shared expert."""
        routing = self.route(x, tokens, seq_len)
        send, plan = self.ep.gather(x, routing.weights, self.ep.plan_send(routing.indices), None)
        return send, plan, self.shared(x)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``x [b, s, dim]`` and ``tokens [b, s]`` -> the routed experts' weighted sum plus the shared expert."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        if self.ep is None:
            routing = self.route(x, tokens, shape[-2])
            x_grouped, m_indices, state = self.permute(x, routing)
            rows = group_weights(routing.weights, state, len(m_indices))
            y = self.unpermute(self.experts(x_grouped, m_indices, rows), state)
            z = self.shared(x)
        else:
            send, plan, z = self.send(x, tokens, shape[-2])
            received = self.ep.post_dispatch(send, plan, self.dim).wait()
            y = self.expert_rows(arrived(send, received.rows, received.exchanged), received)
            back = self.ep.post_combine(y, received).wait()
            y = self.ep.scatter_back(arrived(y, back.rows, back.exchanged), plan)
        return (y if z is None else y + z).view(shape)


# ---------------------------------------------------------------------------------------------------- mHC
def hc_mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The mHC unit's logits: the weightless-RMSNormed flattened streams ``[b, s, hc * dim]`` times ``fn^T`` (fp32)."""
    return F.linear(rms_scale(h.flatten(2).float(), eps), fn.float())


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse streams ``h [b, s, hc, dim]`` for a sublayer: returns ``(x [b, s, dim], post [b, s, hc],
    comb [b, s, hc, hc])`` with ``x = sum_i pre_i h_i``, ``pre = sigmoid + hc_eps``, ``post = 2 sigmoid``, and
    ``comb`` = softmax + hc_eps, then alternately column- and row-normalised (Sinkhorn, ``iters`` column steps)."""
    hc = h.shape[2]
    pre, post, comb = hc_mixes(h, fn, norm_eps).split([hc, hc, hc * hc], dim=-1)
    base = base.float()
    pre = torch.sigmoid(pre * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(post * scale[1] + base[hc:2 * hc])
    comb = fused_ops.sinkhorn(comb.unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc), hc_eps, iters)
    x = (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)
    return x, post, comb


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Spread the sublayer output ``y [b, s, dim]`` over the streams and mix the old ones, comb transposed:
    ``h'_j = post_j y + sum_i comb[i, j] h_i``, in fp32 with one rounding to the streams' dtype (as DeepSeek's
    reference; transformers rounds post and comb first)."""
    mixed = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), h.float())
    return mixed.to(h.dtype)


class HCHead(nn.Module):
    """Collapse the streams before the final norm: ``sum_i (sigmoid(mix_i * scale + base_i) + eps) h_i``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm_eps, self.hc_eps = args.norm_eps, args.hc_eps
        self.hc_head_fn = nn.Parameter(torch.empty(args.hc_mult, args.hc_mult * args.dim))
        self.hc_head_base = nn.Parameter(torch.zeros(args.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixes = hc_mixes(h, self.hc_head_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


# ---------------------------------------------------------------------------------------------------- blocks
class Block(nn.Module):
    """Attention and MoE, each between an mHC collapse and spread of the ``hc_mult`` residual streams.

    ``run`` is the layer; the overlapped pipeline runs an expert-parallel layer as the pieces of
    ``models.deepseek_v4.plan``, which call ``attention``, ``ffn_pre`` and the MoE's steps."""

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.norm_eps, self.hc_eps, self.iters = args.norm_eps, args.hc_eps, args.hc_sinkhorn_iters
        self.compressed = args.compress_ratios[layer_id] > 0
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args, layer_id, expert_ids)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, width))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, width))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))

    def attention(self, h: torch.Tensor, angles: dict[bool, torch.Tensor]) -> torch.Tensor:
        """The attention sublayer between its mHC collapse and spread: streams in, streams out."""
        x, post, comb = hc_pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.norm_eps,
                               self.hc_eps, self.iters)
        return hc_post(self.attn(self.attn_norm(x), angles[self.compressed]), h, post, comb)

    def ffn_pre(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE sublayer's input ``ffn_norm(x) [b, s, dim]`` and its mHC ``post`` / ``comb`` weights."""
        x, post, comb = hc_pre(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.norm_eps,
                               self.hc_eps, self.iters)
        return self.ffn_norm(x), post, comb

    def run(self, h: torch.Tensor, angles: dict[bool, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """``h [b, s, hc, dim]``; ``angles[compressed]`` the rope angles of positions ``0..s-1``; ``tokens [b, s]``
        the token ids (hash routing)."""
        h = self.attention(h, angles)
        x, post, comb = self.ffn_pre(h)
        return hc_post(self.ffn(x, tokens), h, post, comb)

    def forward(self, h: torch.Tensor, angles: dict[bool, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return self.run(h, angles, tokens)

    @property
    def expert_parallel(self) -> bool:
        """Whether this layer's MoE exchanges tokens with other ranks (it then has all-to-alls to overlap)."""
        return self.ffn.ep is not None


class MTPBlock(Block):
    """Multi-token prediction: ``e_proj(enorm(embed(t_{i+k}))) + h_proj(hnorm(h_i))`` through a full V4 block,
    collapsed by its own ``hc_head`` and normed by its own ``norm``; the embedding and head are the model's."""

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__(args, layer_id, expert_ids)
        self.e_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.h_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.hc_head = HCHead(args)

    def project(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The block's input streams from ``h [b, s, hc, dim]`` and the next tokens' embeddings ``emb [b, s, dim]``."""
        return self.e_proj(self.enorm(emb)).unsqueeze(2) + self.h_proj(self.hnorm(h))

    def forward(self, h: torch.Tensor, emb: torch.Tensor, angles: dict[bool, torch.Tensor],
                tokens: torch.Tensor) -> torch.Tensor:
        """Streams ``h [b, s, hc, dim]`` and the next tokens' embeddings ``emb [b, s, dim]`` -> new streams."""
        return self.run(self.project(h, emb), angles, tokens)


# ---------------------------------------------------------------------------------------------------- model
class Transformer(nn.Module):
    """DeepSeek-V4 causal LM. ``forward(tokens)`` -> logits ``[b, s, vocab]``; ``return_mtp`` adds the MTP
    logits (depth k's ``[b, s - k, vocab]`` at position i predict ``tokens[i + k + 1]``)."""

    def __init__(self, args: ModelArgs, expert_ids: range | None = None):
        """``expert_ids`` (a contiguous range) builds only those routed experts in every MoE layer, for an
        expert-parallel rank."""
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, expert_ids) for i in range(args.n_layers))
        self.hc_head = HCHead(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = nn.ModuleList(MTPBlock(args, args.n_layers + k, expert_ids) for k in range(args.n_mtp_layers))
        if not self.embed.weight.is_meta:
            self.init_weights()

    def angles(self, s: int, device: torch.device | str) -> dict[bool, torch.Tensor]:
        """Rope angles of positions ``0..s-1`` for window-only (False) and compressed (True) layers."""
        if s > self.args.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.args.max_seq_len}")
        pos = torch.arange(s, device=device)
        return {False: rope_angles(self.args, pos, False), True: rope_angles(self.args, pos, True)}

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual streams ``[b, s, hc, dim]`` after the last layer."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer [batch, seq] tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        angles = self.angles(tokens.shape[1], tokens.device)
        h = self.embed(tokens).unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)
        for layer in self.layers:
            h = layer(h, angles, tokens)
        return h

    def final(self, h: torch.Tensor) -> torch.Tensor:
        """Streams -> logits: ``head(norm(hc_head(h)))``."""
        return self.head(self.norm(self.hc_head(h)))

    def mtp_logits(self, h: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """MTP logits per depth from the main model's last streams ``h``."""
        out = []
        for k, block in enumerate(self.mtp, start=1):
            s = tokens.shape[1] - k
            if s <= 0:
                break
            nxt = tokens[:, k:]
            h = block(h[:, :s], self.embed(nxt), self.angles(s, tokens.device), nxt)
            out.append(self.head(block.norm(block.hc_head(h))))
        return out

    def forward(self, tokens: torch.Tensor, return_mtp: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.hidden(tokens)
        logits = self.final(h)
        return (logits, self.mtp_logits(h, tokens)) if return_mtp else logits

    @torch.no_grad()
    def init_weights(self, module: nn.Module | None = None) -> None:
        """Initialise ``module`` (default: the whole model; its own parameters and its children's): normal(0,
        init_std) for linears, embeddings, experts, routers and mHC projections; norms and mHC scales 1; mHC
        biases, sinks and position biases 0; hash tables a fixed pseudo-random assignment per layer (every
        process builds the same one)."""
        std = self.args.init_std
        for m in (module or self).modules():
            for leaf, p in m.named_parameters(recurse=False):
                if p.is_meta:
                    continue
                if leaf.endswith("_scale") or (leaf == "weight" and isinstance(m, RMSNorm)):
                    p.fill_(1.0)
                elif leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)
            if isinstance(m, Gate) and not m.weight.is_meta:
                if m.hash:
                    gen = torch.Generator().manual_seed(m.layer_id)
                    vocab, n_exp = m.tid2eid.shape[0], m.weight.shape[0]
                    m.tid2eid.copy_(torch.rand(vocab, n_exp, generator=gen).argsort(dim=-1)[:, : m.topk])
                else:
                    m.bias.zero_()
