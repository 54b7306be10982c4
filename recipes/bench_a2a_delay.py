"""How much of the expert all-to-all the training step hides: every exchange held back on a slow serial wire.

    python -m recipes.bench_a2a_delay [--nproc 2] [--steps 3] [--comm-ratio 0.5 0.75 1.0] [--latency-ms MS]
                                      [--delay-ms MS] [--json out.json] [--trace FILE] [--set k=v ...]

Trains the demo model (4 layers + MTP, FP8 off) with DualPipeV's two stages in a V on each rank, EP 2 over
DP 2 (2 processes: one core each on a 2-core machine, as one GPU per rank; ``--nproc 4 --set
parallel.pp=2`` gives the demo's PP 2 layout, oversubscribed here), 8 micro-batches per rank (``--set
data.global_batch=N``: N / 4 per rank), on gloo processes, every ``all_to_all_single`` held back on a
serial wire (``DelayedAllToAll``): each exchange occupies it for latency + bytes / bandwidth, the wire is
busy while the host is free, and whoever waits for the exchange sleeps, using no CPU. Per rank, comm =
the exchanges' time on the wire summed over a step is what they cost when nothing hides them; compute =
the step time without the wire. ``--comm-ratio`` sets the bandwidth that makes comm that multiple of
compute at the given ``--latency-ms`` (one row per ratio); ``--delay-ms`` instead gives every exchange,
the per-expert count exchange ahead of each dispatch included, the same fixed delay (no bandwidth term),
which charges a few integers like a token exchange. Overlapped F&B on and off, wire off and on, are
measured in the same run, step by step interleaved so machine-load drift hits all alike; each delayed
step is reported as a multiple of max(comm, compute) and of comm + compute (perfect hiding: 1.0x max;
none: 1.0x sum). The ``F&B chunks`` columns apply the same two multiples to the overlapped F&B chunks
alone (each chunk's time on the wire against its own time without it and the wire time of the exchanges
posted inside it), which is where DualPipe hides the all-to-all in both directions; the warm-up forwards
and cool-down backwards of the schedule have no partner micro-batch and expose their exchanges, a share
that falls as micro-batches per step grow. Target (issue 13): overlapped <= 1.15x max(comm, compute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from accel.cli import (
    BAD_INPUT,
    OK,
    ArgumentParser,
    check_output_file,
    nonnegative_float,
    positive_float,
    positive_int,
)
from accel.trace import TraceRecorder, write_chrome_trace
from recipes.benchutil import print_report, spawn_gloo
from training.config import load_config
from training.parallel import init_parallel
from training.trainer import Trainer, check_static

BASE = ["model.fp8=false", "logging.progress=false", "logging.wandb=disabled", "checkpoint.final=false",
        "checkpoint.interval=0", "run.sample_tokens=0", "run.threads=1", "data.seq_len=64", "data.global_batch=32",
        "data.micro_batch=2", "optim.warmup_steps=1", "parallel.pp=1",
        # weights held still, so the routing, and with it the bytes each step puts on the wire, stay put
        "optim.lr=1e-9", "optim.min_lr=0"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.bench_a2a_delay", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent / "configs" / "tiny_cpu.toml"),
                    help="TOML training config")
    ap.add_argument("--nproc", type=positive_int, default=2, help="gloo processes")
    ap.add_argument("--steps", type=positive_int, default=3, help="timed steps per setting (after one warm-up step)")
    ap.add_argument("--comm-ratio", type=positive_float, nargs="+", default=[0.5, 0.75, 1.0],
                    help="wire bandwidths that make comm this multiple of compute (one row each)")
    ap.add_argument("--latency-ms", type=nonnegative_float, default=0.1, help="the wire's per-exchange latency")
    ap.add_argument("--delay-ms", type=nonnegative_float, default=None,
                    help="one fixed delay per exchange instead of --comm-ratio and --latency-ms")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable)")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="also record one overlapped step at the last setting as a Chrome/Perfetto trace (all ranks)")
    return ap.parse_args(argv)


def check_inputs(ns: argparse.Namespace) -> None:
    """Output paths, both configs, the world size and the data, before any process starts (ValueError)."""
    for option, path in (("--json", ns.json), ("--trace", ns.trace)):
        if path:
            check_output_file(path, option)
    rows_wanted = 1 + (1 if ns.delay_ms is not None else len(ns.comm_ratio))
    for overlap in (True, False):
        check_static(load_config(ns.config, BASE + [f"run.steps={rows_wanted * ns.steps * 2 + 8}",
                                                    f"parallel.overlap={str(overlap).lower()}", *ns.overrides]),
                     ns.nproc)


class DelayedAllToAll:
    """``all_to_all_single`` that lands late on a serial wire (this process only), as a real link would.

    Each exchange occupies the wire for ``latency_s + bytes * s_per_byte`` (bytes: the larger of what it
    sends and what it receives, as on a full-duplex link) from when it is posted or the previous one
    lands, whichever is later; whoever waits for it sleeps until then (no CPU used). So the per-expert
    count exchange ahead of each dispatch (a few integers) costs about the latency and the token
    exchanges their size, as on a GPU's link; ``s_per_byte = 0`` gives every exchange the same fixed
    delay. The exchange itself runs as posted, so the host work the caller stages behind an
    asynchronous exchange (the send-row gather behind the counts, the regrouping plan behind the
    tokens) overlaps the wire as it would on a GPU. ``calls`` records (posted at, bytes, time on the wire).
    """

    def __init__(self, inner) -> None:
        self.inner, self.latency_s, self.s_per_byte, self.wire_free = inner, 0.0, 0.0, 0.0
        self.calls: list[tuple[float, int, float]] = []

    def __call__(self, output, input, *args, async_op: bool = False, **kwargs):
        now = time.perf_counter()
        nbytes = max(_nbytes(output), _nbytes(input))
        busy = self.latency_s + nbytes * self.s_per_byte
        self.calls.append((now, nbytes, busy))
        self.wire_free = max(now, self.wire_free) + busy
        work = _LateWork(self.inner(output, input, *args, async_op=True, **kwargs), self.wire_free)
        if async_op:
            return work
        work.wait()
        return None


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _LateWork:
    """A collective's work handle whose ``wait`` also waits until ``lands_at`` (``time.perf_counter``)."""

    def __init__(self, work, lands_at: float) -> None:
        self.work, self.lands_at = work, lands_at

    def wait(self, *args) -> bool:
        self.work.wait(*args)
        time.sleep(max(self.lands_at - time.perf_counter(), 0.0))
        return True


