"""DeepSeekMoE: router (``Gate``), routed experts as grouped GEMMs (``Experts``), shared experts (``MoE``).

``MoE.forward`` is four separately callable steps so that expert parallelism can replace the
middle two with all-to-all dispatch/combine and a pipeline schedule can interleave them with
another micro-batch's compute::

    routing = moe.route(x)                                  # Gate: fp32 scores, top-k, weights
    x_grouped, m_indices, state = moe.permute(x, routing)   # rows grouped by expert, padded
    w = group_weights(routing.weights, state, len(m_indices))  # each row's routing weight (0 on pad rows)
    y_grouped = moe.experts(x_grouped, m_indices, w)        # w13, SwiGLU scaled by w, w2
    y = moe.unpermute(y_grouped, state)                     # back to token order, summed over the top-k
    y = y + moe.shared(x)

The routing weights scale the SwiGLU output before ``w2`` (as DeepSeek-V3 and Megatron-Core do), not
the expert outputs after it: the same sum, since ``w2`` is linear, but backward then needs only the
per-row weight and the SwiGLU input (kept anyway) instead of the ``[tokens * top-k, dim]`` expert
outputs for the weights' gradient.

The grouped layout is DeepGEMM's "contiguous" one: each expert's rows form one block padded to
``deep_gemm.get_m_alignment_for_contiguous_layout()`` rows, pad rows carry expert index -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

import deep_gemm
import fused_ops
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.balancing import BalanceConfig, ExpertBalancer, check_expert_biases, node_limited_mask
from models.deepseek_v3.expert_parallel import ExpertParallel, Received, SendPlan, arrived
from models.deepseek_v3.layers import MLP, Precast, SwiGLU, grouped_linear
from models.deepseek_v3.permute import PermuteState, group_weights, permute, permute_fp8, unpermute


@dataclass
class Routing:
    """What the router decided for ``T`` tokens (all fp32 except ``indices``)."""

    weights: torch.Tensor  # [T, k] gate weights from the unbiased scores, normalised, x route_scale
    indices: torch.Tensor  # [T, k] int64 expert ids chosen on the biased, group-limited scores
    scores: torch.Tensor  # [T, E] unbiased sigmoid/softmax scores (balance losses use these)
    logits: torch.Tensor  # [T, E] router logits


class _Fp32Logits(torch.autograd.Function):
    """``F.linear(x.float(), weight.float())``, the router's fp32 logits, saving ``x`` itself rather than its
    fp32 copy (for bf16 activations autograd would keep 4 bytes per value beside the 2-byte ``x``, which
    under norm recompute is not even kept). Same arithmetic forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad.flatten(0, -2).T @ x.flatten(0, -2).float()).to(weight.dtype)
        return grad_x, grad_w


