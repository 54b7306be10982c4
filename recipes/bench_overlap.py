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
import sys
import tempfile
from pathlib import Path

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_file, positive_int
from recipes.benchutil import print_report, run_training
from training.config import load_config
from training.trainer import check_static

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.fp8=false", "logging.progress=false", "logging.wandb=disabled", "checkpoint.final=false",
        "checkpoint.interval=0", "run.sample_tokens=0", "logging.eval_batches=1", "data.global_batch=16",
        "data.micro_batch=2"]


def run(config: str, nproc: int, steps: int, overrides: list[str], out: Path) -> list[dict]:
    return run_training(config, nproc, BASE + [f"run.steps={steps}"] + overrides, out)


def check_inputs(ns: argparse.Namespace) -> None:
    """Both runs' configs, world size and data, and the --json path, before either run starts (ValueError)."""
    if ns.json:
        check_output_file(ns.json, "--json")
    for overlap in (True, False):
        overrides = BASE + [f"run.steps={ns.steps}"] + ns.overrides + [f"parallel.overlap={str(overlap).lower()}"]
        check_static(load_config(ns.config, overrides), ns.nproc)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.bench_overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "tiny_cpu.toml"),
                    help="TOML training config of both runs")
    ap.add_argument("--nproc", type=positive_int, default=4, help="processes per run")
    ap.add_argument("--steps", type=positive_int, default=6, help="training steps per run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key of both runs (repeatable)")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    ns = ap.parse_args(argv)
    ns.config = str(Path(ns.config).absolute())  # the runs start in the checkout's root (benchutil.run_training)
    try:
        check_inputs(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
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
    return OK


if __name__ == "__main__":
    sys.exit(main())
