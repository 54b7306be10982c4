"""Expert parallelism and load balancing wired into this rank's MoE layers, and their per-step upkeep.

- ``wire_moe_layers``: every MoE layer gets the run's balancing strategy (``[balance]``) and, when
  ``parallel.ep > 1``, an ``ExpertParallel`` dispatcher over the stage's ``ep`` group (tokens in FP8
  when the FP8 path is on, as V3 dispatches).
- ``update_biases``: after each optimizer step, the aux-loss-free biases move by gamma x sign(load
  error), with the loads summed over the stage's ``dp`` group (every token of the global batch).
- ``load_metrics``: MaxVio (this step, on the global batch), balance losses, per-layer loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.flight import FlightRecorder
from accel.trace import TraceRecorder
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.balancing import ExpertBalancer, collect_load_metrics, max_violation, update_expert_biases
from models.deepseek_v3.expert_parallel import ExpertParallel
from models.deepseek_v3.moe import MoE
from training.config import TrainConfig
from training.parallel import ParallelState


def moe_layers(modules: list[nn.Module]) -> list[MoE]:
    seen, out = set(), []
    for root in modules:
        for m in root.modules():
            if isinstance(m, MoE) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def wire_moe_layers(stages: list[nn.Module], cfg: TrainConfig, ps: ParallelState,
                    recorder: TraceRecorder | None = None, flight: FlightRecorder | None = None) -> None:
    for moe in moe_layers(stages):
        # a layer with fixed routing (V4's hash layers) has no bias or router to balance: measured only
        balance = dataclasses.replace(cfg.balance, strategy="none") if moe.fixed_routing else cfg.balance
        moe.balancer = ExpertBalancer(moe.n_routed_experts, moe.gate.topk, balance)
        if cfg.parallel.ep > 1:
            # V3 dispatches tokens in FP8 (1x128 scales) when training in FP8
            moe.ep = ExpertParallel(moe.n_routed_experts, ps.group("ep"), fp8_dispatch=cfg.model.fp8,
                                    recorder=recorder, flight=flight, layer=moe.layer_id, fused=moe.fused)


def update_biases(stages: list[nn.Module], cfg: TrainConfig, ps: ParallelState, args: ModelArgs, gamma: float,
                  device: torch.device) -> None:
    """The aux-loss-free bias update after an optimizer step, from the loads of the whole global batch."""
    if not cfg.balance.uses_bias:
        return
    if cfg.parallel.layout.copies > 1:  # DualPipe: each stage's two copies saw half of the micro-batches each
        sum_mirrored_counts(stages, ps.group("pp"), args, device)
    if not moe_layers(stages):
        return
    update_expert_biases(nn.ModuleList(stages), gamma, cfg.balance.recenter, group=ps.group("dp"))


@torch.no_grad()
def mirror_sum(rows: torch.Tensor, layer_ids: list[int], pp_group: dist.ProcessGroup | None,
               n_moe: int) -> torch.Tensor:
    """DualPipe holds each stage on two pipeline ranks, each seeing half of the micro-batches: the sum of
    per-layer ``rows [len(layer_ids), E]`` over the two copies (a table by global MoE layer id, all-reduced
    over the pp group: exactly the two copies fill each row). Collective over ``pp_group``."""
    table = torch.zeros(n_moe, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    ids = torch.tensor(layer_ids, dtype=torch.long, device=rows.device)
    table[ids] = rows
    dist.all_reduce(table, group=pp_group)
    return table[ids]


@torch.no_grad()
def sum_mirrored_counts(stages: list[nn.Module], pp_group: dist.ProcessGroup | None, args: ModelArgs,
                        device: torch.device) -> None:
    """The expert loads of a stage's two DualPipe copies summed (``mirror_sum``), so both copies apply the
    same bias update as one process would."""
    layers = moe_layers(stages)
    rows = torch.stack([m.balancer.counts_for_update.to(device) for m in layers]) if layers else torch.zeros(
        0, args.n_routed_experts, device=device)
    summed = mirror_sum(rows, [m.layer_id for m in layers], pp_group, args.n_layers + args.n_mtp_layers)
    for m, row in zip(layers, summed):
        m.balancer.counts_for_update.copy_(row.to(m.balancer.counts_for_update.device))


def load_metrics(stages: list[nn.Module], cfg: TrainConfig, ps: ParallelState, args: ModelArgs,
                 device: torch.device) -> dict[str, Any]:
    """``max_vio`` over the global batch (mean over this rank's layers, then over ranks holding MoE
    layers), balance losses, and the per-layer loads of this rank (for the JSONL file). With expert
    parallelism also ``ep_imbalance``: max / mean rows received per EP rank (the per-GPU load EPLB
    balances; 1 = even), averaged the same way.

    Collective on every rank (world all-reduce), whether or not it holds MoE layers.
    """
    layers = moe_layers(stages)
    out: dict[str, Any] = {}
    vio, weight = 0.0, 0.0
    imbalance = rank_imbalance(layers, ps.group("ep"), device) if cfg.parallel.ep > 1 else None
    counts = torch.stack([m.balancer.counts_for_metrics.float().to(device) for m in layers]) if layers else None
    if cfg.parallel.layout.copies > 1:  # collective on every pp rank, with or without MoE layers
        counts = mirror_sum(counts if counts is not None else torch.zeros(0, args.n_routed_experts, device=device),
                            [m.layer_id for m in layers], ps.group("pp"), args.n_layers + args.n_mtp_layers)
    if layers:
        group = ps.group("dp")
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)  # every rank of a dp group holds the same layers
        vio, weight = float(torch.stack([max_violation(c) for c in counts]).mean()), 1.0
        local = collect_load_metrics(nn.ModuleList(stages), reset=True)
        for k in ("loss_seq_aux", "loss_aux", "loss_z_loss"):
            if f"moe/{k}" in local:
                out[f"balance_{k[5:]}"] = local[f"moe/{k}"]
        out["expert_load"] = counts.tolist()
    held = 1.0 if imbalance is not None else 0.0
    imbalance = imbalance or 0.0
    if ps.world_size > 1:
        t = torch.tensor([vio * weight, weight, imbalance * held, held], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        vio, weight = float(t[0] / t[1]) if t[1] > 0 else 0.0, float(t[1])
        imbalance, held = float(t[2] / t[3]) if t[3] > 0 else 0.0, float(t[3])
    if weight:
        out["max_vio"] = vio
    if held:
        out["ep_imbalance"] = imbalance
    return out


@torch.no_grad()
def rank_imbalance(layers: list[MoE], ep_group: dist.ProcessGroup | None,
                   device: torch.device | str = "cpu") -> float | None:
    """Mean over layers of max / mean rows received per EP rank since the last call (1 = balanced); resets.

    The per-GPU load EPLB targets, next to MaxVio's per-expert load. Collective over the EP group, on
    ``device`` (NCCL / MCCL take device tensors only).
    """
    if not layers or ep_group is None or dist.get_world_size(ep_group) < 2:
        return None
    world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    table = torch.zeros(len(layers), world, dtype=torch.float64, device=device)
    for i, m in enumerate(layers):
        if m.received_rows is not None:
            table[i, rank] = m.received_rows.to(device)
        m.received_rows = None
    dist.all_reduce(table, group=ep_group)
    mean = table.mean(-1)
    ratio = torch.where(mean > 0, table.amax(-1) / mean.clamp_min(1e-12), torch.ones_like(mean))
    return float(ratio.mean())

