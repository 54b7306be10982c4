"""How much of the expert all-to-all the training step hides: a fixed delay injected into every exchange.

    python -m recipes.bench_a2a_delay [--nproc 2] [--steps 3] [--comm-ratio 0.5 0.75 1.0] [--delay-ms MS]
                                      [--json out.json] [--trace FILE] [--set k=v ...]

Trains the demo model (4 layers + MTP, FP8 off) with DualPipeV's two stages in a V on each rank, EP 2 over
DP 2 (2 processes: one core each on a 2-core machine, as one GPU per rank; ``--nproc 4 --set
parallel.pp=2`` gives the demo's PP 2 layout, oversubscribed here), 8 micro-batches per rank, on
gloo processes, every ``all_to_all_single`` held back by a fixed delay (``DelayedAllToAll``: a serial wire
that is busy while the host is free; whoever waits for the exchange sleeps, using no CPU). Per rank,
comm = (all-to-alls per step) x delay is what the exchanges cost when nothing hides them; compute = the
step time without delay. ``--comm-ratio`` picks delays that make comm that multiple of compute (one row
per ratio; ``--delay-ms`` a fixed one instead). Overlapped F&B on and off, delay off and on, are
measured in the same run, step by step interleaved so machine-load drift hits all alike; each delayed
step is reported as a multiple of max(comm, compute) and of comm + compute (perfect hiding: 1.0x max;
none: 1.0x sum). The ``F&B chunks`` columns apply the same two multiples to the overlapped F&B chunks
alone (each chunk's time with the delay against its own time without it and the delays posted inside
it), which is where DualPipe hides the all-to-all in both directions; the warm-up forwards and
cool-down backwards of the schedule have no partner micro-batch and expose their exchanges.
Target (issue 13): overlapped <= 1.15x max(comm, compute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from accel.trace import TraceRecorder, write_chrome_trace
from recipes.benchutil import print_report, spawn_gloo
from training.config import load_config
from training.parallel import init_parallel
from training.trainer import Trainer, check_static

BASE = ["model.fp8=false", "logging.progress=false", "logging.wandb=disabled", "checkpoint.final=false",
        "checkpoint.interval=0", "run.sample_tokens=0", "run.threads=1", "data.seq_len=64", "data.global_batch=32",
        "data.micro_batch=2", "optim.warmup_steps=1", "parallel.pp=1"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m recipes.bench_a2a_delay", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="recipes/configs/tiny_cpu.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up step)")
    ap.add_argument("--comm-ratio", type=float, nargs="+", default=[0.5, 0.75, 1.0],
                    help="delays that make comm this multiple of compute (one row each)")
    ap.add_argument("--delay-ms", type=float, default=None, help="one fixed delay instead of --comm-ratio")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="also record one overlapped step at the last delay as a Chrome/Perfetto trace (all ranks)")
    ns = ap.parse_args(argv)
    if ns.steps < 1 or any(r <= 0 for r in ns.comm_ratio) or (ns.delay_ms is not None and ns.delay_ms < 0):
        ap.error("--steps must be >= 1, --comm-ratio values > 0, --delay-ms >= 0")
    return ns


class DelayedAllToAll:
    """``all_to_all_single`` that lands ``delay_s`` late on a serial wire (this process only).

    Each exchange occupies the wire for ``delay_s`` from when it is posted or the previous one lands,
    whichever is later; whoever waits for it sleeps until then (no CPU used). The exchange itself runs
    as posted, so the host work the caller stages behind an asynchronous exchange (the send-row gather
    behind the counts, the regrouping plan behind the tokens) overlaps the wire as it would on a GPU.
    """

    def __init__(self, inner) -> None:
        self.inner, self.delay_s, self.starts, self.wire_free = inner, 0.0, [], 0.0

    def __call__(self, *args, async_op: bool = False, **kwargs):
        now = time.perf_counter()
        self.starts.append(now)
        self.wire_free = max(now, self.wire_free) + self.delay_s
        work = _LateWork(self.inner(*args, async_op=True, **kwargs), self.wire_free)
        if async_op:
            return work
        work.wait()
        return None


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


def _chunk_multiples(nodelay: list, delayed: list, starts: list[float], delay: float) -> tuple[float, float]:
    """Overlapped F&B chunks of one delayed step against the same chunks without delay: total time over
    the total of max(comm, compute), and over comm + compute, with comm = delays posted in the chunk."""
    compute = {name: end - start for name, start, end in nodelay}
    step, best, worst = 0.0, 0.0, 0.0
    for name, start, end in delayed:
        comm = delay * sum(start <= t < end for t in starts)
        step += end - start
        best += max(comm, compute[name])
        worst += comm + compute[name]
    return step / max(best, 1e-12), step / max(worst, 1e-12)


def _bench(rank: int, world: int, ns: argparse.Namespace) -> dict | None:
    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    patched = DelayedAllToAll(dist.all_to_all_single)
    dist.all_to_all_single = patched  # the models' exchanges look it up on the module at each call
    trainers = {}
    settings = 1 + (1 if ns.delay_ms is not None else len(ns.comm_ratio))  # no delay, then each delay
    for overlap in (True, False):
        cfg = load_config(ns.config, BASE + [f"run.steps={settings * ns.steps * 2 + 8}",
                                             f"parallel.overlap={str(overlap).lower()}", *ns.overrides])
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        recorder = TraceRecorder(rank) if overlap and ns.trace else None
        trainers[overlap] = Trainer(cfg, ps, tempfile.mkdtemp(), "disabled", check_static(cfg, world), recorder)
        _timed_step(trainers[overlap])  # warm-up: allocations, first-use imports
    n0 = len(patched.starts)
    base = [_timed_step(trainers[o])[0] for o in (True, False, True, False)]
    calls_per_step = (len(patched.starts) - n0) / 4
    delays = [ns.delay_ms / 1e3] if ns.delay_ms is not None else [
        r * statistics.median(base) / max(calls_per_step, 1) for r in ns.comm_ratio]
    delays_t = torch.tensor([0.0, *delays], dtype=torch.float64)
    dist.broadcast(delays_t, 0)  # every rank sleeps the same
    delays = delays_t.tolist()
    walls: dict[tuple[bool, int], list[float]] = {(o, d): [] for o in (True, False) for d in range(len(delays))}
    chunks: dict[int, list] = {d: [] for d in range(len(delays))}  # (chunks of the step, delay starts)
    for _ in range(ns.steps):
        for (overlap, d), acc in walls.items():
            patched.delay_s, n0 = delays[d], len(patched.starts)
            wall, step_chunks = _timed_step(trainers[overlap])
            acc.append(wall)
            if overlap:
                chunks[d].append((step_chunks, patched.starts[n0:]))
    if ns.trace:
        recorder = trainers[True].recorder
        patched.delay_s = delays[-1]
        recorder.spans.clear()
        _timed_step(trainers[True])
        states = [None] * world if rank == 0 else None
        dist.gather_object(recorder.state(), states, dst=0)
        if rank == 0:
            write_chrome_trace(ns.trace, states)
    patched.delay_s = 0.0
    if rank != 0:
        return None
    compute = {o: statistics.median(walls[(o, 0)]) for o in (True, False)}
    rows = []
    for d in range(1, len(delays)):
        comm = calls_per_step * delays[d]
        per_step = [_chunk_multiples(chunks[0][i][0], chunks[d][i][0], chunks[d][i][1], delays[d])
                    for i in range(ns.steps)]
        for overlap in (True, False):
            step = statistics.median(walls[(overlap, d)])
            row = {"comm/compute": f"{comm / compute[True]:.2f}",
                   "mode": "overlapped F&B" if overlap else "F then B", "delay_ms": round(delays[d] * 1e3, 2),
                   "compute_s": round(compute[overlap], 4), "comm_s": round(comm, 4), "step_s": round(step, 4),
                   "x_max": round(step / max(comm, compute[overlap]), 3),
                   "x_sum": round(step / (comm + compute[overlap]), 3)}
            if overlap:
                row["chunks_x_max"] = round(statistics.median(m for m, _ in per_step), 3)
                row["chunks_x_sum"] = round(statistics.median(s for _, s in per_step), 3)
            rows.append(row)
    return {"rows": rows, "all_to_alls_per_step": calls_per_step}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    result = spawn_gloo(_bench, ns.nproc, ns)
    print_report("expert all-to-all hidden behind compute (fixed delay per exchange)", result["rows"],
                 json_path=ns.json,
                 notes=[f"comm = {result['all_to_alls_per_step']:.0f} all-to-alls per step on rank 0 (counts + "
                        "tokens + combine forward, two reverse exchanges backward, per MoE layer and micro-batch) "
                        "x delay", "x_max = step / max(comm, compute), x_sum = step / (comm + compute); target: "
                        "overlapped x_max <= 1.15",
                        "chunks_*: the same over the overlapped F&B chunks only (each against itself without delay)",
                        "median of the timed steps; settings interleaved step by step"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
