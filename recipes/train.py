"""Train DeepSeek-V3 from a TOML config: ``python -m recipes.train --config FILE [options]``.

    python -m recipes.train --config recipes/configs/tiny_cpu.toml            # the demo (4 CPU processes)
    python -m recipes.train --config recipes/configs/tiny_cpu.toml --nproc 1 --set parallel.pp=1 ...
    torchrun --nproc-per-node 8 -m recipes.train --config recipes/configs/debug_gpu.toml
    python -m recipes.train --config recipes/configs/deepseek_v3_671b.toml --dry-run --device H800

Without torchrun, ``--nproc`` (default: the config's ``run.nproc``) re-launches through
``torch.distributed.run`` on this machine. The config, the world size, the data files and the
corpus size are checked before any process starts. The run folder (``--run-dir``, default
``runs/<name>-<time>``) gets the resolved config, ``metrics.jsonl``, ``loss.png``, ``summary.json``,
wandb files and ``checkpoints/``. One job per run folder: a launch on a folder another job holds exits
at once with status 5 naming the holder (``training.runlock``). ``--resume auto`` without ``--run-dir``
continues the newest run of the same config under ``run.runs_root`` (or says it starts a new one).

SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) stops every rank after the step in progress: a
checkpoint of that step is committed, one line says where, and the exit status is 0 (3 if that save
failed); ``run.max_minutes`` does the same before a wall-clock limit. ``--resume auto`` then continues
bit-exactly. Under ``--nproc`` the launcher forwards the signal to its workers and waits for their save.

Exit statuses (``accel.cli``): 0 done (or stopped early with a committed checkpoint), 1 failed, 2 bad input
(one line; nothing started or written), 3 a checkpoint could not be written (a full disk, a read-only folder;
one line naming the committed checkpoint left intact), 4 stopped by the NaN guard, 5 run folder locked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from accel import cli, specs
from accel.cli import (
    BAD_INPUT,
    FAULT_STOP,
    LOCKED,
    SAVE_FAILED,
    ArgumentParser,
    check_output_dir,
    check_output_file,
    positive_int,
)
from training.checkpoint import format as fmt
from training.checkpoint.writer import CheckpointWriteError
from training.config import TrainConfig, load_config, schedule_of
from training.fault import FaultToleranceError
from training.launch import relaunch, strip_option, under_torchrun
from training.rundir import check_fresh, check_resume, choose_run_dir
from training.runlock import RunFolderLocked, RunLock, launcher_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="TOML config file (recipes/configs/*.toml)")
    ap.add_argument("--nproc", type=positive_int, default=None, help="processes on this machine (default: run.nproc)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    ap.add_argument("--run-dir", default=None, help="run folder (default: <run.runs_root>/<run.name>-<time>); "
                    "one job at a time: it is locked while a job runs in it")
    ap.add_argument("--resume", default=None,
                    help="'auto' (newest valid checkpoint of the run folder; without --run-dir: of the newest run "
                         "of this config under run.runs_root) or a checkpoint folder RUN/checkpoints/step_N "
                         "(default: start from scratch)")
    ap.add_argument("--break-lock", action="store_true",
                    help="take over a run folder whose lock another host left with a stale heartbeat (the error "
                         "of a refused launch says when); a live job on this host is never taken over")
    ap.add_argument("--dry-run", action="store_true", help="print layout and per-rank memory; allocate nothing")
    ap.add_argument("--schedule-json", default=None, metavar="FILE",
                    help="with --dry-run: write the run's schedule to FILE, a JSON list of rows {step, tokens, lr, "
                         "global_batch, mtp_lambda, bias_update_speed} at every step where one changes and at least "
                         "every 1000 steps")
    ap.add_argument("--device", default=None, metavar="NAME",
                    help="device the dry run checks memory against, e.g. H800 (accel.specs names) or cpu")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write a Chrome/Perfetto trace (per rank: compute and communication tracks) to FILE")
    ap.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                    help="wandb mode (default: WANDB_MODE, else logging.wandb = offline)")
    ns = ap.parse_args(argv)
    if ns.schedule_json is not None and not ns.dry_run:
        ap.error("--schedule-json writes the schedule a --dry-run plans; add --dry-run")
    if ns.device is not None and not ns.dry_run:
        ap.error("--device is the device --dry-run checks memory against; a run uses the device it runs on")
    if ns.device is not None and ns.device.lower() != "cpu" and specs.lookup(ns.device) is None:
        ap.error(f"--device {ns.device!r}: unknown device; expected cpu or one of {', '.join(specs.known_devices())}")
    return ns


def dry_run(cfg, world: int, device: str | None = None, schedule_json: str | None = None) -> None:
    """The launch's own checks (``check_static``), then the plan: layout, micro-batches, per-rank memory on
    ``device`` (``--device``, e.g. H800) with a fits / does-not-fit verdict; ``schedule_json``: a file the
    schedule's rows (``training.schedule.Schedule.rows``) are written to.
    Data files absent from this machine (a cluster path checked from a laptop) are reported, not fatal."""
    from planner.memory import estimate, format_estimate
    from training.parallel import describe
    from training.trainer import check_static, missing_data

    if schedule_json is not None:
        check_output_file(schedule_json, "--schedule-json")
    args, corpus = check_static(cfg, world, allow_missing_data=True)
    schedule = schedule_of(cfg)
    par = cfg.parallel
    print(describe(par))
    if par.cp > 1:
        print(f"each sequence of {cfg.data.seq_len} tokens split over {par.cp} context-parallel ranks "
              f"({cfg.data.seq_len // par.cp} each, as chunks r and {2 * par.cp - 1}-r of {2 * par.cp})")
    unit = cfg.parallel.dp * cfg.data.micro_batch
    first, *rest = schedule.batch_sizes()
    last = rest[-1] if rest else first
    print(f"micro-batches per step: {first // unit} to {last // unit} (global batch {first} -> {last} sequences of "
          f"{cfg.data.seq_len} tokens)")
    if schedule_json is not None:
        rows = schedule.rows(cfg.run.steps)
        Path(schedule_json).write_text(json.dumps(rows) + "\n", encoding="utf-8")
        end = rows[-1]
        print(f"schedule: {len(rows)} rows to {schedule_json}; step {end['step']} starts after {end['tokens']:.4g} "
              f"tokens (the run ends at {end['tokens'] + end['global_batch'] * cfg.data.seq_len:.4g})")
    if cfg.model.init_from and not Path(cfg.model.init_from).exists():
        print(f"model.init_from={cfg.model.init_from!r} not on this machine; a launch checks it where it runs")
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
            dry_run(cfg, nproc, ns.device, ns.schedule_json)
            return 0
        check_paths(ns, cfg)
        from training.run import RunOptions, run_training

        opts = RunOptions(ns.run_dir, ns.resume, ns.wandb, trace=ns.trace, break_lock=ns.break_lock)
        if under_torchrun() or nproc == 1:
            return exit_status(run_training(cfg, opts))
        from training.trainer import check_static

        check_static(cfg, nproc)  # the dry run's checks: bad input fails here, before any process starts
        return launch_locked(cfg, nproc, argv, ns)
    except CheckpointWriteError as exc:  # a full disk, a read-only folder: the last committed checkpoint is intact
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return SAVE_FAILED
    except RunFolderLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return LOCKED
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except FaultToleranceError as exc:  # every rank agreed on the fault; rank 0 says what happened, once
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank exits (and makes torchrun stop the others) before the line is out
        return FAULT_STOP
    except KeyboardInterrupt:  # SIGINT before training installed its handlers (training.preempt)
        print("interrupted (SIGINT) before training started: nothing to save", file=sys.stderr)
        return 128 + signal.SIGINT


def check_paths(ns: argparse.Namespace, cfg: TrainConfig) -> None:
    """The run's output paths and ``--resume`` (a checkpoint of ``cfg``), before any work: ValueError naming the
    option."""
    if ns.trace:
        check_output_file(ns.trace, "--trace")
    if ns.run_dir:
        check_output_dir(ns.run_dir, "--run-dir")
    check_resume(ns.resume, cfg)


def launch_locked(cfg, nproc: int, argv: list[str], ns: argparse.Namespace) -> int:
    """``--nproc N``: take the run folder's lock here, before torchrun starts a worker, hold it until they are
    done, and tell the workers (``DSV3_RUN_LOCK``) that their job holds it."""
    run_dir = str(choose_run_dir(cfg, ns.run_dir, ns.resume))
    child = strip_option(strip_option(argv, "--nproc"), "--run-dir") + ["--run-dir", run_dir]
    with RunLock(run_dir).acquire(break_lock=ns.break_lock) as lock:
        check_fresh(run_dir, ns.resume)
        env = launcher_env(lock)
        os.environ.update(env)  # inherited by the torchrun workers
        try:
            return relaunch("recipes.train", nproc, child, latest_step=lambda: latest_step(run_dir))
        finally:
            for key in env:
                os.environ.pop(key, None)


def exit_status(summary: dict) -> int:
    """The CLI's status for a finished run: OK, or the status of an early stop (``training.preempt``)."""
    return summary.get("stopped", {}).get("exit_status", cli.OK)


def latest_step(run_dir: str) -> int | None:
    """The step the run's ``latest`` checkpoint pointer names (the launcher's line after a forwarded signal)."""
    return fmt.read_pointer(Path(run_dir) / "checkpoints", fmt.LATEST_FILE)


if __name__ == "__main__":
    sys.exit(main())
