"""Layouts: enumerate the legal ones, drop those that do not fit, time the rest, rank them.

A layout is the ``[parallel]`` section plus the micro-batching and the memory switches of a training
config. Each is turned into the very ``TrainConfig`` ``recipes.train`` would run (``to_config``), so
legality is ``training.config.validate`` + ``training.trainer.check_layout`` and memory is
``planner.memory.estimate``: plan, dry run and launch agree by construction. Time: per-stage
durations from ``costs`` fed to ``dualpipe.simulator`` for the layout's real schedule (so bubbles are
the schedule's, not a closed form), stretched by the expected slowest node (``straggler_factor``), then
the ZeRO-1 gradient reduce-scatter / parameter all-gather and the optimizer step, which our runtime runs
after the pipeline (exposed).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from dualpipe.ir import Overlap
from dualpipe.schedules import SCHEDULES
from dualpipe.simulator import SimResult, program
from models.deepseek_v3 import ModelArgs
from models.deepseek_v4 import ModelArgs as V4Args
from planner.costs import (
    BF16,
    RECOMPUTE_POLICIES,
    Durations,
    OpTimer,
    Workload,
    muon_flops_per_param,
    part_durations,
    recompute_kinds,
)
from planner.memory import RankMemory, estimate, precision
from planner.system import System
from training.config import TrainConfig, validate
from training.stages import num_model_stages, split_layers
from training.trainer import check_layout

SEARCH_SCHEDULES = SCHEDULES  # every pipeline schedule the IR builds
# The time terms a step is built from beyond the roofline and the simulated schedule, each switchable so that
# ``planner.loo`` can keep a term only if it lowers the leave-one-out error against the public runs:
# memory_latency: the system file's fixed cost per memory-bound kernel; a2a_latency: the all-to-all's fixed cost per
# call by group size; gradient_passes: the optimizer's passes over the whole gradient buffer; straggler: the stretch
# by the slowest node; dp_comm: the exposed ZeRO-1 / DP collectives after the pipeline.
TIME_TERMS = ("memory_latency", "a2a_latency", "gradient_passes", "straggler", "dp_comm")
# the terms the planner uses: those leave-one-out kept (``recipes.plan_loo``, benchmarks/planner.md "Leave-one-out";
# with a compute scale per system and a per-step overhead fitted, the straggler stretch no longer lowers the mean
# absolute leave-one-out error, so it went)
DEFAULT_TERMS = frozenset(TIME_TERMS) - {"straggler"}
LAYOUT_KEYS = ("pp", "dp", "ep", "schedule", "micro_batch", "microbatches", "recompute", "fp8", "moments", "eplb",
               "zero1", "vpp", "cp")
CP_MIN_LOCAL = 4096  # context parallelism is searched while each rank keeps at least this many tokens of a sequence


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    ep: int
    schedule: str
    micro_batch: int
    microbatches: int
    recompute: str = "none"  # a RECOMPUTE_POLICIES key
    fp8: bool = True
    moments: str = "bfloat16"  # optim.moments_dtype: bfloat16 (V3) | param (the master weights' dtype)
    eplb: int = 0  # EPLB redundant expert slots per MoE layer (0 = EPLB off)
    zero1: bool = True
    vpp: int = 1  # model chunks per pipeline rank (interleaved1f1b: >= 2)
    cp: int = 1  # context-parallel ranks per sequence; EP and ZeRO-1 span the cp x dp ranks of a stage

    def __str__(self) -> str:
        cp = f"cp{self.cp} " if self.cp > 1 else ""
        return (f"pp{self.pp} {cp}dp{self.dp} ep{self.ep} {self.schedule}{f' vpp{self.vpp}' if self.vpp > 1 else ''} "
                f"mb{self.micro_batch}x{self.microbatches} "
                f"rc={self.recompute} {'fp8' if self.fp8 else 'bf16'}{'' if self.moments == 'bfloat16' else ' m32'}"
                f"{f' eplb+{self.eplb}' if self.eplb else ''}"
                f"{'' if self.zero1 else ' no-zero1'}")


@dataclass
class Evaluation:
    layout: Layout
    status: str  # ok | oom | illegal | dominated
    reason: str = ""
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    bubble_fraction: float = math.nan
    exposed_comm_s: float = math.nan
    peak_bytes: int = 0
    ranks: list[RankMemory] = field(default_factory=list)
    sim: SimResult | None = None  # the simulated pipeline (single evaluations only; a search keeps figures)
    # the step's parts in seconds (pipeline before stragglers and its exposed communication on the busiest rank,
    # straggler factor, dp_comm, optimizer step without and with the gradient passes' share): what planner.loo
    # recombines with terms switched off
    parts: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict:
        """The JSON record of this layout (``--json``)."""
        return {"layout": dataclasses.asdict(self.layout), "name": str(self.layout), "status": self.status,
                "reason": self.reason, "step_time_ms": _num(self.step_time_s * 1e3),
                "tokens_per_s": _num(self.tokens_per_s), "mfu": _num(self.mfu),
                "bubble_fraction": _num(self.bubble_fraction), "exposed_comm_ms": _num(self.exposed_comm_s * 1e3),
                "peak_memory_gib": self.peak_bytes / 1024**3 if self.ranks else None,
                "memory_gib_per_pp_rank": [r.total_bytes / 1024**3 for r in self.ranks]}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class Request:
    """What the user asks for: model (as a base training config), cluster and workload."""

    base: TrainConfig
    system: System
    gpus: int
    seq_len: int
    global_batch: int
    imbalance: float = 1.0  # expert load max / mean without EPLB
    # model.fp8_recipe of the FP8 GEMMs (blockwise: V3's 1x128 / 128x128; mxfp8: 1x32 UE8M0). The planner takes
    # it here until the config carries the field; planner.memory.estimate reads the same value.
    fp8_recipe: str = "blockwise"
    terms: frozenset[str] = DEFAULT_TERMS  # the TIME_TERMS this request's step times include

    def __post_init__(self) -> None:
        unknown = set(self.terms) - set(TIME_TERMS)
        if unknown:
            raise ValueError(f"time terms: unknown {sorted(unknown)}; expected some of {', '.join(TIME_TERMS)}")
        g = self.system.gpus_per_node
        if self.gpus < 1 or self.gpus % g and self.gpus > g:
            raise ValueError(f"--gpus {self.gpus} must be a positive multiple of --gpus-per-node {g} "
                             "(whole nodes), or fewer GPUs than one node")
        if self.seq_len < 2 or self.global_batch < 1:
            raise ValueError(f"--seq-len must be >= 2 and --global-batch >= 1, got {self.seq_len}, {self.global_batch}")
        OpTimer(self.system, self.fp8_recipe)  # an unknown recipe, or MXFP8 where the GPU has none: one-line error
        if not self.imbalance >= 1.0:
            raise ValueError(f"--expert-imbalance is the busiest expert's load over the mean, so >= 1.0; "
                             f"got {self.imbalance}")

    def timing_system(self) -> System:
        """The system file with the fixed costs of switched-off terms at zero (what the op timer sees)."""
        s = self.system
        if "memory_latency" not in self.terms:
            s = dataclasses.replace(s, memory_latency_us=0.0)
        if "a2a_latency" not in self.terms:
            s = dataclasses.replace(s, all_to_all_latency_us={})
        return s


@dataclass(frozen=True)
class Space:
    """The values searched for each free key (a key in ``fixed`` takes only its fixed value)."""

    micro_batch: tuple[int, ...] = (1, 2, 4)
    schedules: tuple[str, ...] = SEARCH_SCHEDULES
    vpp: tuple[int, ...] = (2, 4, 8)  # model chunks per rank tried with interleaved1f1b (Megatron-Bridge runs 4, 8)
    recompute: tuple[str, ...] = ("none", "v3", "block")
    fp8: tuple[bool, ...] = (True, False)
    moments: tuple[str, ...] = ("bfloat16", "param")
    eplb: tuple[int, ...] = (0,)
    zero1: tuple[bool, ...] = (True,)
    cp: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # each used where seq_len / cp >= CP_MIN_LOCAL (or fixed)
    fixed: dict = field(default_factory=dict)


def to_config(req: Request, lay: Layout) -> TrainConfig:
    """The training config of ``lay``: the base config with [parallel], batch, FP8, recompute and EPLB set."""
    cfg = copy.deepcopy(req.base)
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=lay.pp, dp=lay.dp, ep=lay.ep, schedule=lay.schedule,
                                       vpp=lay.vpp, zero1=lay.zero1, cp=lay.cp)
    cfg.data = dataclasses.replace(cfg.data, seq_len=req.seq_len, micro_batch=lay.micro_batch,
                                   global_batch=lay.dp * lay.micro_batch * lay.microbatches)
    cfg.run = dataclasses.replace(cfg.run, nproc=lay.pp * lay.cp * lay.dp)
    recompute = list(RECOMPUTE_POLICIES[lay.recompute])
    cfg.model = dataclasses.replace(cfg.model, fp8=lay.fp8, overrides={**cfg.model.overrides, "recompute": recompute})
    if hasattr(cfg.model, "fp8_recipe"):  # the config field of the MXFP8 work; until it lands the request carries it
        cfg.model = dataclasses.replace(cfg.model, fp8_recipe=req.fp8_recipe)
    cfg.eplb = dataclasses.replace(cfg.eplb, enabled=lay.eplb > 0, redundant_experts=lay.eplb)
    cfg.optim = dataclasses.replace(cfg.optim, moments_dtype=lay.moments)
    if cfg.data.batch_ramp_start or cfg.schedule.global_batch:
        try:
            validate(cfg)
        except ValueError:  # the base's ramp does not suit this layout: plan for the full batch only
            cfg.data = dataclasses.replace(cfg.data, batch_ramp_start=0, batch_ramp_steps=0)
            cfg.schedule = dataclasses.replace(cfg.schedule, global_batch=[])
    return cfg


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(req: Request, args: ModelArgs, space: Space) -> Iterator[Layout]:
    """Every layout of ``space`` for the request whose sizes divide (legality is checked later)."""
    fx = space.fixed
    units = args.n_layers + args.n_mtp_layers
    experts = args.n_routed_experts if isinstance(args, V4Args) or args.has_moe else 1
    fp8s = space.fp8 if req.system.fp8_tflops > 0 else (False,)
    stage_ranks = [(p, c) for p in _divisors(req.gpus) for c in _cp_sizes(req, space, req.gpus // p)]
    for pp, cp in stage_ranks:
        dp = req.gpus // (pp * cp)
        if pp > units or fx.get("pp", pp) != pp or fx.get("dp", dp) != dp:
            continue
        scheds = ("none",) if pp == 1 else space.schedules
        for ep in (e for e in _divisors(cp * dp) if experts % e == 0):  # EP spans the cp x dp ranks of a stage
            vpps = (fx["vpp"],) if "vpp" in fx else space.vpp
            for schedule, vpp in ((s, v) for s in scheds for v in (vpps if s == "interleaved1f1b" else (1,))):
                if pp * vpp > units:
                    continue
                for mb in space.micro_batch if "micro_batch" not in fx else (fx["micro_batch"],):
                    if req.global_batch % (dp * mb):
                        continue
                    nmb = req.global_batch // (dp * mb)
                    for rc in space.recompute:
                        for fp8 in fp8s:
                                for moments in space.moments:
                                    for eplb in space.eplb:
                                        for z in space.zero1:
                                            lay = Layout(pp, dp, ep, schedule, mb, nmb, rc, fp8, moments, eplb, z,
                                                         vpp, cp)
                                            if all(getattr(lay, k) == v for k, v in fx.items()):
                                                yield lay


def _cp_sizes(req: Request, space: Space, ranks: int) -> list[int]:
    """The context-parallel sizes to try with ``ranks`` GPUs per pipeline stage: those of ``space`` dividing
    them whose 2 x cp chunks split the sequence evenly and leave each rank >= ``CP_MIN_LOCAL`` tokens (a fixed
    cp is tried as given)."""
    sizes = (space.fixed["cp"],) if "cp" in space.fixed else space.cp
    return [cp for cp in sizes if ranks % cp == 0 and req.seq_len % (2 * cp if cp > 1 else 1) == 0
            and (cp == 1 or "cp" in space.fixed or req.seq_len // cp >= CP_MIN_LOCAL)]


# ---- time -----------------------------------------------------------------------------------

class StageCosts:
    """``dualpipe.simulator`` costs with per-stage durations: the simulator asks ``of(item)`` and ``p2p``.

    Alone, an F runs its compute then its all-to-alls, a B/I likewise: each exchange waits on what came
    before it, and nothing else is there to hide it (1F1B, and every schedule's warm-up and cool-down).
    DualPipe's overlapped F&B chunk runs one micro-batch's exchanges behind the other's compute in both
    directions, but the exchanges share one wire and some compute has no exchange to hide behind: the chunk
    takes the longer of its compute (slowed by the SMs the communication occupies) and
    ``head + comm + tail``, with ``comm`` both actions' exchanges end to end, ``head`` the shorter of the two
    computes before a first exchange and ``tail`` the shorter after a last one (``Durations.head_*`` /
    ``tail_*``): a bound any interleave of the two obeys. Every item also pays the runtime's host
    ``overhead`` per computation pass (the system file's ``action_overhead_us``; an overlapped F&B runs two
    passes), and the simulator charges ``send`` / ``recv`` per P2P message posted / taken
    (``send_overhead_us`` / ``recv_overhead_us``).
    """

    def __init__(self, parts: list[Durations], part_of: list[int], p2p: float, sm_fraction: float,
                 overhead: float = 0.0, send: float = 0.0, recv: float = 0.0):
        self.parts, self.part_of, self.p2p, self.sm_fraction = parts, part_of, p2p, sm_fraction
        self.overhead, self.send, self.recv = overhead, send, recv

    def _split(self, item) -> tuple[float, float]:
        """(compute, communication) of an item when run alone."""
        d = self.parts[self.part_of[item.stage]]
        return {"F": (d.f, d.comm_f), "B": (d.i + d.w, d.comm_b), "I": (d.i, d.comm_b), "W": (d.w, 0.0)}[item.kind]

    def _ends(self, item) -> tuple[float, float]:
        """(head, tail) of an item: its compute before its first exchange and after its last. An I's share of
        the backward's head and tail is its share of the backward (W runs later, in its own action)."""
        d = self.parts[self.part_of[item.stage]]
        if item.kind == "F":
            return d.head_f, d.tail_f
        share = 1.0 if item.kind == "B" else d.i / (d.i + d.w) if d.i + d.w else 0.0
        return d.head_b * share, d.tail_b * share

    def of(self, item) -> float:
        if isinstance(item, Overlap):
            (cf, af), (cb, ab) = self._split(item.forward), self._split(item.backward)
            comm = af + ab
            if comm == 0:
                return cf + cb + 2 * self.overhead
            (hf, tf), (hb, tb) = self._ends(item.forward), self._ends(item.backward)
            wire = min(hf if af else cf, hb if ab else cb) + comm + min(tf if af else cf, tb if ab else cb)
            return max((cf + cb) / (1.0 - self.sm_fraction), wire) + 2 * self.overhead
        compute, comm = self._split(item)
        return compute + comm + self.overhead

    def exposed(self, item) -> float:
        """Communication time of ``item`` not hidden behind computation."""
        if isinstance(item, Overlap):
            cf, cb = self._split(item.forward)[0], self._split(item.backward)[0]
            return max(0.0, self.of(item) - 2 * self.overhead - (cf + cb))
        return self._split(item)[1]

    def compute(self, item) -> float:
        return sum(self._split(a)[0] for a in item.parts)


def assemble(schedule: str, pp: int, microbatches: int, parts: list[Durations], p2p: float,
             sm_fraction: float, overhead: float = 0.0, send: float = 0.0, recv: float = 0.0, vpp: int = 1
             ) -> SimResult:
    """The pipeline part of a step: ``schedule`` over ``pp`` ranks timed by ``dualpipe.simulator`` with the
    per-stage durations ``parts`` (model stage order), ``p2p`` seconds per activation/gradient message in flight
    and the runtime's host seconds per pass (``overhead``) and per message posted (``send``) and taken (``recv``).
    ``none`` (no pipeline) is gradient accumulation: one rank running F, B per micro-batch; ``vpp`` the model chunks
    per rank of ``interleaved1f1b`` (``parts`` then has ``pp x vpp`` entries)."""
    name = "1f1b" if schedule == "none" else schedule
    prog = program(name, pp, microbatches, vpp)
    return prog.run(StageCosts(parts, list(prog.schedule.layout.parts), p2p, sm_fraction, overhead, send, recv))


def _ring_seconds(system: System, nbytes: float, ranks: int, span_nodes: bool, factor: float) -> float:
    """A ring reduce-scatter (factor 1), all-gather (1) or all-reduce (2) of ``nbytes`` over ``ranks``."""
    if ranks <= 1 or nbytes == 0:
        return 0.0
    link = system.inter_node if span_nodes else system.intra_node
    eff = system.collective_efficiency["ring"]
    return factor * ((ranks - 1) / ranks * nbytes / (link.bandwidth_gb_s * 1e9 * eff)
                     + (ranks - 1) * link.latency_us * 1e-6)


GRADIENT_PASSES = 4  # zero (write), scale by 1 / dp (read + write), global norm (read): full buffer, every step


def optimizer_seconds(req: Request, lay: Layout, cfg: TrainConfig, ranks: list[RankMemory],
                      args: ModelArgs, passes: int = GRADIENT_PASSES) -> tuple[float, float]:
    """(DP communication, optimizer step) seconds after the pipeline, on the slowest pipeline rank.

    Dense gradients reduce over the stage's ``dp`` ranks, expert gradients over its ``dp / ep`` replicas
    (every ``ep``-th rank: on other nodes once ``ep`` fills a node); ZeRO-1 reduce-scatters them and
    all-gathers the updated parameters, without ZeRO-1 they are all-reduced; with FP32 masters
    (``optim.master_dtype``) the gradients travel in FP32, the gathered BF16 working weights in BF16. The step
    reads gradient, moments (and master) and writes parameter, moments (and master) of its shard, after
    ``passes`` (``GRADIENT_PASSES``) passes over the rank's whole gradient buffer (``training.trainer.train_step``:
    zeroed before the step, scaled by 1 / dp around its reduction, read for the global norm; Megatron-Core's step
    makes the same four, as SimuMax accounts it). Muon (``optim.name``) adds its Newton-Schulz GEMMs
    (``planner.costs.muon_flops_per_param``) on the owner of each matrix.
    """
    s, g = req.system, req.system.gpus_per_node
    p = precision(cfg, accelerator=True)
    pbytes, master, gbytes = p.param, p.master, p.grad  # gradients accumulate in the masters' dtype, if any
    ranks_dp = lay.cp * lay.dp  # gradients reduce over the cp x dp ranks of a stage (every one holds a share)
    edp = ranks_dp // lay.ep
    comm = step = 0.0
    for r in ranks:
        dense, expert = r.params - r.expert_params, r.expert_params
        spans_dp, spans_edp = ranks_dp > g, (edp > 1 and lay.ep * edp > g)
        if lay.zero1:  # reduce-scatter the gradients, all-gather the updated working weights
            c = sum(_ring_seconds(s, n * b, ranks_dp, spans_dp, 1.0) for n, b in ((dense, gbytes), (dense, pbytes)))
            c += sum(_ring_seconds(s, n * b, edp, spans_edp, 1.0) for n, b in ((expert, gbytes), (expert, pbytes)))
            shard = dense / ranks_dp + expert / edp
        else:
            c = _ring_seconds(s, dense * gbytes, ranks_dp, spans_dp, 2.0) + _ring_seconds(s, expert * gbytes, edp,
                                                                                         spans_edp, 2.0)
            shard = dense + expert
        # as the memory model stores them: the optimizer item holds the moments (and the masters, if any)
        state_bytes = (r.optim_bytes / shard - master) if shard else 2 * pbytes
        # read g, (master), the moments (AdamW m, v; Muon's buffer); write p, (master), the moments
        traffic = shard * (gbytes + 2 * master + 2 * state_bytes + pbytes + (0 if master else 2 * pbytes))
        traffic += passes * (dense + expert) * gbytes
        seconds = traffic / (s.memory_gbps * 1e9 * s.kernel_efficiency("memory"))
        if cfg.optim.name == "muon":  # Newton-Schulz in BF16 GEMMs, each matrix on its owner (an even share)
            per_dense, per_expert = muon_flops_per_param(args, lay.ep, cfg.optim.muon_ns_steps)
            owned_dense, owned_expert = (dense / ranks_dp, expert / edp) if lay.zero1 else (dense, expert)
            flops = per_dense * owned_dense + per_expert * owned_expert
            seconds += flops / (s.bf16_tflops * 1e12 * s.kernel_efficiency("gemm"))
        comm = max(comm, c)
        step = max(step, seconds)
    return comm, step


def time_layout(req: Request, lay: Layout, args: ModelArgs, cfg: TrainConfig, ranks: list[RankMemory],
                timer: OpTimer, block_cache: dict, pipeline_cache: dict | None = None) -> Evaluation:
    """Simulate one step of ``lay`` (memory already known to fit). ``pipeline_cache`` memoises the pipeline
    figures by everything the simulation sees (layouts differing only in optimizer settings share them); without
    it the evaluation keeps the simulated timeline (for ``--trace``)."""
    s = req.system
    num = num_model_stages(lay.schedule, lay.pp, lay.vpp)
    ranges = split_layers(args, num)
    work = Workload(lay.micro_batch, req.seq_len, lay.ep, lay.fp8, recompute_kinds(lay.recompute),
                    cfg.balance.max_nodes, _imbalance(req, args, lay), lay.cp)
    parts = [part_durations(timer, args, rng, i == 0, i == num - 1, work, block_cache) for i, rng in enumerate(ranges)]
    link = s.inter_node if lay.cp * lay.dp >= s.gpus_per_node else s.intra_node
    streams = args.hc_mult if isinstance(args, V4Args) else 1  # V4's residual is hc_mult hidden states
    p2p = link.seconds(work.tokens * streams * args.dim * BF16, s.collective_efficiency["p2p"]) if lay.pp > 1 else 0.0
    key = (lay.schedule, lay.pp, lay.vpp, lay.microbatches, tuple(parts), p2p)
    sim = None
    if pipeline_cache is None or key not in pipeline_cache:
        sim = assemble(lay.schedule, lay.pp, lay.microbatches, parts, p2p, s.comm_sm_fraction,
                       s.action_overhead_us * 1e-6, s.send_overhead_us * 1e-6, s.recv_overhead_us * 1e-6, lay.vpp)
        busiest = max(range(lay.pp), key=sim.busy)
        figures = (sim.makespan, sim.busy(busiest), sum(sim.costs.exposed(iv.item) for iv in sim.timeline[busiest]))
        if pipeline_cache is not None:
            pipeline_cache[key] = figures
            sim = None
    else:
        figures = pipeline_cache[key]
    makespan, busy, exposed = figures
    dp_comm, opt = optimizer_seconds(req, lay, cfg, ranks, args)
    opt_bare = optimizer_seconds(req, lay, cfg, ranks, args, passes=0)[1]
    stretch = straggler_factor(s.jitter_cv, math.ceil(req.gpus / s.gpus_per_node))
    breakdown = {"pipeline": makespan, "exposed_pipeline_comm": exposed, "microbatches": lay.microbatches,
                 "straggler": stretch, "dp_comm": dp_comm, "optimizer": opt_bare, "optimizer_with_passes": opt}
    makespan *= stretch if "straggler" in req.terms else 1.0
    dp_comm *= "dp_comm" in req.terms
    opt = opt if "gradient_passes" in req.terms else opt_bare
    step = makespan + dp_comm + opt
    flops = sum(d.flops for d in parts) * lay.microbatches * lay.dp * lay.cp
    tokens = req.global_batch * req.seq_len
    return Evaluation(lay, "ok", step_time_s=step, tokens_per_s=tokens / step,
                      mfu=flops / (step * req.gpus * s.bf16_tflops * 1e12),
                      bubble_fraction=(makespan - busy) / makespan, exposed_comm_s=exposed + dp_comm,
                      peak_bytes=max(r.total_bytes for r in ranks), ranks=ranks, sim=sim, parts=breakdown)


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals]: integral of x n phi(x) Phi(x)^(n-1), midpoint rule on
    [-8, 8] (the tails beyond hold < 1e-14 of the mass)."""
    if n <= 1:
        return 0.0
    h = 1e-3
    total = 0.0
    for j in range(16000):
        x = -8.0 + (j + 0.5) * h
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * pdf * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return total * h


def straggler_factor(jitter_cv: float, nodes: int) -> float:
    """The pipeline's expected stretch from stragglers: every step ends in collectives over all ``nodes`` (the
    gradient norm's all-reduce spans the world), so each step waits for the slowest node. With each node's step
    time independent with coefficient of variation ``jitter_cv`` (GPUs inside a node run in lock-step), that is
    1 + cv x E[max of ``nodes`` standard normals] (1.0 on one node). The same factor for every layout of a
    cluster: it moves step times, not rankings."""
    return 1.0 + jitter_cv * expected_max_normal(nodes)


def _imbalance(req: Request, args: ModelArgs, lay: Layout) -> float:
    """Expert load max / mean after EPLB: its redundant slots take the hottest experts' overflow, modelled as
    shrinking the excess by E / (E + slots). 1.0 (the default) is perfectly balanced routing."""
    if not lay.eplb:
        return req.imbalance
    e = args.n_routed_experts
    return 1.0 + (req.imbalance - 1.0) * e / (e + lay.eplb)


# ---- the search -----------------------------------------------------------------------------

def evaluate(req: Request, lay: Layout, timer: OpTimer | None = None, block_cache: dict | None = None,
             pipeline_cache: dict | None = None, timed: bool = True) -> Evaluation:
    """Legality, memory and (when it fits and ``timed``) the simulated step of one layout."""
    cfg = to_config(req, lay)
    try:
        validate(cfg)
        args = check_layout(cfg)
    except ValueError as exc:
        return Evaluation(lay, "illegal", str(exc))
    # the dry run's estimate (``--device``), margin included
    est = estimate(cfg, args, device=req.system.name, fp8_recipe=req.fp8_recipe)
    ranks, peak = est.ranks, est.peak_bytes
    if peak > req.system.capacity_bytes:
        worst = est.worst
        big = ", ".join(f"{k} {v / 1024**3:.1f}" for k, v in worst.largest())
        return Evaluation(lay, "oom", f"pp rank {worst.pp_rank} needs {peak / 1024**3:.1f} GiB > "
                          f"{req.system.memory_gib:.1f} GiB on {req.system.name} (largest: {big} GiB)",
                          peak_bytes=peak, ranks=ranks)
    if not timed:
        return Evaluation(lay, "ok", peak_bytes=peak, ranks=ranks)
    return time_layout(req, lay, args, cfg, ranks, timer or OpTimer(req.timing_system(), req.fp8_recipe),
                       {} if block_cache is None else block_cache, pipeline_cache)


def search(req: Request, args: ModelArgs, space: Space) -> list[Evaluation]:
    """Every layout of ``space``, ranked: fitting ones by step time, then the rest.

    A layout with more recompute than a fitting sibling (same everything else), or with moments in the
    parameter dtype where its BF16-moment twin fits, is only slower and larger, so it is reported as
    dominated instead of timed; a fixed ``recompute`` or ``moments`` is always timed.
    """
    timer, cache, pipelines = OpTimer(req.timing_system(), req.fp8_recipe), {}, {}
    out: list[Evaluation] = []
    fits: set[tuple] = set()
    for lay in layouts(req, args, space):
        key = dataclasses.astuple(dataclasses.replace(lay, recompute="none"))
        twin = dataclasses.astuple(dataclasses.replace(lay, moments="bfloat16"))
        if key in fits and "recompute" not in space.fixed and key != dataclasses.astuple(lay):
            ev = Evaluation(lay, "dominated", "a layout with less recompute fits and is faster")
        elif lay.moments != "bfloat16" and twin in fits and "moments" not in space.fixed:
            ev = Evaluation(lay, "dominated", "its twin with BF16 moments fits and is faster")
        else:
            ev = evaluate(req, lay, timer, cache, pipelines)
        if ev.status in ("ok", "dominated"):  # something at least as fast fits: what this dominates is dominated
            fits.update((key, dataclasses.astuple(lay)))
        out.append(ev)
    order = {"ok": 0, "oom": 1, "dominated": 2, "illegal": 3}
    out.sort(key=lambda e: (order[e.status], e.step_time_s if e.status == "ok" else e.peak_bytes))
    return out


def nearest_misses(evals: list[Evaluation], n: int = 5) -> list[Evaluation]:
    """The out-of-memory layouts that came closest to fitting."""
    return sorted((e for e in evals if e.status == "oom"), key=lambda e: e.peak_bytes)[:n]


def tokens_per_step(req: Request) -> int:
    return req.global_batch * req.seq_len
