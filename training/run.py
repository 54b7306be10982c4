"""One training run on this rank, as ``recipes.train`` starts it: groups, trainer, checkpoints, logging, sample.

Split from the CLI so tests can run it inside their own process groups.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from training.config import TrainConfig
from training.metrics import format_summary, resolve_wandb_mode
from training.parallel import ParallelState, init_parallel, world_from_env


@dataclass
class RunOptions:
    run_dir: str | None = None
    resume: str | None = None  # None | "auto" | a checkpoint folder
    wandb: str | None = None  # None: WANDB_MODE, else the config
    sample: bool = True


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.runs_root) / f"{cfg.run.name}-{stamp}-{os.getpid()}"


def _agree_run_dir(cfg: TrainConfig, opts: RunOptions, ps: ParallelState) -> Path:
    """Every rank uses rank 0's run folder (chosen there when not given)."""
    chosen = [str(opts.run_dir or default_run_dir(cfg))]
    if ps.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def _attach_checkpointing(trainer, cfg: TrainConfig, run_dir: Path, opts: RunOptions):
    """CheckpointManager under ``run_dir/checkpoints``: resume, periodic async saves, stall metric."""
    ck = cfg.checkpoint
    if not (ck.interval or ck.final or opts.resume):
        return None
    from training.checkpoint import CheckpointManager, restore_rng_state

    manager = CheckpointManager(run_dir / "checkpoints", async_save=ck.async_save, keep_last=ck.keep_last,
                                keep_every=ck.keep_every, commit_timeout_s=cfg.run.timeout_s)
    if opts.resume:
        loaded = manager.load(opts.resume, expect_config=trainer.checkpoint_meta()["config"])
        if loaded is None:
            if opts.resume != "auto":
                raise ValueError(f"--resume {opts.resume}: no checkpoint there")
        else:
            trainer.load_state_dict(loaded.state)
            if loaded.rng is not None:
                restore_rng_state(loaded.rng)
            if trainer.ps.rank == 0:
                print(f"resumed from {loaded.path} at step {trainer.step}", flush=True)

    def save_hook(tr, metrics: dict[str, Any]) -> None:
        manager.poll()
        if ck.interval and tr.step % ck.interval == 0 and tr.step < cfg.run.steps:
            metrics["checkpoint_stall_s"] = manager.save(tr.step, tr.state_dict(), tr.checkpoint_meta())

    trainer.step_end_hooks.append(save_hook)
    return manager


def run_training(cfg: TrainConfig, opts: RunOptions) -> dict[str, Any]:
    """Train this rank's part of ``cfg``; returns the summary (every rank); rank 0 prints and writes it."""
    from training.trainer import Trainer, check_static

    checked = check_static(cfg)  # before any process group: bad input fails here with a ValueError
    rank, world = world_from_env()
    ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
    run_dir = _agree_run_dir(cfg, opts, ps)
    wandb_mode = resolve_wandb_mode(cfg.logging.wandb, opts.wandb) if ps.rank == 0 else "disabled"
    if ps.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
        print(f"run folder: {run_dir}\n{_layout_line(cfg, world)}", flush=True)
    trainer = Trainer(cfg, ps, run_dir, wandb_mode, checked)
    manager = _attach_checkpointing(trainer, cfg, run_dir, opts)
    summary = trainer.fit()
    if manager is not None:
        if cfg.checkpoint.final:
            t0 = time.perf_counter()
            manager.save(trainer.step, trainer.state_dict(), trainer.checkpoint_meta())
            summary["final_checkpoint_stall_s"] = time.perf_counter() - t0
        manager.wait()
        manager.close()
    sample = None
    if opts.sample and cfg.run.sample_prompt and cfg.run.sample_tokens > 0:
        sample = trainer.generate(cfg.run.sample_prompt, cfg.run.sample_tokens)
    if ps.rank == 0:
        plot = trainer.logger.plot() if cfg.logging.plot and hasattr(trainer.logger, "plot") else None
        trainer.logger.close(summary)
        _print_end(summary, run_dir, plot, manager, cfg, sample)
    summary["history"] = trainer.history
    summary["run_dir"] = str(run_dir)
    summary["sample"] = sample
    if ps.world_size > 1:
        dist.barrier()
    return summary


def _layout_line(cfg: TrainConfig, world: int) -> str:
    p = cfg.parallel
    return (f"layout: {world} process(es) = pp {p.pp} x dp {p.dp}, ep {p.ep} over dp, schedule {p.schedule}; "
            f"model {cfg.model.preset}{' (FP8)' if cfg.model.fp8 else ''}, balance {cfg.balance.strategy}")


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
