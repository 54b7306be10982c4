"""Benchmark: the real runtime over gloo against the simulator, and bubbles side by side.

    python -m dualpipe.bench [--ranks 8] [--microbatches 24] [--F 0.05 --B 0.1 --W 0.05] [--FB 0.12]
                             [--schedules dualpipe,1f1b,zb1p] [--json out.json]

Each rank's stages compute nothing: a forward sleeps F seconds, a backward sleeps I = B - W and
defers a W-second sleep through ``accel.wgrad.defer`` (so zero-bubble I/W splitting is real, and
a full B sleeps I + W). With ``--FB`` the stages define ``overlapped_forward_backward`` and an
overlapped F&B sleeps FB (< F + B models DualPipe's compute/communication overlap). Sleeping ranks
need no CPU, so 8 ranks fit on 2 cores. The simulator is
fed the measured duration of each action kind (sleep plus the runtime's own overhead, without time
blocked on neighbours; median over ranks) and the P2P latency of a ping-pong, and its makespan is
compared with the measured step time.
The bubble is the step time minus the busiest rank's compute time.
Processes are launched with torch's elastic launcher (torchrun's engine).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import accel.wgrad
from dualpipe.calculator import closed_form
from dualpipe.dualpipe import DualPipe
from dualpipe.dualpipev import DualPipeV
from dualpipe.ir import Overlap
from dualpipe.runtime import Pipeline
from dualpipe.schedules import build
from dualpipe.simulator import Costs, simulate


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
        time.sleep(backward_s - weight_s)

        def weight_grad() -> None:
            time.sleep(weight_s)
            scale.grad = torch.ones_like(scale) if scale.grad is None else scale.grad + 1

        if not accel.wgrad.defer(weight_grad):
            weight_grad()
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


def _worker(args: argparse.Namespace) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        latency = torch.tensor(_ping(rank) if world > 1 else 0.0)
        dist.broadcast(latency, 0)
        measured = {k: _measured_sleep(v) for k, v in (("F", args.F), ("I", args.B - args.W), ("W", args.W))}
        out: dict = {"latency": latency.item(), "sleep": measured, "runs": {}}
        for name in args.schedules:
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
            x = x if feeds else None
            labels = (y,) if takes_loss else (None,)
            times = []
            for _ in range(args.repeats + 1):  # the first step warms up (and builds the schedule)
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, num_chunks=args.microbatches, criterion=_mse, labels=labels)
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the last rank ends
                times.append(elapsed.item())
            durations: dict[str, list[float]] = {}
            for item, start, end, overhead in pipe.last_step_timeline:
                kind = "FB" if isinstance(item, Overlap) else item.kind
                durations.setdefault(kind, []).append(end - start + overhead)
            out["runs"][name] = {"step": statistics.median(times[1:]), "steps": times[1:], "durations": durations}
        return out
    finally:
        dist.destroy_process_group()


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dualpipe.bench", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=24)
    p.add_argument("--F", type=float, default=0.05, help="forward seconds per stage and micro-batch")
    p.add_argument("--B", type=float, default=0.1, help="full backward seconds")
    p.add_argument("--W", type=float, default=0.05, help="weight-gradient part of B, seconds")
    p.add_argument("--FB", type=float, default=None,
                   help="seconds of an overlapped F&B (stages get overlapped_forward_backward); default: F then B")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--schedules", default="dualpipe,1f1b,zb1p")
    p.add_argument("--json", help="write the rows as JSON")
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
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
                      p2p=res["latency"])
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
    main()