def _timed_step(trainer: Trainer) -> tuple[float, list[tuple[str, float]]]:
    """The step's wall time and, with a pipeline, the duration of each of its overlapped F&B chunks."""
    dist.barrier()
    t0 = time.perf_counter()
    trainer.train_step()
    wall = time.perf_counter() - t0
    timeline = trainer.pipeline.pipe.last_step_timeline if trainer.pipeline is not None else []
    return wall, [(str(item), start, end) for item, start, end, _ in timeline if "OVERLAP" in str(item)]


def _chunk_multiples(nodelay: list, delayed: list, calls: list[tuple[float, int, float]]) -> tuple[float, float]:
    """Overlapped F&B chunks of one delayed step against the same chunks without delay: total time over
    the total of max(comm, compute), and over comm + compute, with comm = the wire time of the exchanges
    posted in the chunk (``calls``: ``DelayedAllToAll.calls`` of the step)."""
    compute = {name: end - start for name, start, end in nodelay}
    step, best, worst = 0.0, 0.0, 0.0
    for name, start, end in delayed:
        comm = sum(busy for t, _, busy in calls if start <= t < end)
        step += end - start
        best += max(comm, compute[name])
        worst += comm + compute[name]
    return step / max(best, 1e-12), step / max(worst, 1e-12)


def _wire_settings(ns: argparse.Namespace, compute_s: float, calls_per_step: float,
                   bytes_per_step: float) -> list[tuple[float, float]]:
    """(latency_s, s_per_byte) per row: ``--delay-ms`` as it is, else each ``--comm-ratio``'s bandwidth at the
    given latency (comm = calls x latency + bytes x s_per_byte = ratio x compute)."""
    if ns.delay_ms is not None:
        return [(ns.delay_ms / 1e3, 0.0)]
    latency = ns.latency_ms / 1e3
    settings = []
    for ratio in ns.comm_ratio:
        rest = ratio * compute_s - calls_per_step * latency
        if rest <= 0:
            raise ValueError(f"--latency-ms {ns.latency_ms} alone exceeds comm = {ratio} x compute "
                             f"({calls_per_step:.0f} exchanges per step, compute {compute_s:.3f} s): lower it")
        settings.append((latency, rest / max(bytes_per_step, 1.0)))
    return settings


