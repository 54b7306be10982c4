"""DeepSeek-V3's router after its fp32 logits GEMM (forward and backward), one program per token: sigmoid,
+ the balancing bias (selection only), group-limited top-k, weights from the unbiased scores, normalised,
times ``route_scale``. V2 / V2-Lite's softmax-scored router (no bias, a group scored by its largest score) is its
twin on the same selection helper.

Groups are the rows of a ``[groups, experts / groups]`` tile. A group's score is the sum of its two largest
biased scores; the ``topk_groups`` best groups stay, the others are masked to -inf. Then the node limit (V3:
at most ``max_nodes`` of ``nodes`` contiguous expert blocks per token), on what the group limit left: a node's
score is the sum of its ``node_best`` largest values, the ``max_nodes`` best nodes stay. Then ``topk`` experts
by repeated arg-max (largest first, as ``torch.topk``; the lower index wins an exact tie, everywhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry

WARPS = 2  # V3's 256 fp32 logits of a token: four (one 128-bit load) per thread


@triton.jit
def _keep_best(score, count: tl.constexpr, BLOCK: tl.constexpr):
    """``[BLOCK]`` bool: the ``count`` largest of ``score [BLOCK]`` (lower index first on a tie)."""
    at = tl.arange(0, BLOCK)
    kept = tl.zeros([BLOCK], tl.int1)
    for _ in tl.static_range(count):  # (-inf scores too are taken one at a time: a node may hold a few finite values)
        best = tl.max(tl.where(kept, float("-inf"), score), axis=0)
        best_at = tl.min(tl.where((score == best) & ~kept, at, BLOCK), axis=0)
        kept = kept | (at == best_at)
    return kept


@triton.jit
def _node_limit(choice, expert, PER_NODE: tl.constexpr, NODES: tl.constexpr, MAX_NODES: tl.constexpr,
                NODE_BEST: tl.constexpr, BLOCK_N: tl.constexpr):
    """``choice [G, E]`` with the experts of all but the ``MAX_NODES`` best nodes masked to -inf. A node (the
    contiguous experts ``[n * PER_NODE, (n + 1) * PER_NODE)``) scores the sum of its ``NODE_BEST`` largest
    values, taken largest first; the node axis is the first of a ``[nodes, G, E]`` tile."""
    node = tl.arange(0, BLOCK_N)[:, None, None]
    mine = (expert // PER_NODE)[None, :, :] == node
    values = tl.where(mine, choice[None, :, :], float("-inf"))
    score = tl.zeros([BLOCK_N], tl.float32)
    for _ in tl.static_range(NODE_BEST):
        best = tl.max(tl.max(values, axis=2), axis=1)
        at = tl.min(tl.min(tl.where(values == best[:, None, None], expert[None, :, :], 1 << 30), axis=2), axis=1)
        score += best
        values = tl.where(expert[None, :, :] == at[:, None, None], float("-inf"), values)
    kept = _keep_best(tl.where(tl.arange(0, BLOCK_N) < NODES, score, float("-inf")), MAX_NODES, BLOCK_N)
    allowed = tl.max(tl.where(mine & kept[:, None, None], 1, 0), axis=0) > 0
    return tl.where(allowed, choice, float("-inf"))


@triton.jit
def _nan_first(choice):
    """A NaN selection score as +inf: ranked first, as ``torch.topk`` ranks NaN, so its (NaN) weight reaches the
    output and the loss. Left NaN it matches no maximum, and a top-k slot would get no expert (an index past the
    last one, or a backend's NaN-ignoring max that hides it)."""
    return tl.where(choice == choice, choice, float("inf"))


@triton.jit
def _tile(GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's token, and the ``[groups, experts / groups]`` tile: (token, lane, expert ids, real lanes)."""
    g = tl.arange(0, BLOCK_G)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    return tl.program_id(0).to(tl.int64), e, g * PER_GROUP + e, (g < GROUPS) & (e < PER_GROUP)


@triton.jit
def _pick(choice, group_score, scores, expert, ok, WEIGHTS, INDICES, t, route_scale, GROUPS: tl.constexpr,
          PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr,
          NODES: tl.constexpr, MAX_NODES: tl.constexpr, NODE_BEST: tl.constexpr, BLOCK_G: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The selection on ``choice`` (group limit by ``group_score``, node limit, top-k) and the weights from
    ``scores``, stored."""
    if GROUPS > 1:
        kept = _keep_best(tl.where(tl.arange(0, BLOCK_G) < GROUPS, group_score, float("-inf")), TOPK_GROUPS, BLOCK_G)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    if MAX_NODES < NODES:
        choice = _node_limit(choice, expert, (GROUPS * PER_GROUP) // NODES, NODES, MAX_NODES, NODE_BEST, BLOCK_N)
    slots = tl.arange(0, BLOCK_K)  # TOPK rounded up to a power of two; the extra slots stay 0 and are not stored
    picked = tl.zeros([BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        at = tl.min(tl.min(tl.where(choice == best, expert, GROUPS * PER_GROUP), axis=1), axis=0)
        picked = tl.where(slots == j, at, picked)
        weight = tl.sum(tl.sum(tl.where(ok & (expert == at), scores, 0.0), axis=1), axis=0)
        weights = tl.where(slots == j, weight, weights)
        choice = tl.where(expert == at, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(WEIGHTS + t * TOPK + slots, weights * route_scale, mask=slots < TOPK)
    tl.store(INDICES + t * TOPK + slots, picked.to(tl.int64), mask=slots < TOPK)


@triton.jit
def _route_kernel(LOGITS, BIAS, WEIGHTS, INDICES, SCORES, E, stride_l, route_scale, GROUPS: tl.constexpr,
                  PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr,
                  NODES: tl.constexpr, MAX_NODES: tl.constexpr, NODE_BEST: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """V3: sigmoid scores, selection on them + the bias, a group scored by its top-2 sum."""
    t, e, expert, ok = _tile(GROUPS, PER_GROUP, BLOCK_G, BLOCK_E)
    logits = tl.load(LOGITS + t * stride_l + expert, mask=ok, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    tl.store(SCORES + t * E + expert, scores, mask=ok)
    choice = _nan_first(tl.where(ok, scores + tl.load(BIAS + expert, mask=ok, other=0.0), float("-inf")))
    first = tl.max(choice, axis=1)
    first_at = tl.min(tl.where(choice == first[:, None], e, BLOCK_E), axis=1)
    second = tl.max(tl.where(e == first_at[:, None], float("-inf"), choice), axis=1)
    _pick(choice, first + second, scores, expert, ok, WEIGHTS, INDICES, t, route_scale, GROUPS, PER_GROUP,
          TOPK_GROUPS, TOPK, NORM, NODES, MAX_NODES, NODE_BEST, BLOCK_G, BLOCK_K, BLOCK_N)


@triton.jit
def _route_softmax_kernel(LOGITS, WEIGHTS, INDICES, SCORES, E, stride_l, route_scale, GROUPS: tl.constexpr,
                          PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr,
                          NODES: tl.constexpr, MAX_NODES: tl.constexpr, NODE_BEST: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """V2 / V2-Lite: softmax scores over the experts, selection on them, a group scored by its largest."""
    t, e, expert, ok = _tile(GROUPS, PER_GROUP, BLOCK_G, BLOCK_E)
    logits = tl.load(LOGITS + t * stride_l + expert, mask=ok, other=float("-inf"))
    p = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
    scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    tl.store(SCORES + t * E + expert, scores, mask=ok)
    choice = _nan_first(tl.where(ok, scores, float("-inf")))
    _pick(choice, tl.max(choice, axis=1), scores, expert, ok, WEIGHTS, INDICES, t, route_scale, GROUPS, PER_GROUP,
          TOPK_GROUPS, TOPK, NORM, NODES, MAX_NODES, NODE_BEST, BLOCK_G, BLOCK_K, BLOCK_N)


@triton.jit
def _scores_grad(SCORES, INDICES, GW, GS, t, E, route_scale, HAS_GS: tl.constexpr, TOPK: tl.constexpr,
                 NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """(experts, real lanes, scores, the scores' gradient: ``d scores`` + the weights' gradient at the picked
    experts, through ``w = s_picked / sum(s_picked) * route_scale``)."""
    experts = tl.arange(0, BLOCK)
    ok = experts < E
    s = tl.load(SCORES + t * E + experts, mask=ok, other=0.0)
    slots = tl.arange(0, BLOCK_K)
    idx = tl.load(INDICES + t * TOPK + slots, mask=slots < TOPK, other=0)
    picked = tl.load(SCORES + t * E + idx, mask=slots < TOPK, other=0.0)
    g = tl.load(GW + t * TOPK + slots, mask=slots < TOPK, other=0.0) * route_scale
    if NORM:
        total = tl.sum(picked, axis=0) + 1e-20
        g = tl.where(slots < TOPK, (g - tl.sum(g * picked, axis=0) / total) / total, 0.0)
    d = tl.sum(tl.where(experts[None, :] == idx[:, None], g[:, None], 0.0), axis=0)
    if HAS_GS:
        d += tl.load(GS + t * E + experts, mask=ok, other=0.0)
    return experts, ok, s, d


@triton.jit
def _route_backward_kernel(SCORES, INDICES, GW, GS, DL, E, route_scale, HAS_GS: tl.constexpr, TOPK: tl.constexpr,
                           NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sigmoid: ``d logits = s (1 - s) d scores``."""
    t = tl.program_id(0).to(tl.int64)
    experts, ok, s, d = _scores_grad(SCORES, INDICES, GW, GS, t, E, route_scale, HAS_GS, TOPK, NORM, BLOCK, BLOCK_K)
    tl.store(DL + t * E + experts, d * s * (1.0 - s), mask=ok)


@triton.jit
def _route_softmax_backward_kernel(SCORES, INDICES, GW, GS, DL, E, route_scale, HAS_GS: tl.constexpr,
                                   TOPK: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax: ``d logits = s (d scores - sum(s d scores))``."""
    t = tl.program_id(0).to(tl.int64)
    experts, ok, s, d = _scores_grad(SCORES, INDICES, GW, GS, t, E, route_scale, HAS_GS, TOPK, NORM, BLOCK, BLOCK_K)
    tl.store(DL + t * E + experts, s * (d - tl.sum(s * d, axis=0)), mask=ok)


def node_best(experts: int, nodes: int, max_nodes: int, topk: int) -> int:
    """How many of a node's largest scores make its score: ``topk / max_nodes`` (V3: 8 / 4 = 2), within the node."""
    return min(experts // nodes, max(1, topk // max_nodes))


def _selection(logits: torch.Tensor, topk: int, groups: int, topk_groups: int, nodes: int, max_nodes: int | None):
    """(outputs, the selection's constexprs) of a forward launch."""
    tokens, experts = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise registry.Unsupported(f"logits must be float32 with contiguous rows, got {logits.dtype}")
    outputs = (registry.empty(tokens, topk, dtype=torch.float32, device=logits.device),
               registry.empty(tokens, topk, dtype=torch.int64, device=logits.device),
               registry.empty(tokens, experts, dtype=torch.float32, device=logits.device))
    max_nodes = nodes if max_nodes is None else max_nodes
    per_group = experts // groups
    return outputs, dict(GROUPS=groups, PER_GROUP=per_group, TOPK_GROUPS=topk_groups, TOPK=topk, NODES=nodes,
                         MAX_NODES=max_nodes, NODE_BEST=node_best(experts, nodes, max_nodes, topk),
                         BLOCK_G=triton.next_power_of_2(groups), BLOCK_E=triton.next_power_of_2(per_group),
                         BLOCK_K=triton.next_power_of_2(topk), BLOCK_N=triton.next_power_of_2(nodes), num_warps=WARPS)


def route(logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
          norm: bool = True, nodes: int = 1, max_nodes: int | None = None):
    """(weights ``[T, topk]`` fp32, indices ``[T, topk]`` int64, scores ``[T, E]`` fp32)."""
    if bias.dtype != torch.float32:
        raise registry.Unsupported(f"bias must be float32, got {bias.dtype}")
    (weights, indices, scores), consts = _selection(logits, topk, groups, topk_groups, nodes, max_nodes)
    if len(logits):
        registry.wrap_triton(_route_kernel)[(len(logits),)](logits, bias, weights, indices, scores, logits.shape[1],
                                                            logits.stride(0), route_scale, NORM=norm, **consts)
    return weights, indices, scores


def route_softmax(logits: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
                  norm: bool = True, nodes: int = 1, max_nodes: int | None = None):
    """(weights ``[T, topk]`` fp32, indices ``[T, topk]`` int64, scores ``[T, E]`` fp32)."""
    (weights, indices, scores), consts = _selection(logits, topk, groups, topk_groups, nodes, max_nodes)
    if len(logits):
        registry.wrap_triton(_route_softmax_kernel)[(len(logits),)](logits, weights, indices, scores, logits.shape[1],
                                                                    logits.stride(0), route_scale, NORM=norm, **consts)
    return weights, indices, scores


def _backward(kernel, scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
              grad_scores: torch.Tensor | None, route_scale: float, norm: bool) -> torch.Tensor:
    tokens, experts = scores.shape
    topk = indices.shape[1]
    if not all(t.is_contiguous() for t in (scores, indices, grad_weights)):
        raise registry.Unsupported("scores, indices and grad_weights must be contiguous")
    if grad_scores is not None and not grad_scores.is_contiguous():
        raise registry.Unsupported("grad_scores must be contiguous")
    dl = registry.empty(tokens, experts, dtype=torch.float32, device=scores.device)
    if tokens:
        registry.wrap_triton(kernel)[(tokens,)](scores, indices, grad_weights,
                                                scores if grad_scores is None else grad_scores, dl, experts,
                                                route_scale, HAS_GS=grad_scores is not None, TOPK=topk, NORM=norm,
                                                BLOCK=triton.next_power_of_2(experts),
                                                BLOCK_K=triton.next_power_of_2(topk), num_warps=WARPS)
    return dl


def route_backward(scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
                   grad_scores: torch.Tensor | None, route_scale: float, norm: bool = True) -> torch.Tensor:
    """The logits' gradient ``[T, E]`` fp32 from the weights' (and optionally the scores') gradient, sigmoid."""
    return _backward(_route_backward_kernel, scores, indices, grad_weights, grad_scores, route_scale, norm)


def route_softmax_backward(scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
                           grad_scores: torch.Tensor | None, route_scale: float, norm: bool = True) -> torch.Tensor:
    """The same through the softmax."""
    return _backward(_route_softmax_backward_kernel, scores, indices, grad_weights, grad_scores, route_scale, norm)