class Gate(nn.Module):
    """DeepSeek-V3 router.

    Logits in fp32 -> sigmoid (or softmax) scores -> selection on scores + ``e_score_correction_bias``
    (auxiliary-loss-free balancing; it never touches the gate weights) -> group-limited routing
    (group score = sum of the group's top-2 biased scores, or its max without a bias; losing groups
    masked to -inf) -> node-limited routing when asked (``balancing.node_limited_mask`` on what the group limit
    left) -> top-k -> weights gathered from the *unbiased* scores, normalised (sigmoid), times ``route_scale``.
    With ``args.fused_ops`` all of that after the logits runs as one kernel each way where it runs:
    ``fused_ops.route`` (sigmoid, with the bias) or ``fused_ops.route_softmax`` (softmax, no bias).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fused = args.fused_ops
        self.dim, self.topk = args.dim, args.n_activated_experts
        self.n_experts, self.n_groups = args.n_routed_experts, args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.score_func, self.route_scale, self.norm_topk_prob = args.score_func, args.route_scale, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if args.score_func == "sigmoid":
            # A buffer: updated by the balancing rule (sign of load error), never by gradients. Always fp32.
            self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, node_limit: tuple[int, int] | None = None) -> Routing:
        """x ``[T, dim]`` -> ``Routing``. ``node_limit = (num_nodes, max_nodes)``: each token's experts on at most
        ``max_nodes`` of ``num_nodes`` contiguous expert blocks (``ExpertBalancer.node_limit``)."""
        logits = _Fp32Logits.apply(x, self.weight)
        # (not on the meta device: the memory model's unfused top-k gets balanced index values; it keeps at
        # least what the fused router keeps, its scores and indices)
        if self.fused and fused_ops.kernels_run(logits.device) and not logits.is_meta:
            nodes, max_nodes = node_limit or (1, None)
            limits = (self.topk, self.n_groups, self.topk_groups, self.route_scale, self.norm_topk_prob, nodes,
                      max_nodes)
            if self.e_score_correction_bias is not None:  # sigmoid (V3)
                weights, indices, scores = fused_ops.route(logits, self.e_score_correction_bias, *limits)
            else:  # softmax (V2)
                weights, indices, scores = fused_ops.route_softmax(logits, *limits)
            return Routing(weights=weights, indices=indices, scores=scores, logits=logits)
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_groups > 1:
            grouped = choice.view(-1, self.n_groups, self.n_experts // self.n_groups)
            if self.e_score_correction_bias is None:
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            losing = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
            choice = grouped.masked_fill(losing.unsqueeze(-1), float("-inf")).flatten(1)
        if node_limit is not None:
            choice = choice.masked_fill(~node_limited_mask(choice, *node_limit, self.topk), float("-inf"))
        indices = choice.topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights=weights * self.route_scale, indices=indices, scores=scores, logits=logits)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)


class Experts(nn.Module):
    """The routed experts ``expert_ids`` (all by default; an expert-parallel rank holds a slice).

    ``w13`` ``[E, 2 * inter, dim]`` is each expert's fused gate/up projection, ``w2`` ``[E, dim, inter]``
    its down projection: one grouped GEMM each over the contiguous grouped layout.

    ``expert_ids`` is a contiguous range (a plain expert-parallel slice) or, under EPLB, the logical
    expert of each physical slot this rank hosts (a sequence; an id may repeat: replicas of a hot
    expert). Row ``i`` of ``w13``/``w2`` is slot ``i``.

    Under FP8 activation caching (``args.fp8_cache``) ``w13`` keeps its input (the dispatched tokens) as its
    e4m3 cast, as in the V3 report (3.3.3); the memory policy keeps the SwiGLU input in FP8 and remakes its
    output for ``w2``.
    """

    def __init__(self, args: ModelArgs, expert_ids: range | Sequence[int] | None = None):
        super().__init__()
        n_experts = args.n_routed_experts
        self.expert_ids = range(n_experts) if expert_ids is None else expert_ids
        if isinstance(self.expert_ids, range):
            if not (0 <= self.expert_ids.start <= self.expert_ids.stop <= n_experts and self.expert_ids.step == 1):
                raise ValueError(f"Experts: expert_ids must be a contiguous range within [0, {n_experts}), "
                                 f"got {self.expert_ids}")
        else:
            self.expert_ids = tuple(int(e) for e in self.expert_ids)
            if not self.expert_ids or not all(0 <= e < n_experts for e in self.expert_ids):
                raise ValueError(f"Experts: expert_ids (physical slots) must be logical ids in [0, {n_experts}), "
                                 f"got {self.expert_ids}")
        n = len(self.expert_ids)
        self.dim, self.inter_dim, self.fp8 = args.dim, args.moe_inter_dim, args.fp8
        self.fp8_cache = args.fp8_cache
        self.weight_format = args.expert_weight_format
        self.act = SwiGLU(args.fused_ops)
        self.health = None  # deep_gemm.health.Fp8Health, set by its attach
        self.w13 = nn.Parameter(torch.empty(n, 2 * args.moe_inter_dim, args.dim))
        self.w2 = nn.Parameter(torch.empty(n, args.dim, args.moe_inter_dim))

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)

    def forward(self, x_grouped: torch.Tensor, m_indices: torch.Tensor, weights: torch.Tensor | None = None,
                x_fp8: Precast | None = None) -> torch.Tensor:
        """``x_grouped`` ``[M, dim]`` in the contiguous layout, ``m_indices`` ``[M]`` local expert id or -1;
        ``weights`` ``[M]`` (optional) scale each row's SwiGLU output before ``w2`` (the routing weights).
        ``x_fp8``: the rows' 1x128 cast made on the way (the FP8 permute or dispatch), read by ``w13``."""
        if x_grouped.shape[0] == 0:  # an EP rank no token chose: stay in the graph (backward all-to-alls pair up)
            return x_grouped * 0
        h = grouped_linear(x_grouped, self.w13, m_indices, fp8=self.fp8, fp8_cache=self.fp8_cache, health=self.health,
                           x_fp8=x_fp8, weight_format=self.weight_format)
        # no fp8_cache for w2: under caching the memory policy remakes its input
        return grouped_linear(self.act(h, weights), self.w2, m_indices, fp8=self.fp8, health=self.health,
                              weight_format=self.weight_format)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.w13, std=std)
        nn.init.normal_(self.w2, std=std)


