"""Stopping a run cleanly before the scheduler kills it: on SIGTERM / SIGINT, or before ``run.max_minutes``.

What a cluster job expects (SLURM's ``--signal``, a Kubernetes grace period): SIGTERM arrives some time
before SIGKILL; every rank finishes the step it is in, the job commits a checkpoint of that step and
exits 0, and ``--resume auto`` continues as if nothing had happened.

- :class:`Preemption` (installed by ``training.run`` for the whole run, the final save included) replaces
  the SIGTERM and SIGINT handlers with one that only records the signal: raising in the middle of a step
  would leave the ranks inside different collectives. A repeated signal is counted and ignored, so a second
  Ctrl-C or SIGTERM while the checkpoint is written cannot interrupt it (SIGKILL still can; the writer's
  staging folder + rename then leaves the previous committed checkpoint as ``latest``).
- :meth:`Preemption.check` runs at every step boundary (``Trainer.fit``): one all-reduce (MAX) of one
  integer over all ranks, none in a 1-process run, so a signal delivered to only some ranks, or to each at
  another moment, stops every rank after the same step.
- The time budget: with ``run.max_minutes`` > 0 a rank asks to stop when elapsed + the expected next step
  + the expected save would pass the budget (same all-reduce: one rank's verdict stops all).
- :func:`save_on_stop` commits a synchronous checkpoint of the last completed step through the run's
  ``CheckpointHooks`` (made on demand when only ``checkpoint.interval`` or nothing is configured), after the
  write in flight, and returns the exit status (``accel.cli.OK``, or ``SAVE_FAILED`` on any rank's failure)
  and the one line rank 0 prints. It takes the hooks, the step and the process groups, not the trainer.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from accel import cli
from training.checkpoint import format as fmt
from training.checkpoint.trainer_hooks import CheckpointHooks
from training.fault import FaultToleranceError
from training.parallel import ParallelState

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TIME_BUDGET = 1  # agreement code of the budget; signals use their numbers (2, 15): MAX reports a signal first
RECENT_STEPS = 5  # the next step is expected to take as long as the slowest of the last few


@dataclass(frozen=True)
class Stop:
    """Why and after which step every rank stopped."""

    step: int
    code: int  # TIME_BUDGET or the signal number

    @property
    def cause(self) -> str:
        return "the time budget" if self.code == TIME_BUDGET else signal.Signals(self.code).name

    def headline(self, max_minutes: float) -> str:
        if self.code == TIME_BUDGET:
            return f"stopped for the time budget (run.max_minutes={max_minutes:g}) after step {self.step}"
        return f"preempted by {self.cause} after step {self.step}"


class Preemption:
    """The stop flag (set by SIGTERM / SIGINT) and the time-budget rule of one run; see the module doc.

    Use as a context manager around the whole run: the handlers are installed on entry (main thread only:
    Python runs signal handlers there) and the previous ones restored on exit.
    """

    def __init__(self, max_minutes: float = 0.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_minutes = max_minutes
        self.clock = clock
        self.started = clock()
        self.received: int | None = None  # the first stop signal
        self.repeats = 0  # further stop signals, ignored
        self.save_seconds: Callable[[], float] | None = None  # the last measured checkpoint write, when known
        self._steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.repeats += 1

    def over_budget(self, now: float) -> bool:
        """Whether the next step and a save would end past ``run.max_minutes`` (counted from construction).

        Before the first checkpoint write is measured, the save is assumed to take as long as a step."""
        if self.max_minutes <= 0 or not self._steps:
            return False
        step_s = max(self._steps)
        save_s = self.save_seconds() if self.save_seconds is not None else 0.0
        return (now - self.started) + step_s + (save_s if save_s > 0 else step_s) > self.max_minutes * 60

    def check(self, step: int, last_step: int, step_seconds: float, world_size: int,
              device: torch.device | None = None) -> Stop | None:
        """At the boundary after ``step`` (which took ``step_seconds``): whether every rank stops now.

        Collective when ``world_size`` > 1: every rank must call it after every step."""
        self._steps.append(step_seconds)
        code = self.received or 0
        if not code and step < last_step and self.over_budget(self.clock()):
            code = TIME_BUDGET
        if world_size > 1:
            t = torch.tensor([code], dtype=torch.int64, device=device)
            try:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            except RuntimeError as exc:
                raise RuntimeError(f"rank {dist.get_rank()}: step {step}: the all-reduce that agrees on stopping "
                                   f"failed: {exc}") from exc
            code = int(t.item())
        return Stop(step, code) if code else None


def save_on_stop(hooks: Callable[[], CheckpointHooks], step: int, ps: ParallelState, stop: Stop,
                 max_minutes: float = 0.0) -> tuple[CheckpointHooks | None, int, str]:
    """Commit a synchronous checkpoint of ``step``, the step every rank stopped after (every rank calls this);
    returns (the hooks, exit status, the line to print). ``hooks()`` gives the run's hooks, or makes them when
    checkpointing is off (a failure to make them is a failed save like any other; the hooks are then None).

    A step already saved (the interval save of this very step, still in flight) is waited for, not written
    again. The ranks agree on the outcome with one gather, so all exit with the same status."""
    error = None
    made = None
    try:
        made = hooks()
        saved = made.saved_step == step
        try:
            made.manager.wait()  # the async write in flight; its failure does not stop this save
        except fmt.CheckpointError:
            saved = False
        if not saved:
            made.save(sync=True)
        if ps.rank == 0 and made.manager.latest_step() != step:
            error = f"'latest' names step {made.manager.latest_step()} after saving step {step}"
    except FaultToleranceError:  # a non-finite state (every rank agreed): the guard's stop, status 4, not 3
        raise
    except Exception as exc:  # report it in one line: a full disk, a dead rank, a timeout
        error = f"{type(exc).__name__}: {exc}"
    errors: list[str | None] = [error]
    if ps.world_size > 1:
        gathered: list[str | None] = [None] * ps.world_size
        try:
            dist.all_gather_object(gathered, error)
            errors = gathered
        except RuntimeError as exc:
            errors = [error or f"the ranks could not agree on the save: {exc}"]
    failed = [(r, e) for r, e in enumerate(errors) if e]
    head = stop.headline(max_minutes)
    if failed:
        rank, why = failed[0]
        why = " ".join(why.split())
        where = f"rank {rank}: " if ps.world_size > 1 and f"rank {rank}:" not in why else ""
        return made, cli.SAVE_FAILED, f"{head}: checkpoint not saved ({where}{why})"
    root = made.manager.root
    return made, cli.OK, (f"{head}: checkpoint {fmt.step_dirname(step)} committed in {root}; "
                          "resume with --resume auto")
