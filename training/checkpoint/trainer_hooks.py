"""Checkpointing and fault tolerance for ``training.trainer.Trainer``, through its hooks.

``attach(trainer, cfg, run_dir, resume)`` is all ``training.run`` calls. The trainer is taken as a
:class:`Checkpointable`: the attributes and methods these hooks use, and nothing else (this module does not import
``training.trainer``). It

- resumes (``"auto"``: the newest valid checkpoint, with fallback; or a folder), also under any other
  valid layout (pp, dp, ep, schedule, EPLB, ZeRO-1): optimizer states are saved by parameter name (ZeRO-1
  shards as they are, expert parameters qualified by their expert range), model tensors by global name,
  and each rank reads what it now owns (``training.checkpoint.reshard``);
- saves every ``checkpoint.interval`` steps (async by default) and reports the loop's stall as
  ``checkpoint_stall_s``; a failed background write raises at the next step;
- with ``[fault] enabled`` (the default), checks every step's loss and gradient norm before the optimizer
  step, skips the update of a faulty step, rolls every rank back to the last stable checkpoint, skips the
  offending data window, and logs ``rollback`` / ``resume`` / ``restart`` events to the metrics stream.
  Before every save (interval, final, or any other caller of :meth:`CheckpointHooks.save`) every rank
  checks that the state it would write is finite: no non-finite tensor is ever committed. No step-0
  checkpoint is written: until the first checkpoint is stable, a fault stops the run
  (``FaultToleranceError``, one line) instead of rolling back.

"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from models.deepseek_v3 import ModelArgs
from training.checkpoint import format as fmt
from training.checkpoint.manager import CheckpointManager, read_checkpoint, read_metadata
from training.checkpoint.reshard import read_resharded
from training.checkpoint.resume import local_param_groups, restart_count
from training.checkpoint.rng import restore_rng_state
from training.checkpoint.writer import CheckpointWriteError, paused_writer
from training.config import ParallelConfig, TrainConfig
from training.data import ResumableSampler
from training.fault import FaultPolicy, FaultTolerance, FaultToleranceError, Verdict
from training.metrics import MetricsLogger, NullLogger
from training.optim import Optimizers
from training.parallel import ParallelState
from training.runlock import owns

log = logging.getLogger(__name__)


Hook = Callable[[Any, dict[str, Any]], Any]


class Checkpointable(Protocol):
    """What checkpointing and the fault guard use of a trainer (``training.trainer.Trainer`` is one): its config,
    process groups and model parts (to read a checkpoint saved under another layout), the step, its state and the
    checkpoint's global information, the data sampler (a rollback skips the offending batches), the metrics logger
    (events), and the two hook lists the hooks register in."""

    cfg: TrainConfig
    ps: ParallelState
    args: ModelArgs
    stages: list[nn.Module]
    optimizer: Optimizers
    eplb: Any  # training.eplb.EplbRuntime, or None without EPLB: only whether it is on is read
    sampler: ResumableSampler
    logger: MetricsLogger | NullLogger
    step: int
    after_backward_hooks: list[Hook]
    step_end_hooks: list[Hook]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def param_names(self) -> dict[int, str]: ...


def load_checkpoint(trainer: Checkpointable, folder: Path) -> int:
    """Load ``folder`` into ``trainer`` (``Trainer.load_state_dict``); returns the step. Under the layout that
    wrote it this is the rank's own files (bit-exact, RNG included); under any other valid layout
    ``reshard.read_resharded`` reads what each rank now owns by global name and expert id."""
    metadata = read_metadata(folder)
    full = fmt.decode_tree(metadata["full_config"], {}) if "full_config" in metadata else None
    par = trainer.cfg.parallel
    saved_par = ParallelConfig(**full["parallel"]) if full is not None else par
    expect = trainer.checkpoint_meta()["config"]
    # EPLB on/off needs no resharding: experts and their moments are saved in the logical layout either way
    # (a change of CP size is a change of layout: CP ranks hold replicas of the non-expert state, so it reshards)
    if (saved_par.pp, saved_par.dp, saved_par.ep, saved_par.cp, saved_par.schedule, saved_par.zero1) != \
            (par.pp, par.dp, par.ep, par.cp, par.schedule, par.zero1):
        names = trainer.param_names()
        step, state, rng = read_resharded(folder, trainer.args, par, trainer.ps.coords, expect,
                                          model_keys=[k for st in trainer.stages for k in st.state_dict()],
                                          optimizer_groups=[local_param_groups(opt, names)
                                                            for opt in trainer.optimizer.optimizers],
                                          eplb=trainer.eplb is not None)
    else:
        loaded = read_checkpoint(folder, trainer.ps.rank, expect_config=expect)
        step, state, rng = loaded.step, loaded.state, loaded.rng
    try:
        trainer.load_state_dict(state)
    except fmt.CheckpointMismatchError as exc:
        raise fmt.CheckpointMismatchError(f"checkpoint {folder}: {exc}") from None
    if rng is not None:
        restore_rng_state(rng)
    return step


class CheckpointHooks:
    """The manager, the fault guard and the two trainer hooks of one run."""

    def __init__(self, trainer: Checkpointable, root: str | Path, resume: str | None = None) -> None:
        cfg = trainer.cfg
        ck = cfg.checkpoint
        self.trainer, self.cfg = trainer, cfg
        self.manager = CheckpointManager(root, async_save=ck.async_save, keep_last=ck.keep_last,
                                         keep_every=ck.keep_every, commit_timeout_s=cfg.run.timeout_s,
                                         metrics=self._log_event,
                                         save_tensors=paused_writer(ck.write_delay_s) if ck.write_delay_s else None,
                                         sweep=owns(Path(root).parent))  # only under the run folder's lock
        self.fault = None
        if cfg.fault.enabled:
            policy = FaultPolicy.from_config(cfg.fault)
            policy.collective_timeout_s = cfg.run.timeout_s
            self.fault = FaultTolerance(policy, self.manager, self._log_event)
        self._pending: Verdict | None = None
        self._early_events: list[dict[str, Any]] = []
        self.saved_step: int | None = None  # the step of the last save started (a stop need not repeat it)
        if resume:
            self._resume(resume)
        # No step-0 save as a rollback target: it would stall the start of every run (minutes of idle GPUs at
        # V3 scale) for a state the seed reproduces; a fault before the first stable checkpoint stops the run.
        trainer.after_backward_hooks.append(self._after_backward)
        trainer.step_end_hooks.append(self._step_end)

    # ------------------------------------------------------------------------------------------ resume
    def _resume(self, resume: str) -> None:
        try:
            folder = self.manager.resolve(resume)
        except fmt.CheckpointCorruptError as exc:  # a folder given on the command line: bad input, one line
            raise ValueError(f"--resume {resume!r}: {exc}") from None
        if folder is None:
            return
        step = load_checkpoint(self.trainer, folder)
        event = "restart" if restart_count() else "resume"
        self._log_event({"event": event, "step": step, "checkpoint": str(folder), "restart_count": restart_count()})
        if self.trainer.ps.rank == 0:
            print(f"{event}: from {folder} at step {step}", flush=True)
        if self.fault is not None:
            self.fault.on_resume(step)

    # ------------------------------------------------------------------------------------------ hooks
    def _after_backward(self, trainer: Checkpointable, metrics: dict[str, Any]) -> bool:
        if self.fault is None:
            return True
        with self._stopping():
            verdict = self.fault.check(trainer.step + 1, metrics["loss"], metrics.get("grad_norm"),
                                       fp8_shadow=bool(metrics.get("fp8_shadow_fault")))
        if verdict.ok:
            return True
        self._pending = verdict
        return False  # no optimizer update from a faulty step

    def _step_end(self, trainer: Checkpointable, metrics: dict[str, Any]) -> None:
        with self._write_failure():
            self._step_end_checked(trainer, metrics)

    def _step_end_checked(self, trainer: Checkpointable, metrics: dict[str, Any]) -> None:
        self.manager.poll()
        while self._early_events and self._logger() is not None:
            self._log_event(self._early_events.pop(0))
        if self._pending is not None:
            verdict, self._pending = self._pending, None
            self._rollback(verdict)
            metrics.update(rollback_to=verdict.rollback_step, skipped_batches=verdict.skip_batches)
            return
        ck = self.cfg.checkpoint
        if ck.interval and trainer.step % ck.interval == 0 and trainer.step < self.cfg.run.steps:
            t0 = time.perf_counter()
            with self._stopping():
                state, verdict = self._checked_state()
            if not verdict.ok:  # the update of this step made the state non-finite: never commit it
                self._rollback(verdict)
                metrics.update(rollback_to=verdict.rollback_step, skipped_batches=verdict.skip_batches)
                return
            metrics["checkpoint_stall_s"] = time.perf_counter() - t0 + self._save(state)

    def _rollback(self, verdict: Verdict) -> None:
        trainer = self.trainer
        load_checkpoint(trainer, self.manager.root / fmt.step_dirname(verdict.rollback_step))
        # the offending data window, read and dropped: the batches the schedule gave the steps after the restored one
        for _, point in zip(range(verdict.skip_batches), trainer.schedule.walk(trainer.step, trainer.tokens_seen)):
            trainer.sampler.next_batch(point.global_batch)
        self.fault.rolled_back(verdict)

    @contextlib.contextmanager
    def _stopping(self) -> Iterator[None]:
        """A FaultToleranceError stops the run: the save in flight (an earlier step, checked healthy) completes
        before the error leaves, so the run folder is left as a resume expects it, and the metrics logger is
        closed (progress bar, ``summary.json`` with the reason, wandb) so the error's line is the last printed."""
        try:
            yield
        except FaultToleranceError as fault:
            try:
                self.manager.close()
            except fmt.CheckpointError as exc:  # the fault is what the user must see; the write error is logged
                log.warning("while stopping on a fault: %s", exc)
            self.trainer.logger.close({"steps": self.trainer.step, "stopped": str(fault)})
            raise

    @contextlib.contextmanager
    def _write_failure(self) -> Iterator[None]:
        """A failed checkpoint write (a full disk, a folder made read-only) stops the run with a
        ``CheckpointWriteError`` saying what failed, where, and which committed checkpoint is intact: the writer's
        staging folder and atomic rename leave the last committed one as it was (``recipes.train`` prints it as
        one line, exit status 3). The metrics logger is closed first (progress bar, wandb; nothing more is written
        to the run folder), so the error's line is the last."""
        try:
            yield
        except CheckpointWriteError as exc:
            try:
                self.trainer.logger.close()
            except Exception as close_error:  # noqa: BLE001 - the failed save is what the user must see
                log.warning("while stopping on a failed save: %s", close_error)
            root, latest = self.manager.root, self.manager.latest_step()
            intact = (f"the last committed checkpoint, {fmt.step_dirname(latest)} in {root}, is intact: free space "
                      "or make the folder writable, then --resume auto" if latest is not None else
                      f"no checkpoint had been committed in {root}: free space or make the folder writable and "
                      "start again")
            raise CheckpointWriteError(f"{exc}; {intact}") from exc

    def _checked_state(self) -> tuple[dict[str, Any], Verdict]:
        """The state to save and, with the guard on, every rank's verdict on its finiteness (a fault when not)."""
        state = self.trainer.state_dict()
        if self.fault is None:
            return state, Verdict(ok=True, step=self.trainer.step)
        return state, self.fault.check_state(self.trainer.step, state)

    def _save(self, state: dict[str, Any], sync: bool | None = None) -> float:
        trainer = self.trainer
        stall = self.manager.save(trainer.step, state, trainer.checkpoint_meta(), sync=sync)
        self.saved_step = trainer.step
        if self.fault is not None:
            self.fault.on_checkpoint(trainer.step)
        return stall

    # ------------------------------------------------------------------------------------------ public
    def save(self, sync: bool | None = None) -> float:
        """Save the trainer's state at its current step; returns the loop's stall in seconds.

        With the guard on, a non-finite state is not saved: every rank rolls back to the stable checkpoint
        (which ``--resume auto`` then continues from) and FaultToleranceError stops the run, since the
        caller (the final save, a preemption save) is past the training loop and cannot replay the steps."""
        t0 = time.perf_counter()
        with self._stopping():
            state, verdict = self._checked_state()
            if not verdict.ok:
                self._rollback(verdict)
                raise FaultToleranceError(f"step {verdict.step}: {verdict.reason}; not saved: rolled back to the "
                                          f"stable checkpoint of step {verdict.rollback_step} (--resume auto "
                                          "continues from there)")
        with self._write_failure():
            return time.perf_counter() - t0 + self._save(state, sync)

    def close(self) -> None:
        """Wait for the write in flight; ``CheckpointWriteError`` (as ``_write_failure`` says it) when it failed."""
        with self._write_failure():
            self.manager.close()

    def _logger(self):
        """The trainer's metrics logger once ``fit`` started it (rank 0), else None."""
        logger = self.trainer.logger
        return None if isinstance(logger, NullLogger) else logger

    def _log_event(self, record: dict[str, Any]) -> None:
        if self.trainer.ps.rank != 0:
            return
        logger = self._logger()
        if logger is None:  # before fit() starts the logger (resume events): keep for the first step
            self._early_events.append(record)
        else:
            logger.log(int(record.get("step", self.trainer.step)), record)


def attach(trainer: Checkpointable, cfg: TrainConfig, run_dir: str | Path, resume: str | None = None
           ) -> CheckpointHooks | None:
    """Checkpointing (and fault tolerance) for ``trainer`` under ``run_dir/checkpoints``; None when off."""
    ck = cfg.checkpoint
    if not (ck.interval or ck.final or resume or cfg.fault.enabled):
        return None
    return CheckpointHooks(trainer, Path(run_dir) / "checkpoints", resume)
