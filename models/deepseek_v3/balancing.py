"""Expert load balancing for DeepSeek-V3's MoE: strategies, routing limits, capacity, load metrics.

Strategies (``BalanceConfig.strategy``, parts joined with ``+``):

- ``aux_free``  - DeepSeek-V3's auxiliary-loss-free balancing: a per-expert fp32 bias added to the
  scores for *selection only*, updated after each optimizer step by
  ``bias += gamma * sign(mean_load - load)`` over the whole global batch (``update_expert_biases``).
- ``seq_aux``   - the V3 report's complementary sequence-wise balance loss
  ``alpha * sum_i f_i P_i`` per sequence (averaged over sequences), with
  ``f_i = N_r / (K_r T) * #{t : i in topK(t)}`` and ``P_i = mean_t s'_{i,t}``, ``s'`` the scores
  normalised over experts.
- ``aux``       - the GShard/Switch batch-wise auxiliary loss: the same formula over the whole batch.
- ``z_loss``    - the router z-loss of ST-MoE: ``coeff * mean_t logsumexp(logits_t)^2``.
- ``none``      - nothing (the load is still measured).

Losses computed inside a layer reach the optimizer without being threaded through the pipeline:
``attach_aux_loss`` (Megatron's ``MoEAuxLossAutoScaler`` trick) ties the loss to an activation so
the loss's gradient is produced when the activation's backward runs.

Node-limited routing (V3: each token to experts on at most ``M = 4`` nodes) and an optional
capacity factor with token dropping (V3 drops none) live here too, as do the load metrics
(counts, MaxVio per batch and global, entropy, dropped tokens) and the trainer hooks
``update_expert_biases`` and ``collect_load_metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

STRATEGY_PARTS = ("none", "aux_free", "seq_aux", "aux", "z_loss")
DROP_POLICIES = ("probs", "position")


@dataclass
class BalanceConfig:
    """How one run balances its experts (one config for every MoE layer).

    strategy: parts of ``STRATEGY_PARTS`` joined by ``+`` (e.g. ``"aux_free+seq_aux"``).
    alpha: coefficient of the ``seq_aux`` / ``aux`` balance loss (V3: 1e-4 sequence-wise).
    z_loss_coeff: coefficient of the router z-loss (ST-MoE: 1e-3).
    gamma: bias update speed of ``aux_free`` (V3: 1e-3, then 0 late in training).
    gamma_stop_step: the optimizer step from which the trainer updates the biases with gamma 0 (V3: the
        last 500B tokens); 0 = never. The model does not read it.
    recenter: subtract the mean bias after each update, so the biases stay centred on zero.
    num_nodes / max_nodes: experts split into ``num_nodes`` contiguous blocks (one per node or
        device); each token may use experts on at most ``max_nodes`` of them (V3: 4). None = no limit.
    capacity_factor: None = no dropping (V3); else each expert keeps at most
        ``ceil(capacity_factor * tokens * top_k / experts)`` assignments per forward.
    drop_policy: which assignments an over-full expert keeps: ``probs`` (highest routing weight)
        or ``position`` (earliest tokens, Switch-style).
    """

    strategy: str = "aux_free"
    alpha: float = 1e-4
    z_loss_coeff: float = 1e-3
    gamma: float = 1e-3
    gamma_stop_step: int = 0
    recenter: bool = False
    num_nodes: int = 1
    max_nodes: int | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"

    def __post_init__(self) -> None:
        parts = self.parts
        unknown = sorted(parts - set(STRATEGY_PARTS))
        if unknown:
            raise ValueError(f"BalanceConfig.strategy={self.strategy!r}: unknown part(s) {unknown}; "
                             f"expected parts of {STRATEGY_PARTS} joined by '+'")
        if "none" in parts and len(parts) > 1:
            raise ValueError(f"BalanceConfig.strategy={self.strategy!r}: 'none' cannot be combined with other parts")
        if "seq_aux" in parts and "aux" in parts:
            raise ValueError(f"BalanceConfig.strategy={self.strategy!r}: choose one of 'seq_aux' and 'aux'")
        for name in ("alpha", "z_loss_coeff", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"BalanceConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_nodes < 1:
            raise ValueError(f"BalanceConfig.num_nodes must be >= 1, got {self.num_nodes}")
        if self.max_nodes is not None and not 1 <= self.max_nodes:
            raise ValueError(f"BalanceConfig.max_nodes must be >= 1 or None, got {self.max_nodes}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"BalanceConfig.capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"BalanceConfig.drop_policy={self.drop_policy!r}; expected one of {DROP_POLICIES}")

    @property
    def parts(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.strategy.split("+") if p.strip()) or frozenset({"none"})

    @property
    def uses_bias(self) -> bool:
        """Whether selection adds the aux-loss-free correction bias (and the trainer must update it)."""
        return "aux_free" in self.parts

    def validate_for(self, num_experts: int, top_k: int) -> None:
        """Raise ValueError now, before training, for a config this MoE layer cannot route with."""
        if num_experts % self.num_nodes:
            raise ValueError(f"BalanceConfig.num_nodes={self.num_nodes} must divide the number of routed experts "
                             f"({num_experts})")
        if self.max_nodes is not None:
            if self.max_nodes > self.num_nodes:
                raise ValueError(f"BalanceConfig.max_nodes={self.max_nodes} exceeds num_nodes={self.num_nodes}")
            reachable = self.max_nodes * (num_experts // self.num_nodes)
            if top_k > reachable:
                raise ValueError(f"top-k={top_k} is larger than the {reachable} experts reachable under the node "
                                 f"limit (max_nodes={self.max_nodes} of num_nodes={self.num_nodes}, "
                                 f"{num_experts // self.num_nodes} experts each)")


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------

def balance_loss(scores: torch.Tensor, indices: torch.Tensor, num_experts: int, seq_len: int | None = None,
                 valid: torch.Tensor | None = None, total: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """``sum_i f_i P_i`` (no coefficient), averaged over groups of ``seq_len`` consecutive tokens.

    scores: [T, E] affinities (sigmoid or softmax); they are normalised over experts here (the V3
        report's ``s'``), which leaves softmax probabilities unchanged.
    indices: [T, K] selected experts. seq_len: tokens per sequence (``seq_aux``); None = the whole
        batch is one group (``aux``, GShard/Switch). ``f_i = E / (K T) * count_i`` so a perfectly
        balanced router gives ``f_i = 1`` and the loss equals ``sum_i P_i = 1``.
    valid: optional [T] bool of tokens that count (padding excluded).
    total: context parallelism: sums a tensor over the ranks holding the other parts of these sequences (each
        group's expert counts and tokens); ``f`` is then the whole sequences' and ``P`` this rank's tokens' part
        of it, so the loss is this rank's share and the shares sum to the whole sequences' loss.
    """
    tokens, top_k = indices.shape
    seq_len = tokens if seq_len is None else seq_len
    if seq_len <= 0 or tokens % seq_len:
        raise ValueError(f"balance_loss: seq_len={seq_len} must divide the number of tokens ({tokens})")
    probs = scores.float() / scores.float().sum(-1, keepdim=True).clamp_min(1e-20)
    weight = torch.ones(tokens, device=scores.device) if valid is None else valid.float()
    groups = tokens // seq_len
    hits = torch.zeros(tokens, num_experts, device=scores.device).scatter_(1, indices.clamp_min(0), 1.0)
    hits = hits * weight[:, None]
    counts, weight_g = hits.view(groups, seq_len, num_experts).sum(1), weight.view(groups, seq_len).sum(-1)
    if total is not None:
        both = total(torch.cat([counts, weight_g[:, None]], dim=1))
        counts, weight_g = both[:, :-1], both[:, -1]
    weight_g = weight_g.clamp_min(1.0)  # tokens per group
    f = counts * (num_experts / top_k) / weight_g[:, None]
    p = (probs * weight[:, None]).view(groups, seq_len, num_experts).sum(1) / weight_g[:, None]
    return (f.detach() * p).sum(-1).mean()


def z_loss(logits: torch.Tensor, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2`` in fp32 (no coefficient). ``total`` (context
    parallelism, see ``balance_loss``): the sum over this rank's tokens divided by the whole group's count."""
    squares = torch.logsumexp(logits.float(), dim=-1).square()
    if total is None:
        return squares.mean()
    return squares.sum() / total(torch.tensor([float(squares.numel())], device=squares.device))[0]


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends gradient 1 into ``aux_loss``.

    Megatron-Core's trick under its name: a loss computed inside a layer gets its gradient when the
    layer's activation is back-propagated, so pipeline schedules never carry it. The gradient is 1,
    as for the main loss: a trainer that averages micro-batches scales every gradient afterwards
    (``training.trainer``), so no scale is kept here (Megatron keeps a process-global one).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def attach_aux_loss(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Return ``activation`` unchanged, with ``loss`` riding on its backward (see MoEAuxLossAutoScaler)."""
    if not (loss.requires_grad and torch.is_grad_enabled()):
        return activation
    return MoEAuxLossAutoScaler.apply(activation, loss)


# ---------------------------------------------------------------------------------------------
# Routing limits
# ---------------------------------------------------------------------------------------------

def node_limited_mask(scores: torch.Tensor, num_nodes: int, max_nodes: int, top_k: int) -> torch.Tensor:
    """[T, E] bool: experts a token may pick when it may reach at most ``max_nodes`` of ``num_nodes``.

    As in the V3 report, nodes are ranked by the sum of their ``top_k // max_nodes`` highest
    (selection) scores; experts are laid out node-major (node n holds a contiguous block).
    """
    tokens, num_experts = scores.shape
    if num_experts % num_nodes:
        raise ValueError(f"node_limited_mask: num_nodes={num_nodes} must divide the experts ({num_experts})")
    if not 1 <= max_nodes <= num_nodes:
        raise ValueError(f"node_limited_mask: max_nodes={max_nodes} must be in [1, num_nodes={num_nodes}]")
    per_node = num_experts // num_nodes
    if top_k > max_nodes * per_node:
        raise ValueError(f"node_limited_mask: top_k={top_k} > {max_nodes * per_node} experts reachable")
    if max_nodes == num_nodes:
        return torch.ones_like(scores, dtype=torch.bool)
    best = min(per_node, max(1, top_k // max_nodes))
    node_score = scores.view(tokens, num_nodes, per_node).topk(best, dim=-1).values.sum(-1)
    chosen = node_score.topk(max_nodes, dim=-1).indices
    node_mask = torch.zeros(tokens, num_nodes, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
    return node_mask.repeat_interleave(per_node, dim=1)


def capacity_keep_mask(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float,
                       policy: str = "probs") -> torch.Tensor:
    """[T, K] bool: the assignments kept when each expert takes at most ``ceil(cf * T * K / E)`` of them.

    ``probs`` keeps an over-full expert's highest-weight assignments, ``position`` its earliest
    tokens. Ties keep the earlier token, so the result is deterministic.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"capacity_keep_mask: policy={policy!r}; expected one of {DROP_POLICIES}")
    tokens, top_k = indices.shape
    capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
    flat_expert = indices.reshape(-1)
    n = flat_expert.numel()
    if policy == "probs":
        order = torch.sort(-weights.detach().reshape(-1).float(), stable=True).indices
    else:
        order = torch.arange(n, device=indices.device)
    # stable sort by expert keeps the preference order inside each expert
    by_expert = order[torch.sort(flat_expert[order], stable=True).indices]
    sorted_expert = flat_expert[by_expert]
    counts = torch.bincount(sorted_expert.clamp_min(0), minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=indices.device) - starts[sorted_expert.clamp_min(0)]
    keep = torch.empty(n, dtype=torch.bool, device=indices.device)
    keep[by_expert] = (rank_in_expert < capacity) & (sorted_expert >= 0)
    return keep.view(tokens, top_k)


# ---------------------------------------------------------------------------------------------
# Load metrics
# ---------------------------------------------------------------------------------------------

def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (fp32 [E]); entries < 0 (dropped) are not counted."""
    flat = indices.reshape(-1)
    flat = flat[flat >= 0]
    return torch.bincount(flat, minlength=num_experts).float()


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """MaxVio = max load / mean load - 1 over the last dim (0 = perfectly balanced)."""
    counts = counts.double()
    return counts.amax(-1) / counts.mean(-1).clamp_min(1e-12) - 1.0


def load_entropy(counts: torch.Tensor) -> torch.Tensor:
    """Entropy of the load distribution over experts, normalised to [0, 1] (1 = uniform)."""
    counts = counts.double()
    p = counts / counts.sum(-1, keepdim=True).clamp_min(1e-12)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return ent / math.log(counts.shape[-1]) if counts.shape[-1] > 1 else torch.zeros_like(ent)


class ExpertBalancer(nn.Module):
    """Per-MoE-layer balancing state: applies the strategy to one routing and records the load.

    The MoE hands ``node_limit`` to its gate (which limits selection before top-k), then calls ``forward`` on the
    top-k result; ``forward`` drops over-capacity assignments (index set to -1, weight 0),
    attaches the configured losses to the returned weights, and counts the load (training only).
    The aux-loss-free bias itself belongs to the gate (it is checkpointed with it); the trainer
    updates it through ``update_expert_biases``.
    """

    def __init__(self, num_experts: int, top_k: int, config: BalanceConfig | None = None) -> None:
        super().__init__()
        self.config = config or BalanceConfig()
        self.config.validate_for(num_experts, top_k)
        self.num_experts, self.top_k = num_experts, top_k
        # Plain tensors, not buffers: never checkpointed, and untouched by meta-device construction
        # and ``to_empty``; they follow the routing's device on first use (``_counters_on``).
        self.counts_for_update = torch.zeros(num_experts, device="cpu")  # since the last bias update
        self.counts_for_metrics = torch.zeros(num_experts, device="cpu")  # since the last metrics collection
        self.counts_total = torch.zeros(num_experts, dtype=torch.float64, device="cpu")  # since start
        self.dropped = torch.zeros((), dtype=torch.int64, device="cpu")
        # counted in tensors, not Python ints: a compiled forward would guard on (and recompile for) every value
        self.assignments = torch.zeros((), dtype=torch.int64, device="cpu")
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.loss_calls = torch.zeros((), dtype=torch.int64, device="cpu")
        # context parallelism (``context_parallel.ContextParallel``, set once by the trainer): the balance losses
        # count the experts over the ranks sharing each sequence and are this rank's share
        self.cp = None

    def _counters_on(self, device: torch.device) -> None:
        if self.counts_for_update.device != device:
            self.counts_for_update = torch.zeros(self.num_experts, device=device)
            self.counts_for_metrics = torch.zeros(self.num_experts, device=device)
            self.counts_total = torch.zeros(self.num_experts, dtype=torch.float64, device=device)
            self.dropped = torch.zeros((), dtype=torch.int64, device=device)
            self.assignments = torch.zeros((), dtype=torch.int64, device=device)
            self.loss_calls = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def node_limit(self) -> tuple[int, int] | None:
        """``(num_nodes, max_nodes)`` when selection is node-limited (``node_limited_mask`` restricts anything),
        else None."""
        cfg = self.config
        return (cfg.num_nodes, cfg.max_nodes) if cfg.max_nodes is not None and cfg.max_nodes < cfg.num_nodes else None

    def forward(self, scores: torch.Tensor, logits: torch.Tensor | None, indices: torch.Tensor,
                weights: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply capacity, losses and load counting to one routing; return (indices, weights).

        scores: [T, E] unbiased affinities; logits: [T, E] pre-activation router output (z-loss);
        indices / weights: [T, K] from the gate; seq_len: tokens per sequence for ``seq_aux``.
        """
        cfg = self.config
        parts = cfg.parts
        losses: dict[str, torch.Tensor] = {}
        total = None if self.cp is None else self.cp.sum  # context parallelism: over the ranks sharing the sequences
        if "seq_aux" in parts and cfg.alpha > 0:
            losses["seq_aux"] = cfg.alpha * balance_loss(scores, indices, self.num_experts, seq_len, total=total)
        if "aux" in parts and cfg.alpha > 0:
            losses["aux"] = cfg.alpha * balance_loss(scores, indices, self.num_experts, None, total=total)
        if "z_loss" in parts and cfg.z_loss_coeff > 0:
            if logits is None:
                raise ValueError("strategy 'z_loss' needs the router logits; the gate passed None")
            losses["z_loss"] = cfg.z_loss_coeff * z_loss(logits, total)
        if cfg.capacity_factor is not None:
            keep = capacity_keep_mask(indices, weights, self.num_experts, cfg.capacity_factor, cfg.drop_policy)
            indices = torch.where(keep, indices, torch.full_like(indices, -1))
            weights = weights * keep.to(weights.dtype)
        if losses:
            weights = attach_aux_loss(weights, sum(losses.values()))
        if self.training:
            self.record(indices, losses)
        return indices, weights

    @torch.no_grad()
    def record(self, indices: torch.Tensor, losses: dict[str, torch.Tensor] | None = None) -> None:
        """Count one forward's assignments (and losses, for logging); no host synchronisation."""
        self._counters_on(indices.device)
        counts = torch.zeros(self.num_experts, device=indices.device).index_add_(
            0, indices.reshape(-1).clamp_min(0), (indices.reshape(-1) >= 0).float())
        self.counts_for_update += counts
        self.counts_for_metrics += counts
        self.counts_total += counts.double()
        self.dropped += (indices < 0).sum()
        self.assignments += indices.numel()
        for name, value in (losses or {}).items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value.detach().float()
        self.loss_calls += 1

    def metrics(self, reset: bool = True) -> dict[str, float | list[float]]:
        """This layer's load since the last call: counts, MaxVio (batch and global), entropy, drops, losses."""
        counts = self.counts_for_metrics
        out: dict[str, float | list[float]] = {
            "counts": counts.tolist(),
            "max_vio": float(max_violation(counts)),
            "max_vio_global": float(max_violation(self.counts_total)),
            "entropy": float(load_entropy(counts)),
            "dropped": float(self.dropped),
            "tokens_per_expert_mean": float(counts.mean()),
            "drop_frac": float(self.dropped) / max(int(self.assignments), 1),
        }
        for name, total in self.loss_sums.items():
            out[f"loss_{name}"] = float(total) / max(int(self.loss_calls), 1)
        if reset:
            self.counts_for_metrics.zero_()
            self.dropped.zero_()
            self.assignments.zero_()
            self.loss_calls.zero_()
            self.loss_sums = {}
        return out


# ---------------------------------------------------------------------------------------------
# Trainer hooks
# ---------------------------------------------------------------------------------------------

def _named_balancers(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertBalancer]]:
    """(name, owning module, balancer) for every MoE layer: modules with an ``ExpertBalancer`` child."""
    for name, module in model.named_modules():
        for child in module.children():
            if isinstance(child, ExpertBalancer):
                yield name, module, child


