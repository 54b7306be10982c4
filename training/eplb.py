"""EPLB in the training runtime: redundant expert slots, plans from measured loads, applied between steps.

With ``[eplb] enabled`` every expert-parallel rank hosts ``(n_routed_experts + redundant_experts) / ep``
physical slots per MoE layer (a hot logical expert may have several replicas, on one rank or on
several). Around the library pieces of ``models.deepseek_v3.eplb`` this module keeps, per rank:

- the plan: ``phy2log`` ``[MoE layers here, physical slots]``, the same on every rank of the stage
  (it is computed from all-reduced loads, deterministically), wired into each layer's
  ``ExpertParallel`` (``set_plan``) and ``Experts.expert_ids``;
- the loads: the logical expert counts the balancer records (``counts_total``, also what the
  aux-loss-free bias uses) since the last plan, summed over the stage's ``dp`` group (and, under
  DualPipe, over the two pipeline ranks holding the stage, so both copies make the same plan);
- ``after_step``: every ``interval`` optimizer steps the loads update an ``ExpertLoadEMA`` (one
  update per interval), a new plan is made, and for each layer whose plan changed the weights and
  the optimizer moments (AdamW ``exp_avg``/``exp_avg_sq``, anything of the parameter's shape) move
  with ``redistribute_expert_weights`` over the EP group: exact copies, no arithmetic (metrics
  ``eplb_moved_slots``, ``eplb_max_replicas``, ``eplb_replan_s``);
- ``sync_grads``: replicas' gradients are summed (``sync_replica_grads_``, one all-reduce for all
  layers) before clipping, so the replicas of one logical expert take identical steps and stay
  exact copies; ``norm_weights`` counts each logical expert once in the global gradient norm;
- checkpoints in the logical layout: ``to_logical`` / ``from_logical`` convert one expert tensor
  between this rank's physical slots and its ``E / ep`` logical experts (the layout without EPLB),
  so checkpoints, HF export and a resume with EPLB off see no difference.

ZeRO-1 over ``edp``: ``ZeroRedundancyOptimizer`` partitions parameters by size, and every rank of
an EP group holds expert tensors of the same shapes in the same order, so all of them own the same
parameter indices and move the same optimizer states together. ``EplbRuntime`` checks this at
start-up (one all-gather) and refuses to run if it ever did not hold.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.grads import grad
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.eplb import (
    ExpertLoadEMA,
    local_physical_experts,
    rebalance_experts,
    redistribute_expert_weights,
    sync_replica_grads_,
)
from models.deepseek_v3.moe import MoE
from training.config import TrainConfig
from training.experts import moe_layers
from training.optim import split_zero


def plan_shape(cfg: TrainConfig, args: ModelArgs) -> tuple[int, int, int, int]:
    """(physical slots per layer, expert groups, nodes, EP ranks) the plans are made for."""
    e = cfg.eplb
    groups = e.num_groups or getattr(args, "n_expert_groups", 1)  # V4 routes without a group limit
    nodes = e.num_nodes or cfg.balance.num_nodes
    return args.n_routed_experts + e.redundant_experts, groups, nodes, cfg.parallel.ep


def check_eplb(cfg: TrainConfig, args: ModelArgs) -> None:
    """The ``[eplb]`` checks that need the model: slots divide over EP, the policy's arguments divide."""
    if not cfg.eplb.enabled:
        return
    experts, redundant, ep = args.n_routed_experts, cfg.eplb.redundant_experts, cfg.parallel.ep
    if args.n_layers <= getattr(args, "n_dense_layers", 0) and not args.n_mtp_layers:  # every V4 layer is MoE
        raise ValueError("eplb.enabled: the model has no MoE layer (model n_layers <= n_dense_layers)")
    if (experts + redundant) % ep:
        raise ValueError(f"eplb.redundant_experts={redundant}: n_routed_experts + redundant_experts = {experts} + "
                         f"{redundant} = {experts + redundant} physical experts must be divisible by parallel.ep={ep}")
    physical, groups, nodes, gpus = plan_shape(cfg, args)
    try:
        rebalance_experts(torch.ones(1, experts), physical, groups, nodes, gpus)
    except ValueError as exc:
        raise ValueError(f"eplb (num_groups={groups}, num_nodes={nodes}, {physical} physical experts over "
                         f"parallel.ep={gpus} ranks): {exc}") from None