def _bench(rank: int, world: int, ns: argparse.Namespace) -> dict | None:
    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    wire = DelayedAllToAll(dist.all_to_all_single)
    dist.all_to_all_single = wire  # the models' exchanges look it up on the module at each call
    trainers = {}
    rows_wanted = 1 + (1 if ns.delay_ms is not None else len(ns.comm_ratio))  # no wire, then each setting
    for overlap in (True, False):
        cfg = load_config(ns.config, BASE + [f"run.steps={rows_wanted * ns.steps * 2 + 8}",
                                             f"parallel.overlap={str(overlap).lower()}", *ns.overrides])
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        recorder = TraceRecorder(rank) if overlap and ns.trace else None
        trainers[overlap] = Trainer(cfg, ps, tempfile.mkdtemp(), "disabled", check_static(cfg, world), recorder)
        _timed_step(trainers[overlap])  # warm-up: allocations, first-use imports
    n0 = len(wire.calls)
    base = [_timed_step(trainers[o])[0] for o in (True, False, True, False)]
    sizing = torch.tensor([statistics.median(base), (len(wire.calls) - n0) / 4,
                           sum(b for _, b, _ in wire.calls[n0:]) / 4], dtype=torch.float64)
    dist.broadcast(sizing, 0)  # every rank's wire runs at rank 0's settings
    settings = [(0.0, 0.0), *_wire_settings(ns, *sizing.tolist())]
    walls: dict[tuple[bool, int], list[float]] = {(o, d): [] for o in (True, False) for d in range(len(settings))}
    comms: dict[tuple[bool, int], list[float]] = {key: [] for key in walls}  # wire time of each step's exchanges
    chunks: dict[int, list] = {d: [] for d in range(len(settings))}  # (chunks of the step, its calls)
    for _ in range(ns.steps):
        for (overlap, d), acc in walls.items():
            (wire.latency_s, wire.s_per_byte), n0 = settings[d], len(wire.calls)
            wall, step_chunks = _timed_step(trainers[overlap])
            acc.append(wall)
            comms[(overlap, d)].append(sum(busy for _, _, busy in wire.calls[n0:]))
            if overlap:
                chunks[d].append((step_chunks, wire.calls[n0:]))
    if ns.trace:
        recorder = trainers[True].recorder
        wire.latency_s, wire.s_per_byte = settings[-1]
        recorder.spans.clear()
        _timed_step(trainers[True])
        states = [None] * world if rank == 0 else None
        dist.gather_object(recorder.state(), states, dst=0)
        if rank == 0:
            write_chrome_trace(ns.trace, states)
    wire.latency_s, wire.s_per_byte = 0.0, 0.0
    if rank != 0:
        return None
    compute = {o: statistics.median(walls[(o, 0)]) for o in (True, False)}
    rows = []
    for d in range(1, len(settings)):
        latency, s_per_byte = settings[d]
        per_step = [_chunk_multiples(chunks[0][i][0], chunks[d][i][0], chunks[d][i][1]) for i in range(ns.steps)]
        for overlap in (True, False):
            steps, comm_steps, c0 = walls[(overlap, d)], comms[(overlap, d)], compute[overlap]
            comm = statistics.median(comm_steps)
            row = {"comm/compute": f"{comm / compute[True]:.2f}",
                   "mode": "overlapped F&B" if overlap else "F then B", "latency_ms": round(latency * 1e3, 2),
                   "MB/s": round(1e-6 / s_per_byte, 2) if s_per_byte else "-",
                   "compute_s": round(compute[overlap], 4), "comm_s": round(comm, 4),
                   "step_s": round(statistics.median(steps), 4),
                   "x_max": round(statistics.median(t / max(c, c0) for t, c in zip(steps, comm_steps)), 3),
                   "x_sum": round(statistics.median(t / (c + c0) for t, c in zip(steps, comm_steps)), 3)}
            if overlap:
                row["chunks_x_max"] = round(statistics.median(m for m, _ in per_step), 3)
                row["chunks_x_sum"] = round(statistics.median(s for _, s in per_step), 3)
            rows.append(row)
    return {"rows": rows, "all_to_alls_per_step": sizing[1].item(), "bytes_per_step": sizing[2].item()}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check_inputs(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    result = spawn_gloo(_bench, ns.nproc, ns)
    print_report("expert all-to-all hidden behind compute (every exchange on a slow serial wire)", result["rows"],
                 json_path=ns.json,
                 notes=[f"comm = the wire time of a step's {result['all_to_alls_per_step']:.0f} all-to-alls on rank 0 "
                        f"({result['bytes_per_step'] / 1e6:.1f} MB: counts + tokens + combine forward, two reverse "
                        "exchanges backward, per MoE layer and micro-batch), each latency + bytes / bandwidth "
                        "(MB/s '-': a fixed delay each)",
                        "x_max = step / max(comm, compute), x_sum = step / (comm + compute); target: "
                        "overlapped x_max <= 1.15",
                        "chunks_*: the same over the overlapped F&B chunks only (each against itself without the wire)",
                        "x_*: median over the timed steps, each step against its own comm; settings interleaved "
                        "step by step"])
    return OK


if __name__ == "__main__":
    raise SystemExit(main())
