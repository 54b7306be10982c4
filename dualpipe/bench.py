"""Benchmark: the real runtime over gloo against the simulator, and bubbles side by side.

    python -m dualpipe.bench [--ranks 8] [--microbatches 24] [--F 0.05 --B 0.1 --W 0.05] [--FB 0.12]
                             [--schedules dualpipe,1f1b,zb1p] [--json out.json]

Each rank's stages compute nothing: a forward sleeps F seconds, an I sleeps I = B - W and
defers a W-second sleep through ``accel.wgrad.defer`` (so zero-bubble I/W splitting is real), and
a full B sleeps B. With ``--FB`` the stages define ``overlapped_forward_backward`` and an
overlapped F&B sleeps FB (< F + B models DualPipe's compute/communication overlap). Sleeping ranks
need no CPU, so 8 ranks fit on 2 cores. The simulator is
fed the measured duration of each action kind (sleep plus the runtime's own overhead and sends;
median over ranks), the P2P latency of a ping-pong and the measured host time to take one message
(``host_costs``), and its makespan is compared with the measured step time.
The bubble is the step time minus the busiest rank's compute time.
Processes are launched with torch's elastic launcher (torchrun's engine).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import accel.wgrad
from accel.cli import OK, ArgumentParser, check_output_file, nonnegative_float, positive_int
from dualpipe.calculator import closed_form
from dualpipe.dualpipe import DualPipe
from dualpipe.dualpipev import DualPipeV
from dualpipe.ir import Action, Overlap
from dualpipe.runtime import Pipeline
from dualpipe.schedules import SCHEDULES, build
from dualpipe.simulator import Costs, compile_schedule, simulate


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, costs):  # noqa: ANN205
        ctx.costs = costs
        ctx.scale = scale
        time.sleep(costs[0])
        return x * scale.detach()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN205
        _, backward_s, weight_s = ctx.costs
        scale = ctx.scale

        def accumulate() -> None:
            scale.grad = torch.ones_like(scale) if scale.grad is None else scale.grad + 1

        def weight_grad() -> None:
            time.sleep(weight_s)
            accumulate()

        if accel.wgrad.active():  # an I action: the W sleep waits for its W action
            time.sleep(backward_s - weight_s)
            accel.wgrad.defer(weight_grad)
        else:  # a full B is one backward pass: one sleep, like every other pass
            time.sleep(backward_s)
            accumulate()
        return grad * scale.detach(), None, None


class SleepStage(nn.Module):
    """A stage that costs (F, B, W) seconds of sleep and passes its input through."""

    def __init__(self, f: float, b: float, w: float):
        super().__init__()
        self.costs = (f, b, w)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.scale, self.costs)


class OverlappedSleepStage(SleepStage):
    """SleepStage whose overlapped F&B (DualPipe's main loop) costs ``fb`` seconds instead of F + B,
    standing in for stages that hide one micro-batch's communication behind another's compute."""

    def __init__(self, f: float, b: float, w: float, fb: float):
        super().__init__(f, b, w)
        self.fb = fb

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        _, b, w = module1.costs
        outputs0 = _Sleep.apply(inputs0[0], module0.scale, (max(module0.fb - b, 0.0), b, w))
        loss0 = criterion0(outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _measured_sleep(seconds: float, reps: int = 5) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        time.sleep(seconds)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _ping(rank: int, reps: int = 20) -> float:
    """One-way latency of a small tensor message between ranks 0 and 1 (seconds)."""
    t = torch.zeros(8)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
    return (time.perf_counter() - t0) / (2 * reps)


def _build_run(name: str, args: argparse.Namespace, rank: int, world: int) -> tuple:
    """(pipeline, inputs, labels) of this rank for schedule ``name`` over sleep stages."""
    n_stages = 2 if name in ("zbv", "dualpipe", "dualpipev") else 1
    mods = [SleepStage(args.F, args.B, args.W) if args.FB is None else
            OverlappedSleepStage(args.F, args.B, args.W, args.FB) for _ in range(n_stages)]
    cls = {"dualpipe": DualPipe, "dualpipev": DualPipeV}.get(name)
    pipe = cls(tuple(mods)) if cls else Pipeline(mods, name)
    lay = pipe.schedule(args.microbatches).layout
    rows = 2 * args.microbatches // (2 if name == "dualpipe" else 1)
    x, y = torch.randn(rows, 8), torch.randn(rows, 8)
    if name == "dualpipe":
        feeds = takes_loss = rank in (0, world - 1)
    else:
        feeds = rank == lay.stage_rank[0]
        takes_loss = rank == lay.stage_rank[lay.num_stages - 1]
    return pipe, x if feeds else None, (y,) if takes_loss else (None,)


def _worker(args: argparse.Namespace) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        latency = torch.tensor(_ping(rank) if world > 1 else 0.0)
        dist.broadcast(latency, 0)
        measured = {k: _measured_sleep(v) for k, v in (("F", args.F), ("I", args.B - args.W), ("W", args.W))}
        out: dict = {"latency": latency.item(), "sleep": measured, "runs": {}}
        runs = {name: _build_run(name, args, rank, world) for name in args.schedules}
        for rep in range(args.repeats + 1):  # round-robin, so a change of machine load hits every schedule alike
            for name, (pipe, x, labels) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, num_chunks=args.microbatches, criterion=_mse, labels=labels)
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the last rank ends
                if rep == 0:  # the first step warms up (and builds the schedule)
                    continue
                run = out["runs"].setdefault(name, {"steps": [], "durations": {}, "timelines": []})
                run["steps"].append(elapsed.item())
                run["timelines"].append([(start, end) for _, start, end, _ in pipe.last_step_timeline])
                for item, start, end, _ in pipe.last_step_timeline:
                    kind = "FB" if isinstance(item, Overlap) else item.kind
                    run["durations"].setdefault(kind, []).append(end - start)
        for run in out["runs"].values():
            run["step"] = statistics.median(run["steps"])
        return out
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class HostCosts:
    """The runtime's host time around the stages' own (slept) time, in seconds: ``overhead`` per computation
    pass (an overlapped F&B is two), ``send`` per message an action posts, ``recv`` per message a rank takes
    once it has arrived (the header and payload hand-shakes of ``dualpipe.comm``; ``dualpipe.simulator``'s
    ``Costs.send`` / ``Costs.recv``)."""

    overhead: float
    send: float
    recv: float


def host_costs(per_rank: dict, name: str, args: argparse.Namespace, repeat: int | None = None) -> HostCosts:
    """Measure ``HostCosts`` on the ``name`` run of ``launch(args)``, from every rank's timeline of every repeat
    (or of the one numbered ``repeat``):
    ``overhead`` is the median of (duration - slept) over actions that post no message, ``send`` that over
    actions posting one, minus ``overhead``; ``recv`` the median over items taking one message of the gap between
    the later of (the rank's previous item ending, the message's arrival = its producer's end + the ping
    latency) and the item's start. Timelines are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for
    all processes of the machine), so a producer's end on one rank compares with a start on another."""
    schedule = build(name, args.ranks, args.microbatches)
    prog = compile_schedule(schedule)
    slept = {"F": args.F, "B": args.B, "I": args.B - args.W, "W": args.W}
    latency = per_rank[0]["latency"]
    alone: list[float] = []
    sending: list[float] = []
    taking: list[float] = []
    reps = range(len(per_rank[0]["runs"][name]["timelines"])) if repeat is None else (repeat,)
    for rep in reps:
        rows = [per_rank[r]["runs"][name]["timelines"][rep] for r in range(args.ranks)]
        ends = [rows[r][i][1] for r, i in prog.order]
        for pos, (r, i) in enumerate(prog.order):
            item, (start, end) = schedule.actions[r][i], rows[r][i]
            if isinstance(item, Action) and prog.sends[pos] <= 1:
                (sending if prog.sends[pos] else alone).append(end - start - slept[item.kind])
            if i and len(prog.waits[pos]) == 1:
                taking.append(start - max(rows[r][i - 1][1], ends[prog.waits[pos][0]] + latency))
    overhead = max(statistics.median(alone), 0.0)
    return HostCosts(overhead, max(statistics.median(sending) - overhead, 0.0), max(statistics.median(taking), 0.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          start_method="spawn", monitor_interval=0.5)
    return elastic_launch(config, _worker)(args)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dualpipe.bench", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=positive_int, default=8, help="pipeline ranks (gloo processes)")
    p.add_argument("--microbatches", type=positive_int, default=24, help="micro-batches per step")
    p.add_argument("--F", type=nonnegative_float, default=0.05, help="forward seconds per stage and micro-batch")
    p.add_argument("--B", type=nonnegative_float, default=0.1, help="full backward seconds")
    p.add_argument("--W", type=nonnegative_float, default=0.05, help="weight-gradient part of B, seconds")
    p.add_argument("--FB", type=nonnegative_float, default=None,
                   help="seconds of an overlapped F&B (stages get overlapped_forward_backward); default: F then B")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed steps per schedule")
    p.add_argument("--schedules", default="dualpipe,1f1b,zb1p", help=f"comma-separated, from {', '.join(SCHEDULES)}")
    p.add_argument("--json", help="write the rows as JSON")
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
    try:  # everything the ranks would trip over, before any process starts
        if not args.schedules or set(args.schedules) - set(SCHEDULES):
            raise ValueError(f"--schedules {','.join(args.schedules)!r}: expected some of {', '.join(SCHEDULES)}")
        Costs(F=args.F, B=args.B, W=args.W, FB=args.FB)
        for name in args.schedules:
            build(name, args.ranks, args.microbatches)
        if args.json:
            check_output_file(args.json, "--json")
    except ValueError as exc:
        p.error(str(exc))
    per_rank = launch(args)
    res = per_rank[0]
    sleep = res["sleep"]
    rows = []
    for name in args.schedules:
        merged: dict[str, list[float]] = {}
        for r in per_rank.values():
            for kind, ds in r["runs"][name]["durations"].items():
                merged.setdefault(kind, []).extend(ds)
        med = {k: statistics.median(v) for k, v in merged.items()}
        i_cost = med.get("I", sleep["I"])
        w_cost = med.get("W", sleep["W"])
        costs = Costs(F=med["F"], B=med.get("B", i_cost + w_cost), W=w_cost, I=i_cost, FB=med.get("FB"),
                      p2p=res["latency"], recv=host_costs(per_rank, name, args).recv)
        sim = simulate(build(name, args.ranks, args.microbatches), costs)
        measured = res["runs"][name]["step"]
        busy = max(sim.busy(r) for r in range(args.ranks))
        cf = closed_form(name, args.ranks, costs)
        rows.append({
            "schedule": name, "ranks": args.ranks, "microbatches": args.microbatches,
            "measured_step_s": measured, "simulated_step_s": sim.makespan,
            "error_%": 100.0 * (measured - sim.makespan) / sim.makespan,
            "measured_bubble_s": measured - busy, "simulated_bubble_s": sim.makespan - busy,
            "closed_form_bubble_s": None if cf is None else cf.bubble,
        })
    notes = [f"measured sleeps F={sleep['F'] * 1e3:.2f} ms, I={sleep['I'] * 1e3:.2f} ms, W={sleep['W'] * 1e3:.2f} ms; "
             f"gloo one-way P2P latency {res['latency'] * 1e3:.3f} ms",
             "stage compute is sleep, so the figures measure scheduling and communication, not kernels"]
    _print_table("dualpipe runtime vs simulator (sleep stages over gloo)", rows, notes)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=2))
    return OK


def _print_table(title: str, rows: list[dict], notes: list[str]) -> None:
    """Same layout as recipes/benchutil (dualpipe may not import recipes: layering)."""
    cols = list(rows[0])
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    print(f"== {title} ==")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for line in cells:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))
    for n in notes:
        print(f"note: {n}")

if __name__ == "__main__":
    sys.exit(main())
