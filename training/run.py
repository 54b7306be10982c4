"""One training run on this rank, as ``recipes.train`` starts it: groups, trainer, checkpoints, logging, sample.

Split from the CLI so tests can run it inside their own process groups.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from accel import cli
from accel.flight import FlightWatchdog
from accel.trace import TraceRecorder, write_chrome_trace
from training.checkpoint.trainer_hooks import CheckpointHooks, attach
from training.config import TrainConfig
from training.metrics import format_summary, resolve_wandb_mode
from training.parallel import ParallelState, init_parallel, shutdown, world_from_env
from training.preempt import Preemption, save_on_stop
from training.rundir import check_fresh, check_resume, choose_run_dir, default_run_dir, write_config
from training.runlock import follow_launcher
from training.runlock import take as take_run_lock
from training.trainer import Trainer, check_static


@dataclass
class RunOptions:
    run_dir: str | None = None
    resume: str | None = None  # None | "auto" | a checkpoint folder
    wandb: str | None = None  # None: WANDB_MODE, else the config
    sample: bool = True
    trace: str | None = None  # write a Chrome/Perfetto trace of the run (all ranks) to this file
    break_lock: bool = False  # take over the lock another host left (training.runlock; never a live one here)


def _agree_run_dir(cfg: TrainConfig, opts: RunOptions, ps: ParallelState) -> Path:
    """Every rank uses rank 0's run folder (chosen there when not given)."""
    chosen = [str(opts.run_dir or default_run_dir(cfg))]
    if ps.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def _attach_checkpointing(trainer, cfg: TrainConfig, run_dir: Path, opts: RunOptions):
    """Checkpoints under ``run_dir/checkpoints`` (``training.checkpoint.trainer_hooks``): resume (also with
    another DP size), periodic async saves with the stall metric, and rollback on faults when enabled."""
    return attach(trainer, cfg, run_dir, opts.resume)


def run_training(cfg: TrainConfig, opts: RunOptions) -> dict[str, Any]:
    """Train this rank's part of ``cfg``; returns the summary (every rank); rank 0 prints and writes it.

    Rank 0 chooses the run folder and holds its lock (``training.runlock``) from before the process group
    until it returns or raises: a second job on the folder fails at once with ``RunFolderLocked``.
    SIGTERM / SIGINT (from here to the end, the final save included) and ``run.max_minutes`` stop every rank
    after the same step with a committed checkpoint of it (``training.preempt``); the summary's ``stopped``
    then holds the cause, the step and the exit status for the CLI."""
    with Preemption(cfg.run.max_minutes) as preemption:
        rank, world = world_from_env()
        checked = check_static(cfg, world)  # before any process group: bad input fails here with a ValueError
        check_resume(opts.resume, cfg)  # a checkpoint of this config, before the run folder is made
        lock = None
        if rank == 0:
            opts = dataclasses.replace(opts, run_dir=str(choose_run_dir(cfg, opts.run_dir, opts.resume)))
            lock = take_run_lock(opts.run_dir, break_lock=opts.break_lock)
        elif opts.run_dir:  # a --nproc worker stops with the launcher that holds the lock
            follow_launcher(opts.run_dir, announce=lambda line: None)
        try:
            if rank == 0:
                check_fresh(opts.run_dir, opts.resume)
            return _train(cfg, opts, world, checked, preemption)
        finally:
            if lock is not None:
                lock.release()


def _train(cfg: TrainConfig, opts: RunOptions, world: int, checked, preemption: Preemption) -> dict[str, Any]:
    starts_group = world > 1 and not dist.is_initialized()
    ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
    summary = _train_on(cfg, opts, world, checked, preemption, ps)
    if starts_group:
        # every rank is past the last barrier: tear the groups down here rather than in the interpreter's exit,
        # where torch 2.11 + gloo sometimes aborted a rank ("terminate called without an active exception")
        shutdown()
    return summary


