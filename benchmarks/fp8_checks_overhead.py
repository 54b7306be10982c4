"""What FP8 health and the BF16 shadow cost per training step, against the same FP8 step without them, in one run.

    python benchmarks/fp8_checks_overhead.py [--config recipes/configs/tiny_cpu.toml] [--steps 8] [--set k=v ...]

Three trainers of the same FP8 model in this process (one rank, no pipeline): plain; FP8 health active on every
step (``logging.fp8_health_every=1``: each step is a reporting step, the worst case); the BF16 shadow on every
step (``fault.fp8_shadow_every=1``, never judged sustained). Their steps are interleaved (A, B, C, A, B, C, ...)
so machine load falls on all three alike; after one warm-up step each, the median step time is printed (CPU time
of this one-thread process, which other jobs on a shared machine barely move, and wall time) with the overhead
of an active step and what it amortises to at the default health interval (10 steps) and a few shadow ones.
On a CPU the FP8 GEMMs are the references (quantize, then fp32 matmul), not kernels: the ratios say how the
checks compare with a cast-heavy step, not what a GPU step pays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recipes.benchutil import print_report  # noqa: E402
from training.config import load_config  # noqa: E402
from training.parallel import init_parallel  # noqa: E402
from training.trainer import Trainer  # noqa: E402

ONE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", "model.fp8=true",
       "logging.progress=false", "logging.wandb=disabled", "run.threads=1"]
VARIANTS = {"FP8 step (no checks)": ["logging.fp8_health_every=0"],
            "+ FP8 health, active": ["logging.fp8_health_every=1"],
            "+ BF16 shadow check": ["logging.fp8_health_every=0", "fault.fp8_shadow_every=1",
                                    "fault.fp8_shadow_patience=1000000"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "tiny_cpu.toml"))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (after one warm-up step)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ns = ap.parse_args(argv)
    cfgs = {name: load_config(ns.config, ONE + [f"run.steps={ns.steps + 1}"] + ns.overrides + extra)
            for name, extra in VARIANTS.items()}
    first = next(iter(cfgs.values()))
    ps = init_parallel(first.parallel, first.run.timeout_s)
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    walls: dict[str, list[float]] = {name: [] for name in cfgs}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: Trainer(cfg, ps, Path(tmp) / str(i)) for i, (name, cfg) in enumerate(cfgs.items())}
        for step in range(ns.steps + 1):
            for name, tr in trainers.items():
                t0, c0 = time.perf_counter(), time.process_time()
                tr.train_step()
                if step:
                    times[name].append(time.process_time() - c0)
                    walls[name].append(time.perf_counter() - t0)
    base = statistics.median(times["FP8 step (no checks)"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "median CPU s": med, "min CPU s": min(ts), "vs plain": med / base,
                     "median wall s": statistics.median(walls[name])})
    health = statistics.median(times["+ FP8 health, active"]) / base - 1
    shadow = statistics.median(times["+ BF16 shadow check"]) / base - 1
    cfg = first
    print_report("FP8 health and BF16 shadow: step time, interleaved in one process", rows, notes=[
        f"config {Path(ns.config).name} {' '.join(ns.overrides)}: {cfg.data.global_batch} x {cfg.data.seq_len} "
        f"tokens per step, {cfg.microbatches_at(0)} micro-batches",
        f"an active FP8-health step costs {health:+.1%}; at the default fp8_health_every=10: {health / 10:+.2%}",
        f"a shadow check costs {shadow:+.1%} of a step; every 10 / 100 steps: {shadow / 10:+.2%} / {shadow / 100:+.3%}",
        f"{ns.steps} timed steps per variant after 1 warm-up; medians"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
