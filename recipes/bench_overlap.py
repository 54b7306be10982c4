"""Step time of DeepSeek-V3 pipeline training with and without computation-communication overlap.

    python -m recipes.bench_overlap [--steps 6] [--nproc 4] [--json out.json] [--set key=value ...]

Trains the same config twice in one invocation (PP=2 DualPipeV, EP=2 over DP=2 by default, gloo
on CPU or NCCL/MCCL on GPUs): once with ``parallel.overlap=true`` (the stages'
``overlapped_forward_backward``: one micro-batch's expert all-to-alls in flight while the other's
backward computes) and once with ``parallel.overlap=false`` (every paired F&B run as F then B).
Reports the median step time after the first two steps, and checks both runs' losses agree.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recipes.benchutil import print_report, run_training

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.fp8=false", "logging.progress=false", "logging.wandb=disabled", "checkpoint.final=false",
        "checkpoint.interval=0", "run.sample_tokens=0", "logging.eval_batches=1", "data.global_batch=16",
        "data.micro_batch=2"]


def run(config: str, nproc: int, steps: int, overrides: list[str], out: Path) -> list[dict]:
    return run_training(config, nproc, BASE + [f"run.steps={steps}"] + overrides, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="recipes/configs/tiny_cpu.toml")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    rows, losses = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for overlap in (True, False):
            metrics = run(ns.config, ns.nproc, ns.steps, ns.overrides + [f"parallel.overlap={str(overlap).lower()}"],
                          Path(tmp) / f"overlap_{overlap}")
            times = [m["step_time_s"] for m in metrics[2:]] or [m["step_time_s"] for m in metrics]
            losses[overlap] = [m["loss"] for m in metrics]
            rows.append({"variant": "overlapped F&B (ours)" if overlap else "F then B (baseline)",
                         "median step s": statistics.median(times), "min step s": min(times),
                         "tokens/s": statistics.median(m["tokens_per_s"] for m in metrics[2:] or metrics)})
    rows[0]["speedup"] = rows[1]["median step s"] / rows[0]["median step s"]
    rows[1]["speedup"] = 1.0
    gap = max(abs(a - b) for a, b in zip(losses[True], losses[False]))
    print_report("DeepSeek-V3 pipeline step: overlapped forward/backward vs F then B", rows,
                 json_path=ns.json, notes=[f"max loss difference between the two runs: {gap:.2e} (same math)",
                                           f"{ns.nproc} processes, {ns.steps} steps, median after step 2"])


if __name__ == "__main__":
    main()