class MoE(nn.Module):
    """DeepSeekMoE layer: routed experts (top-k of ``n_routed_experts``) plus always-on shared experts.

    ``balance`` (``balancing.BalanceConfig``) picks the balancing strategy; ``self.balancer`` applies
    it in ``route`` and counts the load. Under expert parallelism the layer holds its rank's slice
    (``expert_ids``) and ``ep`` is set to an ``expert_parallel.ExpertParallel`` over the group
    (``training.experts.wire_moe_layers``): its all-to-alls replace permute/unpermute.
    """

    fixed_routing = False  # True where tokens go to fixed experts (V4's hash layers): the balancer only measures

    def __init__(self, args: ModelArgs, layer_id: int = 0, expert_ids: range | None = None,
                 balance: BalanceConfig | None = None):
        super().__init__()
        self.ep: ExpertParallel | None = None
        self.layer_id, self.dim = layer_id, args.dim
        self.gate = Gate(args)
        self.experts = Experts(args, expert_ids)
        self.shared_experts = (MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, fp8=args.fp8,
                                   fp8_cache=args.fp8_cache,
                                   input_recomputed=args.recomputes("norm", layer_id), fused=args.fused_ops)
                               if args.n_shared_experts else None)
        self.n_routed_experts, self.fused = args.n_routed_experts, args.fused_ops
        self.m_alignment = deep_gemm.get_m_alignment_for_contiguous_layout()
        if balance is None:  # aux-loss-free where the gate has its bias (V3), else measure only
            balance = BalanceConfig(strategy="aux_free" if self.gate.e_score_correction_bias is not None else "none")
        self.balancer = ExpertBalancer(args.n_routed_experts, args.n_activated_experts, balance)
        check_expert_biases(self)
        # rows this rank's expert slots received through expert parallelism since the last read (training
        # forwards only): the per-GPU load that EPLB balances, as opposed to the per-expert load above
        self.received_rows: torch.Tensor | None = None  # a 0-d tensor once counted (no host sync per forward)

    # ---- the steps --------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, seq_len: int | None = None) -> Routing:
        """x ``[T, dim]`` -> Routing, after the balancing strategy (capacity drops leave index -1, weight 0).

        seq_len: tokens per sequence (the sequence-wise balance loss); None = one sequence.
        """
        routing = self.gate(x, self.balancer.node_limit)
        indices, weights = self.balancer(routing.scores, routing.logits, routing.indices, routing.weights, seq_len)
        return replace(routing, indices=indices, weights=weights)

    def permute(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, PermuteState]:
        """Local (single-rank) dispatch: every chosen expert must live in ``self.experts``."""
        x_grouped, m_indices, state = self._grouped(
            routing, lambda indices, groups: permute(x, indices, groups, self.m_alignment, self.fused))
        return x_grouped, m_indices, state

    def permute_fp8(self, x: torch.Tensor, routing: Routing, x_fp8: Precast | None = None
                    ) -> tuple[torch.Tensor, Precast, torch.Tensor, PermuteState]:
        """``permute`` where ``takes_fp8_rows``: ``(x_grouped stand-in, the rows' 1x128 cast, m_indices, state)``,
        the rows moved once as e4m3 (cast on the way, or ``x_fp8``, x's cast, moved with its scales); see
        ``permute.permute_fp8``."""
        return self._grouped(routing, lambda indices, groups: permute_fp8(x, indices, groups, self.m_alignment,
                                                                            x_fp8))

    def takes_fp8_rows(self, device: torch.device) -> bool:
        """Whether the routed experts take their rows as the fused permute's FP8 cast without bf16 rows: GEMMs that
        read nothing but that cast (``deep_gemm.reads_only_precast``) and the fused kernels running to make it."""
        experts = self.experts
        return (deep_gemm.reads_only_precast(experts.fp8, experts.fp8_cache, experts.health)
                and self.fused and fused_ops.kernels_run(device))

    def _grouped(self, routing: Routing, run):
        """``run(indices, groups)`` (a permute) over ``routing``'s experts, all in ``self.experts``: dropped
        assignments (-1, capacity) go to a sentinel group past the real experts, whose rows become padding (-1)."""
        if self.experts.num_experts != self.n_routed_experts:
            raise ValueError(f"MoE.permute: this layer holds experts {self.experts.expert_ids} of "
                             f"{self.n_routed_experts}; tokens must be dispatched across expert-parallel ranks")
        if self.balancer.config.capacity_factor is None:
            return run(routing.indices, self.n_routed_experts)
        dropped = self.n_routed_experts
        indices = torch.where(routing.indices >= 0, routing.indices, torch.full_like(routing.indices, dropped))
        *grouped, m_indices, state = run(indices, self.n_routed_experts + 1)
        m_indices = m_indices.masked_fill(m_indices == dropped, -1)
        return (*grouped, m_indices, replace(state, tokens_per_expert=state.tokens_per_expert[:dropped]))

    def unpermute(self, y_grouped: torch.Tensor, state: PermuteState,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
        return unpermute(y_grouped, state, weights)

    def shared(self, x: torch.Tensor, x_fp8: Precast | None = None) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x, x_fp8)

    # ---- expert parallelism: the pieces between the all-to-alls -----------------------------------
    def send(self, x: torch.Tensor, seq_len: int | None = None,
             x_fp8: Precast | None = None) -> tuple[torch.Tensor, SendPlan, torch.Tensor | None]:
        """Before the dispatch: route ``x [T, dim]``, gather the rows to send (routing weights as extra columns)
        and run the shared experts. Returns ``(rows to send, their plan, shared output or None)``.

        ``x_fp8``: ``x``'s 1x128 cast (e4m3 values, fp32 scales), made by the norm that produced ``x``: under FP8
        dispatch with fused kernels the rows travel as a gather of it (no cast); the shared experts' ``w13``
        reads it too."""
        routing = self.route(x, seq_len)
        send, plan = self.ep.gather(x, routing.weights, self.ep.plan_send(routing.indices), x_fp8)
        return send, plan, self.shared(x, x_fp8)

    def expert_rows(self, rows: torch.Tensor, received: Received) -> torch.Tensor:
        """Between the dispatch and the combine: this rank's experts on the rows that arrived (arrival order in
        and out), each scaled by the routing weight that travelled with it; counts them."""
        if self.training:
            n = received.tokens_per_expert.sum().double()
            self.received_rows = n if self.received_rows is None else self.received_rows + n
        # the landed FP8 rows' cast, made on the way, feeds w13 where the GEMM takes a 1x128 precast; the bf16
        # grouped rows are not even written where it reads only that cast (fp8_cache)
        experts = self.experts
        keep_rows = not deep_gemm.reads_only_precast(experts.fp8, experts.fp8_cache, experts.health)
        x_grouped, weights, x_fp8 = self.ep.regroup(rows, received, keep_rows=keep_rows)
        # (Experts returns x * 0 when no token chose this rank: the backward all-to-alls still pair up)
        return self.ep.ungroup(self.experts(x_grouped, received.m_indices, weights, x_fp8=x_fp8), received)

    def combined(self, rows: torch.Tensor, plan: SendPlan, shared: torch.Tensor | None) -> torch.Tensor:
        """After the combine: each token's sum over its experts' returned rows, plus the shared experts."""
        y = self.ep.scatter_back(rows, plan)
        return y if shared is None else y + shared

    # ---- all together -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, x_fp8: Precast | None = None) -> torch.Tensor:
        """``x [..., dim]`` -> routed experts' weighted sum plus the shared experts, same shape. ``x_fp8``: x's
        1x128 cast made by its producer (the norm; rows flattened): the shared experts' ``w13`` reads it and, on
        one rank, the routed experts' rows are gathered from it (where ``takes_fp8_rows``)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        seq_len = shape[-2] if len(shape) == 3 else None
        if self.ep is None:
            routing = self.route(x, seq_len)
            rows_fp8 = None
            if self.takes_fp8_rows(x.device):
                x_grouped, rows_fp8, m_indices, state = self.permute_fp8(x, routing, x_fp8)
            else:
                x_grouped, m_indices, state = self.permute(x, routing)
            rows = group_weights(routing.weights, state, len(m_indices))
            y = self.unpermute(self.experts(x_grouped, m_indices, rows, x_fp8=rows_fp8), state)
            z = self.shared(x, x_fp8)
            return (y if z is None else y + z).view(shape)
        send, plan, z = self.send(x, seq_len, x_fp8)
        received = self.ep.post_dispatch(send, plan, self.dim).wait()
        y = self.expert_rows(arrived(send, received.rows, received.exchanged), received)
        back = self.ep.post_combine(y, received).wait()
        return self.combined(arrived(y, back.rows, back.exchanged), plan, z).view(shape)
