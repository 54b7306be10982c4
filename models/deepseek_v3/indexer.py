"""DeepSeek-V3.2's lightning indexer and its training loss (DeepSeek Sparse Attention, DSA).

For query ``t`` and earlier key ``s`` the indexer's score is ``I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])``
over ``index_n_heads`` heads ``j`` of width ``index_head_dim``:

* ``q_I = wq_b(q_resid)``, with ``q_resid`` the MLA query's low-rank residual after ``q_norm``;
* ``k_I = k_norm(wk(x))``, one key head shared by every indexer head (``k_norm`` a LayerNorm);
* the first ``qk_rope_head_dim`` dims of both get RoPE as two halves (not the MLA's interleaved pairs);
* ``w = weights_proj(x) * index_n_heads^-0.5``; the softmax scale ``index_head_dim^-0.5`` is folded
  into ``w`` (ReLU is positively homogeneous), as DeepGEMM's ``fp8_mqa_logits`` takes it.

With ``indexer_qk_format = "mxfp4_hadamard"`` (DeepSeek-V4's QAT of the indexer, ``hadamard_fp4``) q_I and k_I are
rotated by the orthonormal Hadamard matrix of the head dim and cast to FP4 and back; the selection and the loss
both score those values, and the gradient passes the cast straight through (and the rotation as its transpose).
The FP8 health report counts those casts (``deep_gemm.health``: the collector it is handed, ``health``).

Each query attends to its ``index_topk`` highest-scoring causal keys. The indexer learns from the main
attention: ``KL(p || softmax(I))`` with ``p`` the main attention's probabilities summed over heads and
L1-normalised, over every causal key in the dense warm-up and over the selected keys in the sparse stage.
Its inputs are detached from the main graph, so the loss trains the indexer only. ``indexer_kl`` (the top-k,
its target ``p [T, k]`` kept) and ``dense_indexer_kl`` (every causal key, its target remade per chunk) work on a
chunk of queries at a time, so neither ``[heads, s, s]`` scores nor ``[s, index heads, k]`` products, nor in the
warm-up any ``[s, s]`` array, are ever held.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import deep_gemm
from deep_gemm.health import Fp8Health
from deep_gemm.mxfp4 import fp4_act_fake_quant
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import Linear
from models.deepseek_v3.rope import apply_rotary_emb_half

QUERY_CHUNK = 256  # queries per chunk of the loss: bounds the [chunk, heads, keys] products it makes
CHUNK_BYTES = 2**30  # what one chunk of the warm-up's target may make (its gathered latents and logits, fp32)


def dense_chunk(seq_len: int, per_key: int) -> int:
    """Queries per chunk of the warm-up's loss, whose every query has up to ``seq_len`` candidates costing
    ``per_key`` fp32 values each: at most ``QUERY_CHUNK``, fewer as the sequence grows (``CHUNK_BYTES``)."""
    return max(1, min(QUERY_CHUNK, CHUNK_BYTES // (4 * seq_len * per_key)))


class IndexerStats(nn.Module):
    """Running sums of one layer's indexer loss and top-k recall, for the metrics stream (not checkpointed)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, torch.Tensor] = {}
        # counts as tensors, not Python ints: a compiled forward would guard on (and recompile for) every value
        self.calls: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def record(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value.detach().double()
        self.calls[name] = self.calls.get(name, 0) + torch.ones((), dtype=torch.int64, device=value.device)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        out = {name: float(total) / int(self.calls[name]) for name, total in self.sums.items()}
        if reset:
            self.sums, self.calls = {}, {}
        return out


class Indexer(nn.Module):
    """The lightning indexer of one layer (HF names: ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.rope_dim, self.fused = args.qk_rope_head_dim, args.fused_ops
        # FP8 GEMMs with model.fp8, as the release stores these two (weights_proj stays unquantised)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8=args.fp8, fp8_cache=args.fp8_cache)
        self.wk = Linear(args.dim, self.head_dim, fp8=args.fp8, fp8_cache=args.fp8_cache)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(args.dim, self.n_heads)
        self.stats = IndexerStats()
        self.qk_fp4 = args.indexer_qk == "mxfp4_hadamard"  # V4's QAT of q and k (``hadamard_fp4``)
        self.health: Fp8Health | None = None  # deep_gemm.health.Fp8Health, set by its attach (with qk_fp4)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary_emb_half(rot, cos, sin, self.fused), rest], dim=-1)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``q_I [b, s, heads, head_dim]`` from the MLA query residual ``[b, s, q_lora_rank]`` (after q_norm)."""
        q = self._rope(self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        return hadamard_fp4(q, self.health, self, "q") if self.qk_fp4 else q

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``k_I [b, s, head_dim]`` from the attention input ``x [b, s, dim]``."""
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)
        return hadamard_fp4(k, self.health, self, "k") if self.qk_fp4 else k

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``w [b, s, heads]`` in fp32, with both scales folded in (``heads^-0.5 * head_dim^-0.5``)."""
        return self.weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``I [b, s, n] = sum_j w[:, :, j] * ReLU(q[:, :, j] . k)`` in fp32 for q ``[b, s, H, D]``, k ``[b, n, D]``,
    w ``[b, s, H]`` (the reference of DeepGEMM's ``fp8_mqa_logits``, in full precision)."""
    logits = torch.einsum("bshd,bnd->bshn", q.float(), k.float()).relu_()
    return torch.einsum("bsh,bshn->bsn", w.float(), logits)


def causal_topk(scores: torch.Tensor, topk: int, start_pos: int = 0, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Each query's ``min(topk, n)`` highest-scoring causal keys: int32 ``[b, s, k]`` key positions, -1 where a
    query has fewer than k earlier keys. ``scores [b, s, n]`` for queries at ``start_pos..`` (or at ``positions
    [s]``: context parallelism's chunks) over keys ``0..n``."""
    s, n = scores.shape[1:]
    if positions is None:
        positions = torch.arange(start_pos, start_pos + s, device=scores.device)
    future = torch.arange(n, device=scores.device)[None, :] > positions[:, None]
    masked = scores.masked_fill(future, float("-inf"))
    values, idx = masked.topk(min(topk, n), dim=-1)
    return torch.where(values == float("-inf"), -1, idx).to(torch.int32)


def causal_rows(start: int, count: int, seq_len: int, device: torch.device | str | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """Every causal key of the flattened queries ``start .. start + count`` (each in its own sequence of
    ``seq_len``) as rows of the flattened keys: int32 ``[count, seq_len]``, -1 for a later key. ``positions``
    (context parallelism): each sequence's queries are its rows at these global positions of its ``seq_len``
    keys (query ``t`` is sequence ``t // len(positions)``'s position ``positions[t % len(positions)]``)."""
    t = torch.arange(start, start + count, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    if positions is None:
        return torch.where(j <= t % seq_len, t - t % seq_len + j, -1).to(torch.int32)
    rows = positions.shape[0]
    return torch.where(j <= positions.to(device)[t % rows], t // rows * seq_len + j, -1).to(torch.int32)


def hadamard(d: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal ``[d, d]`` Sylvester-Hadamard matrix (d a power of two): rotating q and k by it before FP8
    quantisation spreads outliers over every dim (as DeepSeek's indexer does) and leaves q . k unchanged."""
    if d & (d - 1):
        raise ValueError(f"hadamard: the indexer's head dim must be a power of two for FP8 scoring, got {d}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


def hadamard_fp4(x: torch.Tensor, health: Fp8Health | None = None, module: nn.Module | None = None,
                 operand: str = "x") -> torch.Tensor:
    """DeepSeek-V4's indexer QAT step on q or k ``[..., D]``: ``x @ H`` (H the orthonormal ``[D, D]`` Hadamard
    matrix, entries +-D^-0.5, as V4's ``rotate_activation``) then FP4 with a power-of-two scale per 32 dims
    (``deep_gemm.mxfp4.fp4_act_fake_quant``), in x's dtype. Rotating both q and k leaves q . k unchanged in exact
    math while spreading an outlier dim over all D before the cast. Gradient: straight through the cast, H^T = H
    through the rotation. ``health`` (while active) is told the cast of the rotated ``x`` as ``module``'s
    ``fwd`` ``operand``."""
    rotated = x @ hadamard(x.shape[-1], x.device).to(x.dtype)
    if health is not None and health.active:
        health.observe_fp4_act(module, "fwd", operand, rotated)
    return fp4_act_fake_quant(rotated)


def select_rows(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, fp8: bool = False,
                chunk: int = QUERY_CHUNK, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Each query's top-``topk`` causal keys as rows of the batch's keys flattened to ``[b * n]``: int32
    ``[b * s, min(topk, n)]``, -1 where a query has fewer earlier keys. q ``[b, s, H, D]``, k ``[b, n, D]``,
    w ``[b, s, H]``; the queries are at positions ``0..s-1`` (n = s), or at ``positions [s]`` of the ``n`` keys
    (context parallelism: this rank's chunks against the gathered keys). A chunk of queries at a time, so at
    most ``[chunk, H, n]`` (fp32) or ``[chunk, n]`` (``fp8``: DeepGEMM's ``fp8_mqa_logits`` on Hadamard-rotated
    e4m3 q and k, per-row scales) is alive."""
    b, s = q.shape[:2]
    n = k.shape[1]
    if positions is None:
        positions = torch.arange(s, device=q.device)
    if not fp8:
        return flat_rows(torch.cat([causal_topk(index_scores(q[:, a:a + chunk], k, w[:, a:a + chunk]), topk,
                                                positions=positions[a:a + chunk])
                                    for a in range(0, s, chunk)], dim=1), n)
    rot = hadamard(q.shape[-1], q.device)
    q8, q_scale = deep_gemm.per_token_cast_to_fp8((q.float() @ rot).flatten(0, 2))
    k8, k_scale = deep_gemm.per_token_cast_to_fp8((k.float() @ rot).flatten(0, 1))
    if q_scale.shape[-1] != 1:
        raise ValueError(f"select_rows: FP8 scoring takes index_head_dim <= 128 (one scale per head), got "
                         f"{q.shape[-1]}")
    q8 = q8.view(b * s, -1, q.shape[-1])
    weights = w.flatten(0, 1).float() * q_scale.view(b * s, -1)
    starts = (torch.arange(b, device=q.device, dtype=torch.int32) * n).repeat_interleave(s)
    ends = starts + positions.to(torch.int32).repeat(b) + 1  # each query sees its own sequence's keys up to itself
    rows = []
    for a in range(0, b * s, chunk):
        logits = deep_gemm.fp8_mqa_logits(q8[a:a + chunk], (k8, k_scale.view(-1)), weights[a:a + chunk],
                                          starts[a:a + chunk], ends[a:a + chunk])
        rows.append(deep_gemm.select_topk(logits, min(topk, n)))
    return torch.cat(rows)


def flat_rows(indices: torch.Tensor, n: int) -> torch.Tensor:
    """Key positions ``[b, s, k]`` (-1 invalid) as rows of the batch's keys flattened to ``[b * n]``: ``[b * s, k]``."""
    offset = torch.arange(indices.shape[0], device=indices.device, dtype=indices.dtype)[:, None, None] * n
    return torch.where(indices >= 0, indices + offset, -1).flatten(0, 1)


@torch.no_grad()
def attention_target(q_abs: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float,
                     chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """The indexer's target: the main attention's probabilities over each query's candidate ``rows [T, k]``
    (-1 = none), averaged over its heads (= summed and L1-normalised), fp32 ``[T, k]`` (0 at invalid slots).
    ``q_abs [T, h, 576] . kv [N, 576] * sm_scale`` is the absorbed form's logit; a chunk of queries at a time,
    so ``[chunk, h, k]`` is the most alive. Kept for the loss's backward instead of the queries, which are
    ``h * 576 / k`` times larger (36x at V3.2's sizes)."""
    out = []
    for a in range(0, rows.shape[0], chunk):
        r = rows[a:a + chunk]
        logits = torch.einsum("thc,tkc->thk", q_abs[a:a + chunk].float(), kv[r.clamp_min(0).long()].float())
        out.append((logits * sm_scale).masked_fill((r < 0)[:, None, :], float("-inf")).softmax(-1).mean(1))
    return torch.cat(out)


def _scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``I`` over each query's candidate rows, ``[T, k]`` fp32 (garbage at invalid slots: mask them)."""
    logits = torch.einsum("thd,tkd->thk", q_i.float(), k_i[rows.clamp_min(0).long()].float()).relu()
    return torch.einsum("th,thk->tk", w.float(), logits)


def _kl_chunk(p: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, rows: torch.Tensor
              ) -> torch.Tensor:
    """Summed ``KL(p || softmax(I))`` of a chunk of queries over their candidate rows (-1 = none)."""
    valid = rows >= 0
    log_q = _scores(q_i, k_i, w, rows).masked_fill(~valid, float("-inf")).log_softmax(-1)
    return (torch.xlogy(p, p) - p * log_q.masked_fill(~valid, 0.0)).sum()


def indexer_kl(p: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, rows: torch.Tensor,
               chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """Mean over queries of ``KL(p || softmax(I))`` over each query's candidate keys, differentiable in the
    indexer's ``q_i [T, H, D]``, ``k_i [N, D]`` and ``w [T, H]``; ``p [T, k]`` the target (``attention_target``),
    ``rows [T, k]`` rows of ``k_i`` (-1 = no key). Each chunk of queries is recomputed for its backward, so what
    is kept is the inputs, never the ``[chunk, H, k]`` products."""
    total = q_i.new_zeros((), dtype=torch.float32)
    for a in range(0, rows.shape[0], chunk):
        part = (p[a:a + chunk], q_i[a:a + chunk], k_i, w[a:a + chunk], rows[a:a + chunk])
        total = total + checkpoint(_kl_chunk, *part, use_reentrant=False)
    return total / rows.shape[0]


def _dense_kl_chunk(target: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], start: int, q_i: torch.Tensor,
                    k_i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    p, rows = target(start, q_i.shape[0])
    return _kl_chunk(p, q_i, k_i, w, rows)


def dense_indexer_kl(target: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], q_i: torch.Tensor,
                     k_i: torch.Tensor, w: torch.Tensor, chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """``indexer_kl`` over every causal key (the dense warm-up), with the target made a chunk at a time:
    ``target(start, count) -> (p [count, n], rows [count, n])`` for queries ``start .. start + count``, run again
    in the chunk's backward. Nothing ``[T, n]`` is kept: O(T) memory where a stored target would be O(T s)."""
    total = q_i.new_zeros((), dtype=torch.float32)
    for a in range(0, q_i.shape[0], chunk):
        total = total + checkpoint(_dense_kl_chunk, target, a, q_i[a:a + chunk], k_i, w[a:a + chunk],
                                   use_reentrant=False)
    return total / q_i.shape[0]


@torch.no_grad()
def topk_recall(target: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, topk: int) -> torch.Tensor | None:
    """Mean over queries with more than ``topk`` candidates of the share of ``target``'s top-k candidates
    (the main attention's) that ``scores``' top-k (the indexer's) also holds; None when no query has that many."""
    valid = rows >= 0
    deep = valid.sum(-1) > topk
    if not bool(deep.any()):
        return None
    target, scores, valid = target[deep], scores[deep], valid[deep]
    top_t = target.masked_fill(~valid, float("-inf")).topk(topk, dim=-1).indices
    top_s = scores.masked_fill(~valid, float("-inf")).topk(topk, dim=-1).indices
    hit = torch.zeros_like(valid).scatter_(1, top_s, True).gather(1, top_t)
    return hit.float().mean()


def record_recall(stats: IndexerStats, p: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor,
                  rows: torch.Tensor, topk: int) -> None:
    """Record the top-k recall of the main attention's top keys (by ``p``) by the indexer's, for a chunk of
    queries (``q_i``, ``w``, ``p``, ``rows`` of the same queries) over their candidates; a metric, not a loss."""
    with torch.no_grad():
        recall = topk_recall(p, _scores(q_i, k_i, w, rows), rows, topk)
    if recall is not None:
        stats.record("recall", recall)
