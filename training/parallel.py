"""Process groups for pipeline (PP), data (DP) and expert (EP) parallelism, from torchrun's environment.

Rank layout (``world = pp x dp``)::

    rank = pp_rank * dp + dp_rank,   dp_rank = edp_rank * ep + ep_rank

so the ranks of one pipeline stage are contiguous (on one node when dp <= GPUs per node) and an
expert-parallel group is ``ep`` consecutive ranks of that stage, as DeepSeek-V3 spreads its 64-way
EP over the data-parallel ranks of a stage. Groups each rank belongs to:

- ``pp``: the ``pp`` ranks with the same ``dp_rank`` (one per stage): the pipeline's P2P group;
- ``dp``: the ``dp`` ranks of its stage: dense gradients and ZeRO-1 shards of dense parameters;
- ``ep``: the ``ep`` ranks of its stage with the same ``edp_rank``: token all-to-all, expert shards;
- ``edp``: the ``dp / ep`` ranks of its stage with the same ``ep_rank``: replicas of the same
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


def coords(rank: int, par: ParallelConfig) -> RankCoords:
    pp_rank, dp_rank = divmod(rank, par.dp)
    edp_rank, ep_rank = divmod(dp_rank, par.ep)
    return RankCoords(rank, pp_rank, dp_rank, ep_rank, edp_rank)


def layout(par: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks (the same on every rank, in creation order)."""
    pp, dp, ep = par.pp, par.dp, par.ep
    edp = dp // ep
    return {
        "pp": [[p * dp + d for p in range(pp)] for d in range(dp)],
        "dp": [[p * dp + d for d in range(dp)] for p in range(pp)],
        "ep": [[p * dp + e * ep + k for k in range(ep)] for p in range(pp) for e in range(edp)],
        "edp": [[p * dp + e * ep + k for e in range(edp)] for p in range(pp) for k in range(ep)],
    }


def describe(par: ParallelConfig) -> str:
    """The layout as text: one line per rank with its coordinates (dry runs print this)."""
    lines = [f"world {par.world_size} = pp {par.pp} x dp {par.dp}; ep {par.ep} spans dp ranks "
             f"({par.dp // par.ep} replicas of each expert shard); schedule {par.schedule}"
             f"{f' x vpp {par.vpp}' if par.vpp > 1 else ''}, "
             f"{par.num_stages} stages"]
    for r in range(par.world_size):
        c = coords(r, par)
        lines.append(f"  rank {r:>4}: pp {c.pp_rank} dp {c.dp_rank} (ep {c.ep_rank}, edp {c.edp_rank})")
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
    return ParallelState(par, coords(0, par), 1, {k: None for k in ("pp", "dp", "ep", "edp")},
                         {k: [0] for k in ("pp", "dp", "ep", "edp")})


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
    state = ParallelState(par, coords(rank, par), world)
    for kind, all_groups in layout(par).items():
        for ranks in all_groups:  # every rank creates every group, in the same order (torch's rule)
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                state.groups[kind], state.ranks[kind] = g, ranks
    return state


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
