"""Train DeepSeek-V3 from a TOML config: ``python -m recipes.train --config FILE [options]``.

    python -m recipes.train --config recipes/configs/tiny_cpu.toml            # the demo (4 CPU processes)
    python -m recipes.train --config recipes/configs/tiny_cpu.toml --nproc 1 --set parallel.pp=1 ...
    torchrun --nproc-per-node 8 -m recipes.train --config recipes/configs/debug_gpu.toml
    python -m recipes.train --config recipes/configs/deepseek_v3_671b.toml --dry-run --device H800

Without torchrun, ``--nproc`` (default: the config's ``run.nproc``) re-launches through
``torch.distributed.run`` on this machine. The config, the world size, the data files and the
corpus size are checked before any process starts. The run folder (``--run-dir``, default
``runs/<name>-<time>``) gets the resolved config, ``metrics.jsonl``, ``loss.png``, ``summary.json``,
wandb files and ``checkpoints/``.

Exit statuses (``accel.cli``): 0 finished; 2 bad input (one line naming the key or option); 4 the NaN /
loss-spike guard stopped the run (one line: the step, the fault, and why there was no rollback).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from accel.cli import BAD_INPUT, FAULT_STOP
from training.config import load_config
from training.fault import FaultToleranceError
from training.launch import relaunch, strip_option, under_torchrun


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m recipes.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="TOML config file (recipes/configs/*.toml)")
    ap.add_argument("--nproc", type=int, default=None, help="processes on this machine (default: run.nproc)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    ap.add_argument("--run-dir", default=None, help="run folder (default: <run.runs_root>/<run.name>-<time>)")
    ap.add_argument("--resume", default=None, help="'auto' (newest valid checkpoint of the run folder) or a path")
    ap.add_argument("--dry-run", action="store_true", help="print layout and per-rank memory; allocate nothing")
    ap.add_argument("--device", default=None, metavar="NAME",
                    help="device the dry run checks memory against, e.g. H800 (accel.specs names) or cpu")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write a Chrome/Perfetto trace (per rank: compute and communication tracks) to FILE")
    ap.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                    help="wandb mode (default: WANDB_MODE, else logging.wandb = offline)")
    return ap.parse_args(argv)


def dry_run(cfg, world: int, device: str | None = None) -> None:
    """The launch's own checks (``check_static``), then the plan: layout, micro-batches, per-rank memory on
    ``device`` (``--device``, e.g. H800) with a fits / does-not-fit verdict.
    Data files absent from this machine (a cluster path checked from a laptop) are reported, not fatal."""
    from training.memory import estimate, format_estimate
    from training.parallel import describe
    from training.trainer import check_static, missing_data

    args, corpus = check_static(cfg, world, allow_missing_data=True)
    print(describe(cfg.parallel))
    print(f"micro-batches per step: {cfg.microbatches_at(0)} at step 0, {cfg.microbatches_at(cfg.run.steps - 1)} "
          f"at the end (global batch {cfg.global_batch_at(0)} -> {cfg.global_batch_at(cfg.run.steps - 1)} sequences "
          f"of {cfg.data.seq_len} tokens)")
    if corpus is None:
        print(f"data: {', '.join(missing_data(cfg.data))} not on this machine; a launch checks them where it runs")
    else:
        print(f"data: {corpus.num_tokens} tokens, {corpus.num_train} training windows")
    print(format_estimate(cfg, args, estimate(cfg, args, device=device)))


def use_reference_kernels_on_cpu() -> None:
    """On a CPU, train with the kernels' PyTorch references unless ``DSV3_KERNEL_IMPL`` says otherwise:
    Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``make``) is for kernel tests and far
    too slow to train with. Inherited by the torchrun workers."""
    import accel

    if accel.backend() == "cpu" and not os.environ.get("DSV3_KERNEL_IMPL"):
        os.environ["DSV3_KERNEL_IMPL"] = "reference"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    use_reference_kernels_on_cpu()
    try:
        cfg = load_config(ns.config, ns.overrides)
        nproc = ns.nproc if ns.nproc is not None else cfg.run.nproc
        if ns.dry_run:
            dry_run(cfg, nproc, ns.device)
            return 0
        if under_torchrun():
            from training.run import RunOptions, run_training

            run_training(cfg, RunOptions(ns.run_dir, ns.resume, ns.wandb, trace=ns.trace))
            return 0
        from training.run import RunOptions, default_run_dir, run_training
        from training.trainer import check_static

        if nproc == 1:
            run_training(cfg, RunOptions(ns.run_dir, ns.resume, ns.wandb, trace=ns.trace))
            return 0
        check_static(cfg, nproc)  # the dry run's checks: bad input fails here, before any process starts
        run_dir = ns.run_dir or str(default_run_dir(cfg))
        child = strip_option(strip_option(argv, "--nproc"), "--run-dir") + ["--run-dir", run_dir]
        return relaunch("recipes.train", nproc, child)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except FaultToleranceError as exc:  # every rank agreed on the fault; rank 0 says what happened, once
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank exits (and makes torchrun stop the others) before the line is out
        return FAULT_STOP


if __name__ == "__main__":
    sys.exit(main())
