"""Process groups for pipeline (PP), context (CP), data (DP) and expert (EP) parallelism, from torchrun's environment.

Rank layout (``world = pp x cp x dp``)::

    rank = pp_rank * (cp * dp) + slot,   slot = dp_rank * cp + cp_rank = edp_rank * ep + ep_rank

so the ranks of one pipeline stage are contiguous (on one node when cp x dp <= GPUs per node), the ranks
sharing a sequence (CP) are neighbours, and an expert-parallel group is ``ep`` consecutive ranks of that stage,
as DeepSeek-V3 spreads its 64-way EP over the data-parallel ranks of a stage and Megatron-Core over the
context- and data-parallel ones. Groups each rank belongs to:

- ``pp``: the ``pp`` ranks with the same ``slot`` (one per stage): the pipeline's P2P group;
- ``dp``: the ``cp x dp`` ranks of its stage (Megatron's dp-cp group; plain data parallelism when cp = 1):
  dense gradients, ZeRO-1 shards of dense parameters, expert loads. CP ranks are data-parallel ranks for the
  weights: each computes its share of the same sequences' loss, and the shares' gradients are summed;
- ``cp``: the ``cp`` ranks of its stage with the same ``dp_rank``: they share each sequence (MLA's latent
  all-gather); the same samples reach all of them;
- ``ep``: the ``ep`` ranks of its stage with the same ``edp_rank``: token all-to-all, expert shards;
- ``edp``: the ``cp x dp / ep`` ranks of its stage with the same ``ep_rank``: replicas of the same
  experts, for expert gradients and ZeRO-1 shards of expert parameters.

The layout is a pure function (``layout``) so dry runs print it without starting a process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch.distributed as dist

import accel
from training.config import ParallelConfig, check_world_size


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
    cp_rank: int = 0


def coords(rank: int, par: ParallelConfig) -> RankCoords:
    pp_rank, slot = divmod(rank, par.cp * par.dp)
    dp_rank, cp_rank = divmod(slot, par.cp)
    edp_rank, ep_rank = divmod(slot, par.ep)
    return RankCoords(rank, pp_rank, dp_rank, ep_rank, edp_rank, cp_rank)


def layout(par: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks (the same on every rank, in creation order)."""
    pp, cp, dp, ep = par.pp, par.cp, par.dp, par.ep
    stage = cp * dp
    edp = stage // ep
    groups = {
        "pp": [[p * stage + j for p in range(pp)] for j in range(stage)],
        "dp": [[p * stage + j for j in range(stage)] for p in range(pp)],
        "ep": [[p * stage + e * ep + k for k in range(ep)] for p in range(pp) for e in range(edp)],
        "edp": [[p * stage + e * ep + k for e in range(edp)] for p in range(pp) for k in range(ep)],
    }
    if cp > 1:  # (without CP every rank is its own CP group: no process group is made for it)
        groups["cp"] = [[p * stage + d * cp + c for c in range(cp)] for p in range(pp) for d in range(dp)]
    return groups


def describe(par: ParallelConfig) -> str:
    """The layout as text: one line per rank with its coordinates (dry runs print this)."""
    cp = f" x cp {par.cp}" if par.cp > 1 else ""
    spans = "cp x dp" if par.cp > 1 else "dp"
    lines = [f"world {par.world_size} = pp {par.pp}{cp} x dp {par.dp}; ep {par.ep} spans {spans} ranks "
             f"({par.cp * par.dp // par.ep} replicas of each expert shard); schedule {par.schedule}"
             f"{f' x vpp {par.vpp}' if par.vpp > 1 else ''}, "
             f"{par.num_stages} stages"]
    for r in range(par.world_size):
        c = coords(r, par)
        where = f" cp {c.cp_rank}" if par.cp > 1 else ""
        lines.append(f"  rank {r:>4}: pp {c.pp_rank}{where} dp {c.dp_rank} (ep {c.ep_rank}, edp {c.edp_rank})")
        if r >= 15 and par.world_size > 17:
            lines.append(f"  ... ({par.world_size - 16} more ranks)")
            break
    return "\n".join(lines)


@dataclass
class ParallelState:
    """This rank's coordinates and process groups (``None`` groups mean a single process)."""

    par: ParallelConfig
    coords: RankCoords
    world_size: int
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.coords.rank

    def group(self, kind: str) -> dist.ProcessGroup | None:
        return self.groups.get(kind)

    def size(self, kind: str) -> int:
        return len(self.ranks[kind])


def single_process(par: ParallelConfig) -> ParallelState:
    check_world_size(par, 1)
    return ParallelState(par, coords(0, par), 1, {k: None for k in ("pp", "dp", "cp", "ep", "edp")},
                         {k: [0] for k in ("pp", "dp", "cp", "ep", "edp")})


def world_from_env() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (0, 1 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(par: ParallelConfig, timeout_s: float = 300.0) -> ParallelState:
    """Start (or join) the default process group from torchrun's env and create this layout's groups.

    A single process without torchrun's env gets no process group at all. The world size is
    checked against the config before the group starts.
    """
    rank, world = world_from_env()
    check_world_size(par, world)
    if world == 1 and not dist.is_initialized():
        return single_process(par)
    if not dist.is_initialized():
        kwargs = {}
        if accel.backend() != "cpu":
            kwargs["device_id"] = accel.default_device()
            accel.device_module().set_device(accel.default_device())
        dist.init_process_group(accel.dist_backend(), timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    rank = dist.get_rank()
    state = ParallelState(par, coords(rank, par), world, {"cp": None}, {"cp": [rank]})
    for kind, all_groups in layout(par).items():
        for ranks in all_groups:  # every rank creates every group, in the same order (torch's rule)
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                state.groups[kind], state.ranks[kind] = g, ranks
    return state


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