def _expert_bias(owner: nn.Module) -> torch.Tensor | None:
    """The aux-loss-free bias of a MoE layer: its gate's ``e_score_correction_bias`` (HF name) or ``bias``."""
    gate = getattr(owner, "gate", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    return getattr(gate, "bias", None) if bias is None else bias


@torch.no_grad()
def aux_free_bias_update_(bias: torch.Tensor, counts: torch.Tensor, gamma: float, recenter: bool = False) -> None:
    """In place: ``bias += gamma * sign(mean(counts) - counts)``; optionally re-centre to zero mean."""
    counts = counts.to(device=bias.device, dtype=torch.float32)
    bias += gamma * torch.sign(counts.mean(-1, keepdim=True) - counts)
    if recenter:
        bias -= bias.mean(-1, keepdim=True)


def check_expert_biases(model: nn.Module) -> list[tuple[torch.Tensor, ExpertBalancer]]:
    """ValueError, before training, for a MoE layer whose strategy needs a bias its gate lacks.

    Returns (bias, balancer) of every layer that uses the aux-loss-free bias.
    """
    out = []
    for name, owner, balancer in _named_balancers(model):
        if not balancer.config.uses_bias or getattr(owner, "fixed_routing", False):
            continue
        bias = _expert_bias(owner)
        if bias is None:
            raise ValueError(f"MoE layer {name or '<root>'!r}: strategy {balancer.config.strategy!r} needs the gate's "
                             "aux-loss-free bias, but the gate has none (softmax scoring); drop 'aux_free'")
        out.append((bias, balancer))
    return out


@torch.no_grad()
def update_expert_biases(model: nn.Module, gamma: float, recenter: bool = False,
                         group: dist.ProcessGroup | None = None) -> int:
    """Aux-loss-free update of every MoE layer's bias; call after each optimizer step.

    The counts recorded since the last call are summed over ``group`` (the ranks that together
    see the global batch: data- and expert-parallel) in one all-reduce, so every rank applies the
    same update, then cleared. ``group=None`` uses this process's counts only (single process; under
    data parallelism that would let the ranks' biases drift apart, so pass the group). Returns the
    number of layers updated. Raises ValueError when the model has no MoE layer, or a layer has no
    bias to update (strategy without ``aux_free``, or a gate without a bias).
    """
    layers = list(_named_balancers(model))
    if not layers:
        raise ValueError("update_expert_biases: the model has no MoE layer (no ExpertBalancer found)")
    # layers with fixed routing (V4's hash layers, ``MoE.fixed_routing``) have no bias: nothing to update
    layers = [(n, o, b) for n, o, b in layers if not getattr(o, "fixed_routing", False)]
    targets = check_expert_biases(model)
    if len(targets) != len(layers):
        name, _, balancer = next((n, o, b) for n, o, b in layers if not b.config.uses_bias)
        raise ValueError(f"update_expert_biases: MoE layer {name or '<root>'!r} has no aux-loss-free bias "
                         f"(strategy={balancer.config.strategy!r}); use a strategy with 'aux_free'")
    counts = torch.stack([b.counts_for_update.to(bias.device) for bias, b in targets])
    if group is not None:
        dist.all_reduce(counts, group=group)
    for (bias, balancer), layer_counts in zip(targets, counts):
        aux_free_bias_update_(bias, layer_counts, gamma, recenter)
        balancer.counts_for_update.zero_()
    return len(targets)


def collect_load_metrics(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """Flat metrics for the metrics stream / wandb, per MoE layer and averaged over layers.

    Keys: ``moe/{layer}/max_vio``, ``.../max_vio_global``, ``.../entropy``, ``.../dropped``,
    ``.../drop_frac``, ``.../loss_{seq_aux|aux|z_loss}``, plus ``moe/max_vio`` etc. (means over
    layers) and ``moe/load`` (a layer x expert nested list of counts, for heat maps; not a scalar).
    Counts are this rank's; all-reduce them over the data-parallel group for global figures.
    """
    out: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    loads = []
    for name, _, balancer in _named_balancers(model):
        m = balancer.metrics(reset=reset)
        loads.append(m.pop("counts"))
        for key, value in m.items():
            out[f"moe/{name or 'root'}/{key}"] = value
            per_key.setdefault(key, []).append(value)
    for key, values in per_key.items():
        out[f"moe/{key}"] = sum(values) / len(values)
    if loads:
        out["moe/load"] = loads
    return out
