"""Measured peak memory per rank next to the memory model's prediction (``planner.memory.estimate``).

    python -m recipes.memory_report --config recipes/configs/tiny_cpu.toml --nproc 1 --set parallel.pp=1 ...
    torchrun --nproc-per-node 8 -m recipes.memory_report --config recipes/configs/debug_gpu.toml

Runs ``--steps`` real training steps of the config (the trainer, its schedule, optimizer and
expert parallelism as ``recipes.train`` builds them; no checkpoints, no logging) and takes each
rank's peak of live tensor bytes from building the model to the last step: on a GPU the caching
allocator's ``max_memory_allocated``; on a CPU the c10 CPU allocator's process-wide count of live
bytes (every tensor it hands out or frees, in any thread), read from the profiler's allocation events
(``CpuPeak``). The prediction is the model's total without the allocator margin (which neither
measurement sees). Rank 0 prints one line per rank and, with ``--json``, writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_file, positive_int
from models.deepseek_v3.expert_parallel import _CommThread
from recipes.train import use_reference_kernels_on_cpu
from training.config import check_world_size, load_config
from training.launch import relaunch, strip_option, under_torchrun

MiB = 1024**2


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.memory_report", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="TOML config file (recipes/configs/*.toml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable)")
    ap.add_argument("--nproc", type=positive_int, default=None, help="processes on this machine (default: run.nproc)")
    ap.add_argument("--steps", type=positive_int, default=3,
                    help="training steps to run (the peak is steady from step 2)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON (rank 0)")
    return ap.parse_args(argv)


class CpuPeak:
    """Peak of live CPU tensor bytes over the block, counted in every thread (``.peak`` after the block).

    torch's profiler records allocation events on the profiled thread only, and a tensor freed on
    another thread (gloo's workers drop the last reference to the buffers a collective sent or
    received; the comm thread) gives no event, so summing events counts such tensors as live forever.
    The c10 CPU allocator's reporter keeps a process-wide count of live bytes whenever its
    ``caffe2_report_cpu_memory_usage`` flag is set (no Python binding; set through libc10's exported
    symbol), and every profiler event carries that count: the peak is its maximum over the events.
    Allocations on other threads are in the count from the next event on; the expert all-to-alls run
    inline meanwhile (``measure_rank``) so that none is transient between two events.
    """

    def __init__(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[CpuPeak]:
        from torch.profiler import ProfilerActivity, profile

        flag = _report_cpu_memory_flag()
        before, flag.value = flag.value, True
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                yield self
        finally:
            flag.value = before
        events = [e for _, e in sorted(_allocation_events(prof), key=lambda te: te[0]) if e.device.type == "cpu"]
        if events:  # the count may include tensors allocated (while the flag was set) before the block
            base = events[0].total_allocated - events[0].alloc_size
            self.peak = max(e.total_allocated for e in events) - base


def _report_cpu_memory_flag() -> ctypes.c_bool:
    """libc10's ``FLAGS_caffe2_report_cpu_memory_usage`` (``c10/core/CPUAllocator.cpp``), writable."""
    import torch

    libs = sorted((Path(torch.__file__).parent / "lib").glob("*c10.*"))  # libc10.so / libc10.dylib / c10.dll
    for lib in libs:
        with contextlib.suppress(OSError, ValueError):
            return ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    raise RuntimeError(f"recipes.memory_report: no c10 library exporting FLAGS_caffe2_report_cpu_memory_usage "
                       f"among {[str(p) for p in libs]}: a CPU peak cannot count frees made on other threads")


def _allocation_events(prof) -> list:
    """(time, record) of every allocation and free of a finished profile; a record has ``alloc_size`` (negative
    for a free), ``total_allocated`` (the reporter's count after it) and ``device``."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            out.append((node.start_time_ns, node.extra_fields))
        stack.extend(node.children)
    return out


class DevicePeak:
    """``max_memory_allocated`` over the block, less what was allocated before it."""

    def __init__(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[DevicePeak]:
        import accel

        accel.synchronize()
        base = accel.device_module().memory_allocated()
        accel.reset_peak_memory_stats()
        yield self
        accel.synchronize()
        self.peak = accel.max_memory_allocated() - base


def measure_rank(cfg, steps: int) -> dict:
    """Build this rank's trainer and run ``steps`` steps; its coordinates and measured peak bytes."""
    import accel
    from training.parallel import init_parallel
    from training.trainer import Trainer, check_static

    checked = check_static(cfg)
    ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
    cpu = accel.backend() == "cpu"
    meter = CpuPeak() if cpu else DevicePeak()
    # on a CPU the expert all-to-alls run on the calling thread: the profiler sees no other thread's tensors
    inline = _CommThread.inline() if cpu else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as run_dir, inline, meter.measure():
        trainer = Trainer(cfg, ps, run_dir, "disabled", checked)
        for _ in range(steps):
            trainer.train_step()
        if trainer.optimizer is not None:
            for opt in trainer.optimizer.optimizers:
                local = getattr(opt, "optim", opt)
                if hasattr(local, "wait_ema"):
                    local.wait_ema()
    c = ps.coords
    row = {"rank": ps.rank, "pp_rank": c.pp_rank, "dp_rank": c.dp_rank, "measured": meter.peak}
    rows = [row]
    if ps.world_size > 1:
        import torch.distributed as dist

        rows = [None] * ps.world_size
        dist.all_gather_object(rows, row)
        dist.barrier()
        dist.destroy_process_group()
    return {"rows": rows, "rank": ps.rank}


def report(cfg, rows: list[dict]) -> list[dict]:
    """``rows`` with the prediction for each rank's pipeline rank (bytes, margin excluded) and their ratio."""
    import accel
    from planner.memory import estimate

    device = None if accel.backend() == "cpu" else accel.device_name()
    est = estimate(cfg, device=device)
    out = []
    for r in rows:
        pred = est.ranks[r["pp_rank"]]
        predicted = pred.total_bytes - pred.items.get("margin", 0)
        if device is None:  # on a CPU the host is the device: the EMA is measured too
            predicted += sum(pred.host.values())
        out.append({**r, "predicted": predicted, "ratio": predicted / r["measured"] if r["measured"] else float("nan"),
                    "items": pred.items})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'rank':>4} {'pp':>3} {'dp':>3} {'measured MiB':>13} {'predicted MiB':>14} {'pred/meas':>9}"]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['pp_rank']:>3} {r['dp_rank']:>3} {r['measured'] / MiB:>13.2f} "
                     f"{r['predicted'] / MiB:>14.2f} {r['ratio']:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    use_reference_kernels_on_cpu()
    try:
        if ns.json:
            check_output_file(ns.json, "--json")
        cfg = load_config(ns.config, ns.overrides)
        if ns.steps < 2:
            raise ValueError(f"--steps must be >= 2 (the optimizer states appear at the first step), got {ns.steps}")
        nproc = ns.nproc if ns.nproc is not None else cfg.run.nproc
        if not under_torchrun():
            check_world_size(cfg.parallel, nproc)
            if nproc > 1:
                from training.trainer import check_static

                check_static(cfg)
                return relaunch("recipes.memory_report", nproc, strip_option(argv, "--nproc"))
        result = measure_rank(cfg, ns.steps)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    if result["rank"] == 0:
        rows = report(cfg, result["rows"])
        print(format_rows(rows), flush=True)
        if ns.json:
            Path(ns.json).write_text(json.dumps(rows, indent=1))
    return OK


if __name__ == "__main__":
    sys.exit(main())
