"""Expert-parallel load balancer (EPLB): which GPU hosts which expert, with redundant copies of hot ones.

``rebalance_experts`` follows deepseek-ai/EPLB's public algorithm and signature (a user switches by
changing the import):

- hierarchical policy (when the expert groups divide evenly over the nodes): pack expert groups
  onto nodes so node loads balance (V3's group-limited routing then keeps traffic inside few
  nodes), replicate the heaviest experts inside each node, then pack the node's physical experts
  onto its GPUs;
- global policy (otherwise): replicate over all experts, pack onto all GPUs.

Packing is greedy longest-processing-time with a fixed number of items per pack; replication gives
the next copy to the expert with the highest load per copy. Loads accumulate in fp32 and ties go
to the lowest index, as upstream, so plans match upstream's bit for bit.

Around it: ``ExpertLoadEMA`` (a moving average of measured loads from which plans are made) and
the between-steps plan application for a sharded EP run (``redistribute_expert_weights``, and
``sync_replica_grads_`` to keep replicas identical).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


def _balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assign each of n weighted items per row to one of ``num_packs`` packs of exactly n/num_packs items.

    Returns (pack [L, n], slot-in-pack [L, n]). Heaviest item first, into the lightest pack that
    still has room.
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        pack = torch.arange(items, dtype=torch.int64).expand(rows, items).clone()
        return pack, torch.zeros_like(pack)
    w = weight.float().numpy()
    order = weight.float().sort(dim=-1, descending=True, stable=True).indices.numpy()
    pack = np.empty((rows, items), dtype=np.int64)
    slot = np.empty((rows, items), dtype=np.int64)
    for r in range(rows):
        loads = np.zeros(num_packs, dtype=np.float32)
        fill = np.zeros(num_packs, dtype=np.int64)
        for item in order[r]:
            best = int(np.argmin(np.where(fill < per_pack, loads, np.inf)))
            pack[r, item], slot[r, item] = best, fill[best]
            fill[best] += 1
            loads[best] += w[r, item]
    return torch.from_numpy(pack), torch.from_numpy(slot)


def _replicate(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_physical - n`` extra copies, each to the expert with the highest load per copy.

    Returns (phy2log [L, P], replica index of each physical expert [L, P], copies per expert [L, n]);
    physical experts 0..n-1 are the originals.
    """
    rows, items = weight.shape
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    replica = torch.zeros(rows, num_physical, dtype=torch.int64)
    count = torch.ones(rows, items, dtype=torch.int64)
    row = torch.arange(rows)
    for p in range(items, num_physical):
        hot = (weight / count).argmax(-1)
        phy2log[:, p] = hot
        replica[:, p] = count[row, hot]
        count[row, hot] += 1
    return phy2log, replica, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse permutation."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm).contiguous())
    return inv