def _train_on(cfg: TrainConfig, opts: RunOptions, world: int, checked, preemption: Preemption,
              ps: ParallelState) -> dict[str, Any]:
    run_dir = _agree_run_dir(cfg, opts, ps)
    wandb_mode = resolve_wandb_mode(cfg.logging.wandb, opts.wandb) if ps.rank == 0 else "disabled"
    if ps.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"run folder: {run_dir}\n{_layout_line(cfg, world)}", flush=True)
    recorder = TraceRecorder(ps.rank) if opts.trace else None
    trainer = Trainer(cfg, ps, run_dir, wandb_mode, checked, recorder)
    hooks = _attach_checkpointing(trainer, cfg, run_dir, opts)
    if ps.rank == 0:  # only now: a refused resume leaves the folder's config as it was
        write_config(run_dir, cfg)
    trainer.preemption = preemption
    if hooks is not None:
        preemption.save_seconds = lambda: hooks.manager.last_write_seconds
    watchdog = FlightWatchdog(trainer.flight, cfg.run.watchdog_s).start()  # and SIGUSR1: dump the flight recorder
    try:
        summary = trainer.fit()
    finally:
        watchdog.stop()
    manager, stop_line = None, None
    if trainer.stopped is not None:  # SIGTERM / SIGINT / time budget: a committed checkpoint of this step
        run_hooks = hooks  # checkpointing off: hooks made for this save only
        hooks, status, stop_line = save_on_stop(lambda: run_hooks or CheckpointHooks(trainer, run_dir / "checkpoints"),
                                                trainer.step, ps, trainer.stopped, cfg.run.max_minutes)
        summary["stopped"] = {"cause": trainer.stopped.cause, "step": trainer.stopped.step, "exit_status": status}
    if hooks is not None:
        if cfg.checkpoint.final and trainer.stopped is None:
            t0 = time.perf_counter()
            hooks.save()
            summary["final_checkpoint_stall_s"] = time.perf_counter() - t0
        hooks.close()  # waits for the write in flight
        manager = hooks.manager
    if recorder is not None:
        _write_trace(opts.trace, recorder, ps)
    sample = None
    if opts.sample and cfg.run.sample_prompt and cfg.run.sample_tokens > 0 and trainer.stopped is None:
        sample = trainer.generate(cfg.run.sample_prompt, cfg.run.sample_tokens)
    if ps.rank == 0:
        plot = trainer.logger.plot() if cfg.logging.plot and hasattr(trainer.logger, "plot") and not stop_line else None
        trainer.logger.close(summary)
        if stop_line is None:
            _print_end(summary, run_dir, plot, manager, cfg, sample)
        else:  # the one line a preempted job leaves: what was saved where, or why not
            print(stop_line, file=sys.stdout if summary["stopped"]["exit_status"] == cli.OK else sys.stderr,
                  flush=True)
    summary["history"] = trainer.history
    summary["run_dir"] = str(run_dir)
    summary["sample"] = sample
    if ps.world_size > 1:
        dist.barrier()
    return summary


def _write_trace(path: str, recorder: TraceRecorder, ps: ParallelState) -> None:
    """Every rank's spans gathered to rank 0, which writes one trace (a process per rank)."""
    states = [recorder.state()]
    if ps.world_size > 1:
        gathered = [None] * ps.world_size if ps.rank == 0 else None
        dist.gather_object(states[0], gathered, dst=0)
        states = gathered
    if ps.rank == 0:
        print(f"trace       : {write_chrome_trace(path, states)} (open in ui.perfetto.dev or chrome://tracing)")


def _layout_line(cfg: TrainConfig, world: int) -> str:
    p = cfg.parallel
    e = cfg.eplb
    eplb = f", EPLB +{e.redundant_experts} slots/layer re-planned every {e.interval} steps" if e.enabled else ""
    cp, over = (f" x cp {p.cp}", "cp x dp") if p.cp > 1 else ("", "dp")
    return (f"layout: {world} process(es) = pp {p.pp}{cp} x dp {p.dp}, ep {p.ep} over {over}, schedule {p.schedule}"
            f"{f' x vpp {p.vpp}' if p.vpp > 1 else ''}; "
            f"model {cfg.model.preset}{' (FP8)' if cfg.model.fp8 else ''}, balance {cfg.balance.strategy}{eplb}")


def _print_end(summary: dict[str, Any], run_dir: Path, plot: Path | None, manager, cfg: TrainConfig,
               sample: str | None) -> None:
    print("\n== summary ==")
    print(format_summary({k: v for k, v in summary.items() if v is not None}))
    print(f"run folder  : {run_dir}")
    print(f"metrics     : {run_dir / 'metrics.jsonl'}")
    if plot is not None:
        print(f"loss curve  : {plot}")
    if manager is not None:
        steps = manager.committed_steps()
        print(f"checkpoints : {manager.root} (committed steps {steps})")
    if sample is not None:
        print(f"sample      : {cfg.run.sample_prompt!r} ->\n{cfg.run.sample_prompt}{sample}")
    print(flush=True)