def initial_plan(cfg: TrainConfig, args: ModelArgs) -> torch.Tensor:
    """``phy2log`` row used before any load is measured: the policy on uniform loads (the lowest ids replicated)."""
    physical, groups, nodes, gpus = plan_shape(cfg, args)
    return rebalance_experts(torch.ones(1, args.n_routed_experts), physical, groups, nodes, gpus)[0][0]


class EplbRuntime:
    """This rank's plan, load tracker and plan application (see the module docstring)."""

    def __init__(self, stages: list[nn.Module], cfg: TrainConfig, args: ModelArgs, ep_group: dist.ProcessGroup,
                 dp_group: dist.ProcessGroup | None, optimizers: list[torch.optim.Optimizer],
                 mirror_group: dist.ProcessGroup | None = None) -> None:
        """``mirror_group``: under DualPipe, the pipeline group, whose two ranks holding a stage each see half
        of its micro-batches: their loads are summed, so both copies make the same plan."""
        self.cfg, self.args = cfg, args
        self.mirror_group = mirror_group
        self.layers = moe_layers(stages)
        self.num_physical, self.num_groups, self.num_nodes, self.ep = plan_shape(cfg, args)
        self.num_experts = args.n_routed_experts
        self.ep_group, self.dp_group = ep_group, dp_group
        self.ep_rank = dist.get_rank(ep_group)
        self.optimizers = optimizers
        # collectives run on the experts' device (NCCL / MCCL take device tensors only)
        self.device = self.layers[0].experts.w13.device if self.layers else torch.device("cpu")
        self.logical = torch.arange(self.num_experts)  # the checkpoint layout: E / ep experts per rank, in order
        self.phy2log = initial_plan(cfg, args).repeat(len(self.layers), 1)
        self.ema = ExpertLoadEMA(len(self.layers), self.num_experts, cfg.eplb.ema_decay)
        self._seen = self._counts_total()  # loads measured up to the last plan
        self.replans = 0
        # state-dict key (stage-local name) -> (layer index, parameter) for every routed-expert tensor
        self.expert_keys: dict[str, tuple[int, nn.Parameter]] = {}
        index = {id(m): i for i, m in enumerate(self.layers)}
        for st in stages:
            for prefix, m in st.named_modules():
                if isinstance(m, MoE):
                    for pname in ("w13", "w2"):
                        self.expert_keys.setdefault(f"{prefix}.experts.{pname}", (index[id(m)], getattr(m.experts,
                                                                                                         pname)))
        for layer, row in zip(self.layers, self.phy2log):
            self._wire(layer, row)
        self._check_zero_ownership()

    # ---- plan ------------------------------------------------------------------------------------
    def _local(self, row: torch.Tensor) -> torch.Tensor:
        return local_physical_experts(row, self.ep_rank, self.ep)

    def _wire(self, layer: MoE, row: torch.Tensor) -> None:
        layer.experts.expert_ids = tuple(self._local(row).tolist())
        if layer.ep is not None:
            layer.ep.set_plan(row)

    def _counts_total(self) -> torch.Tensor:
        if not self.layers:
            return torch.zeros(0, self.num_experts, dtype=torch.float64)
        return torch.stack([m.balancer.counts_total.detach().double().to(self.device) for m in self.layers])

    def _check_zero_ownership(self) -> None:
        """Every EP rank must hold the optimizer states of the same expert tensors (ZeRO-1 shards)."""
        owned = torch.tensor([int(self._owns(p)) for _, p in self.expert_keys.values()], dtype=torch.int64,
                             device=self.device)
        gathered = [torch.empty_like(owned) for _ in range(self.ep)]
        dist.all_gather(gathered, owned, group=self.ep_group)
        if not all(torch.equal(g, owned) for g in gathered):
            raise ValueError("eplb with parallel.zero1: the ranks of an expert-parallel group own different expert "
                             "parameters' optimizer states, so they cannot move together; set parallel.zero1=false")

    def _owns(self, p: nn.Parameter) -> bool:
        for opt in self.optimizers:
            local, _ = split_zero(opt)
            if any(q is p for g in local.param_groups for q in g["params"]):
                return True
        return False

    def _state(self, p: nn.Parameter) -> dict[str, Any] | None:
        for opt in self.optimizers:
            local, _ = split_zero(opt)
            if p in local.state and local.state[p]:
                return local.state[p]
        return None

    @torch.no_grad()
    def measured_loads(self) -> torch.Tensor:
        """Logical expert loads [layers, E] since the last plan, summed over the stage (every token of the batch)."""
        now = self._counts_total()
        loads = now - self._seen
        self._seen = now
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(loads, group=self.dp_group)
        if self.mirror_group is not None:  # rows by global MoE layer id: exactly the two copies fill each row
            table = torch.zeros(self.args.n_layers + self.args.n_mtp_layers, self.num_experts, dtype=loads.dtype,
                                device=loads.device)
            ids = torch.tensor([m.layer_id for m in self.layers], device=loads.device)
            table[ids] = loads
            dist.all_reduce(table, group=self.mirror_group)
            loads = table[ids]
        return loads.cpu()

    def after_step(self, steps_done: int) -> dict[str, float]:
        """Between steps: every ``interval`` steps, measure, update the EMA, re-plan and move what changed."""
        if not self.layers or steps_done % self.cfg.eplb.interval:
            return {}
        t0 = time.perf_counter()
        self.ema.update(self.measured_loads())
        plan = self.ema.plan(self.num_physical, self.num_groups, self.num_nodes, self.ep)
        moved = self.apply_plan(plan.phy2log)
        self.replans += 1
        return {"eplb_moved_slots": float(moved), "eplb_max_replicas": float(plan.logcnt.max()),
                "eplb_replan_s": time.perf_counter() - t0}

    @torch.no_grad()
    def apply_plan(self, phy2log: torch.Tensor) -> int:
        """Move weights and optimizer moments to ``phy2log`` [layers, physical]; returns slots whose expert changed."""
        moved = 0
        for i, layer in enumerate(self.layers):
            old, new = self.phy2log[i], phy2log[i]
            if torch.equal(old, new):
                continue
            moved += int((old != new).sum())
            for p in (layer.experts.w13, layer.experts.w2):
                self._move(p, old, new)
            self.phy2log[i] = new
            self._wire(layer, new)
        return moved

    def _move(self, p: nn.Parameter, old: torch.Tensor, new: torch.Tensor) -> None:
        p.data.copy_(redistribute_expert_weights(p.data, old, new, self.ep_group))
        state = self._state(p)
        if state is not None:  # same on every EP rank (checked at start-up)
            for key in sorted(state):
                value = state[key]
                if _per_slot(value, p):
                    value.copy_(redistribute_expert_weights(value, old, new, self.ep_group))

    # ---- gradients -------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of every logical expert's replicas and give each replica the sum."""
        grads, plans = [], []
        for i, layer in enumerate(self.layers):
            for p in (layer.experts.w13, layer.experts.w2):
                if grad(p) is not None:
                    grads.append(grad(p))
                    plans.append(self.phy2log[i])
        sync_replica_grads_(grads, plans, self.num_experts, self.ep_group)  # one all-reduce for every layer

    def norm_weights(self) -> dict[int, torch.Tensor]:
        """``id(param) -> [slots]`` weight 1 / copies of the slot's expert: each logical expert counted once."""
        out = {}
        for i, layer in enumerate(self.layers):
            copies = torch.bincount(self.phy2log[i], minlength=self.num_experts)
            weight = (1.0 / copies.double())[self._local(self.phy2log[i])]
            for p in (layer.experts.w13, layer.experts.w2):
                out[id(p)] = weight.to(p.device)
        return out

    # ---- logical layout (checkpoints) --------------------------------------------------------------
    def to_logical(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's physical rows of one expert tensor -> its E / ep logical experts (collective over EP)."""
        return redistribute_expert_weights(tensor.detach(), self.phy2log[layer], self.logical, self.ep_group)

    def from_logical(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """Inverse of ``to_logical``: E / ep logical rows -> this rank's physical slots (collective over EP)."""
        return redistribute_expert_weights(tensor.detach(), self.logical, self.phy2log[layer], self.ep_group)

    def logical_model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        for key, (layer, _) in self.expert_keys.items():
            out[key] = self.to_logical(state[key], layer)
        return out

    def physical_model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        for key, (layer, _) in self.expert_keys.items():
            if key in out:
                out[key] = self.from_logical(out[key], layer)
        return out

    def logical_optimizer_state(self, named: list[dict[str, Any]], names: dict[int, str]) -> None:
        """In name-keyed optimizer states (``named_optimizer_state``), expert moments -> logical rows.

        Replaces the per-parameter dicts (they are the live optimizer's otherwise)."""
        for layer, p in self.expert_keys.values():
            fqn = names[id(p)]
            for opt in named:
                s = opt["state"].get(fqn)
                if s is not None:
                    opt["state"][fqn] = {k: self.to_logical(v, layer) if _per_slot(v, p) else v
                                         for k, v in sorted(s.items())}

    @torch.no_grad()
    def optimizer_state_from_logical(self) -> None:
        """After loading a (logical-layout) checkpoint's optimizer states: expert moments -> physical slots."""
        rows = self.num_experts // self.ep
        for layer, p in self.expert_keys.values():
            state = self._state(p)
            if state is None:
                continue
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.dim() == p.dim() and value.shape[0] == rows \
                        and value.shape[1:] == p.shape[1:]:
                    state[key] = self.from_logical(value, layer).to(value.dtype)

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The plan, the load average and this rank's loads not yet planned on (so a resume plans alike)."""
        return {"phy2log": self.phy2log.clone(), "layer_ids": torch.tensor([m.layer_id for m in self.layers]),
                "ema_load": self.ema.load.clone(), "ema_updates": self.ema.updates,
                "pending_load": (self._counts_total() - self._seen).cpu(), "replans": self.replans}

    def load_plan(self, state: dict[str, Any] | None) -> None:
        """Adopt a saved plan and load average (before the logical weights are materialised under it).

        ``None`` (a checkpoint written without EPLB) keeps the current plan and starts the average afresh.
        A plan with another slot count (``eplb.redundant_experts`` changed) is dropped, its load average
        kept: the next re-plan makes a plan of the new size from it.
        """
        self._seen = self._counts_total()
        if state is None:
            return
        ids = [m.layer_id for m in self.layers]
        if state["layer_ids"].tolist() != ids:
            raise ValueError(f"checkpoint EPLB state covers MoE layers {state['layer_ids'].tolist()}, this rank "
                             f"holds {ids}")
        self.ema.load, self.ema.updates = state["ema_load"].clone().double().cpu(), int(state["ema_updates"])
        self._seen = self._seen - state["pending_load"].double().to(self._seen.device)
        self.replans = int(state["replans"])
        if tuple(state["phy2log"].shape) == tuple(self.phy2log.shape):
            self.phy2log = state["phy2log"].clone().to(torch.int64)
        for layer, row in zip(self.layers, self.phy2log):
            self._wire(layer, row)


def _per_slot(value: Any, p: nn.Parameter) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == p.shape