def _rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                            num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    gpus_per_node = num_gpus // num_nodes
    per_gpu = num_physical // num_gpus
    per_node_logical = num_logical // num_nodes

    # 1. expert groups -> nodes; "mlog" numbers logical experts node-major in their packed order
    group_pack, group_slot = _balanced_packing(weight.view(layers, num_groups, group_size).sum(-1), num_nodes)
    first = (group_pack * groups_per_node + group_slot) * group_size
    log2mlog = (first[:, :, None] + torch.arange(group_size)).view(layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # 2. replicas inside each node (one row per (layer, node))
    mlog_load = weight.gather(-1, mlog2log).view(layers * num_nodes, per_node_logical)
    phy2mlog, replica, mlog_count = _replicate(mlog_load, num_physical // num_nodes)

    # 3. the node's physical experts -> its GPUs, by load per copy
    phy_load = (mlog_load / mlog_count).gather(-1, phy2mlog)
    gpu, gpu_slot = _balanced_packing(phy_load, gpus_per_node)
    placed2phy = _inverse(gpu * per_gpu + gpu_slot)

    placed2mlog = phy2mlog.gather(-1, placed2phy).view(layers, num_nodes, -1)
    placed2mlog = (placed2mlog + torch.arange(num_nodes)[:, None] * per_node_logical).view(layers, -1)
    phy2log = mlog2log.gather(-1, placed2mlog)
    phy_replica = replica.gather(-1, placed2phy).view(layers, -1)
    logcnt = mlog_count.view(layers, -1).gather(-1, log2mlog)
    return phy2log, phy_replica, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan the physical experts of each MoE layer (deepseek-ai/EPLB's entry point and outputs).

    weight: [layers, logical experts] load statistics. num_replicas: physical experts (logical +
    redundant), a multiple of num_gpus. num_groups: expert groups (group-limited routing);
    num_nodes: server nodes; num_gpus: GPUs in all.
    Returns phy2log [layers, num_replicas] (logical id of each physical slot, GPU-major),
    log2phy [layers, logical, max copies] (physical slots of each logical expert, -1 padded),
    logcnt [layers, logical] (copies of each logical expert).
    """
    if weight.dim() != 2:
        raise ValueError(f"rebalance_experts: weight must be [layers, experts], got shape {tuple(weight.shape)}")
    layers, num_logical = weight.shape
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)):
        if value < 1:
            raise ValueError(f"rebalance_experts: {name} must be >= 1, got {value}")
    if num_replicas < num_logical:
        raise ValueError(f"rebalance_experts: num_replicas={num_replicas} < {num_logical} logical experts")
    if num_logical % num_groups:
        raise ValueError(f"rebalance_experts: num_groups={num_groups} must divide the {num_logical} experts")
    if num_gpus % num_nodes:
        raise ValueError(f"rebalance_experts: num_nodes={num_nodes} must divide num_gpus={num_gpus}")
    if num_replicas % num_gpus:
        raise ValueError(f"rebalance_experts: num_gpus={num_gpus} must divide num_replicas={num_replicas}")
    weight = weight.detach().float().cpu()
    if num_groups % num_nodes == 0:
        if num_logical % num_nodes or num_replicas % num_nodes:
            raise ValueError(f"rebalance_experts: num_nodes={num_nodes} must divide the experts ({num_logical}) "
                             f"and num_replicas ({num_replicas})")
        phy2log, replica, logcnt = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, replica, logcnt = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_copies = int(logcnt.max())
    log2phy = torch.full((layers, num_logical * max_copies), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * max_copies + replica, torch.arange(num_replicas).expand(layers, -1).contiguous())
    return phy2log, log2phy.view(layers, num_logical, max_copies), logcnt


@dataclass
class EplbPlan:
    """One placement: ``rebalance_experts``' three outputs for every MoE layer."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @classmethod
    def identity(cls, num_layers: int, num_experts: int) -> EplbPlan:
        """No redundancy: physical slot i hosts logical expert i."""
        phy2log = torch.arange(num_experts).repeat(num_layers, 1)
        return cls(phy2log, phy2log[:, :, None].clone(), torch.ones(num_layers, num_experts, dtype=torch.int64))


class ExpertLoadEMA:
    """Moving average of measured expert loads ([layers, experts]); plans come from it.

    ``decay`` close to 1 smooths over many steps (loads drift slowly in training); the first
    update sets the average directly, so a new tracker is usable after one step.
    """

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ExpertLoadEMA: decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.updates = 0

    def update(self, counts: torch.Tensor) -> None:
        counts = torch.as_tensor(counts, dtype=torch.float64).cpu()
        if counts.shape != self.load.shape:
            raise ValueError(f"ExpertLoadEMA.update: counts shape {tuple(counts.shape)}, "
                             f"expected {tuple(self.load.shape)}")
        self.load = counts.clone() if self.updates == 0 else self.decay * self.load + (1 - self.decay) * counts
        self.updates += 1

    def plan(self, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> EplbPlan:
        if self.updates == 0:
            raise ValueError("ExpertLoadEMA.plan: no load measured yet (call update first)")
        return EplbPlan(*rebalance_experts(self.load, num_replicas, num_groups, num_nodes, num_gpus))


def local_physical_experts(phy2log: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Logical ids of the physical experts one EP rank hosts (one layer's ``phy2log`` row)."""
    if phy2log.numel() % world_size:
        raise ValueError(f"{phy2log.numel()} physical experts do not divide over {world_size} EP ranks")
    per_rank = phy2log.numel() // world_size
    return phy2log[rank * per_rank:(rank + 1) * per_rank]


@torch.no_grad()
def redistribute_expert_weights(local: torch.Tensor, old_phy2log: torch.Tensor, new_phy2log: torch.Tensor,
                                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Apply a new plan between steps: return this rank's physical expert rows under ``new_phy2log``.

    local: [old slots per rank, ...] this rank's rows under ``old_phy2log`` (one layer). The two
    plans may have different slot counts (a multiple of the group size each), so the same call
    also converts between the logical layout (``arange(E)``, E / world experts per rank, as saved
    in checkpoints) and a physical plan with redundant slots. Each new slot copies from the
    lowest-numbered old slot holding the same logical expert; every rank derives the same transfer
    list, and one ``all_to_all_single`` moves the rows (exact copies, no arithmetic). Works for
    any per-expert tensor: weights, gradients, optimizer moments.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    old_phy2log, new_phy2log = old_phy2log.reshape(-1).cpu(), new_phy2log.reshape(-1).cpu()
    old_per_rank = local.shape[0]
    if old_phy2log.numel() != old_per_rank * world:
        raise ValueError(f"redistribute_expert_weights: old plan has {old_phy2log.numel()} slots, expected "
                         f"{old_per_rank * world} ({old_per_rank} rows per rank x {world} ranks)")
    if new_phy2log.numel() % world:
        raise ValueError(f"redistribute_expert_weights: new plan's {new_phy2log.numel()} slots do not divide over "
                         f"{world} ranks")
    new_per_rank = new_phy2log.numel() // world
    if set(new_phy2log.tolist()) - set(old_phy2log.tolist()):
        raise ValueError("redistribute_expert_weights: the new plan hosts experts that no rank holds now")
    first_slot = {}
    for slot, logical in enumerate(old_phy2log.tolist()):
        first_slot.setdefault(logical, slot)
    source = torch.tensor([first_slot[e] for e in new_phy2log.tolist()], dtype=torch.int64)  # old slot per new slot
    src_rank = source // old_per_rank
    # what I send: for every destination rank, in its slot order, the rows it wants from me
    send_rows, send_splits, recv_splits = [], [], []
    mine = slice(rank * new_per_rank, (rank + 1) * new_per_rank)
    for dst in range(world):
        wanted = source[dst * new_per_rank:(dst + 1) * new_per_rank]
        rows = wanted[wanted // old_per_rank == rank] - rank * old_per_rank
        send_rows.append(rows)
        send_splits.append(rows.numel())
        recv_splits.append(int((src_rank[mine] == dst).sum()))
    flat = local.reshape(old_per_rank, -1)
    send = flat[torch.cat(send_rows).to(flat.device)].contiguous()
    recv = torch.empty(sum(recv_splits), flat.shape[1], dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    # received rows arrive grouped by source rank, each group in my slot order
    order = torch.sort(src_rank[mine], stable=True).indices.to(flat.device)
    out = torch.empty(new_per_rank, flat.shape[1], dtype=flat.dtype, device=flat.device)
    out[order] = recv
    return out.view(new_per_rank, *local.shape[1:])


def _replicated_rows(phy2log: torch.Tensor, rank: int, world: int,
                     num_logical: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(my slots hosting an expert with several copies, that expert's row among the replicated ones, how many)."""
    phy2log = phy2log.reshape(-1).cpu()
    mine = local_physical_experts(phy2log, rank, world)
    replicated = (torch.bincount(phy2log, minlength=num_logical) > 1).nonzero().flatten()
    row_of = torch.full((num_logical,), -1, dtype=torch.int64)
    row_of[replicated] = torch.arange(replicated.numel())
    slots = (row_of[mine] >= 0).nonzero().flatten()
    return slots, row_of[mine[slots]], replicated.numel()


@torch.no_grad()
def sync_replica_grads_(grads: Sequence[torch.Tensor], phy2logs: Sequence[torch.Tensor], num_logical: int,
                        group: dist.ProcessGroup | None = None) -> None:
    """In place, for many expert tensors at once: every replica's gradient becomes its expert's replica sum.

    grads[i]: [physical per rank, ...] (contiguous, one dtype and device for all) under plan phy2logs[i].
    Only experts with more than one copy travel, all tensors' rows in one all-reduce (at most
    ``redundant`` rows per tensor, e.g. 32 of V3's 256 experts); every rank holds the same plans, so
    every rank builds the same buffer. Replicas then take identical optimizer steps.
    """
    if len({(g.dtype, g.device) for g in grads}) > 1:
        raise ValueError("sync_replica_grads_: gradients must share one dtype and device")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pending, parts = [], []
    for grad, phy2log in zip(grads, phy2logs):
        slots, rows, count = _replicated_rows(phy2log, rank, world, num_logical)
        if count == 0:
            continue
        flat = grad.view(grad.shape[0], -1)
        slots, rows = slots.to(flat.device), rows.to(flat.device)
        part = torch.zeros(count, flat.shape[1], dtype=flat.dtype, device=flat.device)
        part.index_add_(0, rows, flat[slots])
        pending.append((flat, slots, rows, part.shape))
        parts.append(part.reshape(-1))
    if not parts:
        return
    total = torch.cat(parts)
    dist.all_reduce(total, group=group)
    offset = 0
    for flat, slots, rows, shape in pending:
        summed = total[offset:offset + shape.numel()].view(shape)
        flat[slots] = summed[rows]
        offset += shape.numel()


def sync_replica_grads(local_grad: torch.Tensor, phy2log: torch.Tensor, num_logical: int,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One layer's ``sync_replica_grads_``, returning a new tensor: [physical per rank, ...] with replica sums."""
    out = local_grad.contiguous().clone()
    sync_replica_grads_([out], [phy2log], num_logical, group)
    return out
