"""Fault tolerance: detect a NaN/Inf or a loss spike, agree on it across ranks, roll back to a stable checkpoint.

Per step the training loop calls :meth:`FaultTolerance.check` with the loss and the gradient norm
*before* the optimizer step. Each rank judges locally (non-finite loss, non-finite gradient norm, or
a loss more than ``spike_sigma`` standard deviations above the mean of the last ``window`` healthy
losses); one all-reduce (MAX) makes every rank see the same verdict and rank 0's stable step, so all
ranks roll back together to the same checkpoint. The all-reduce has a timeout whose error names the
rank and the step: a dead or stalled rank stops the job instead of hanging it (``torchrun
--max-restarts`` then restarts it, and the restart resumes from the latest committed checkpoint).

A checkpoint becomes *stable* once ``stable_after`` healthy steps have passed since it (and it is
committed); only stable checkpoints are rollback targets. After a rollback the loop skips the data
window between the stable checkpoint and the faulty step (plus ``skip_extra_batches``). After
``max_retries`` rollbacks without a new stable checkpoint in between, :class:`FaultToleranceExhausted`
stops the run with a report. Every rollback is written to the metrics stream.

Before every save, :meth:`FaultTolerance.check_state` asks every rank whether the state it is about to
write (weights, optimizer moments, buffers) is finite: an update can make it non-finite from a finite
loss and gradient norm (an overflowing moment, a NaN in an expert no token reached), and such a state
is treated as a fault of that step instead of being committed. The errors' messages are one line, as
``recipes.train`` prints them (exit status ``accel.cli.FAULT_STOP``).

FP8 runs can add a fourth reason: :class:`Fp8Shadow` watches the relative gap between a micro-batch's loss
with FP8 GEMMs and the same loss with them off; a gap above its threshold in ``patience`` checks in a row is a
fault (``check(..., fp8_shadow=True)``), handled like the others, and ``blame_layers`` finds the blocks whose
FP8 GEMMs make the gap so that the run can continue with those in BF16 (docs/fp8.md).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_NONFINITE_LOSS, _NONFINITE_GRAD, _SPIKE, _NONFINITE_STATE, _FP8_SHADOW = 0, 1, 2, 3, 4
_REASONS = ("non-finite loss", "non-finite gradient norm", "loss spike", "non-finite weights or optimizer state",
            "FP8 loss gap to BF16 above threshold")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class FaultToleranceError(RuntimeError):
    """A fault the run cannot recover from (no stable checkpoint to roll back to); the message is one line."""


class FaultToleranceExhausted(FaultToleranceError):
    """More than ``max_retries`` rollbacks without progress; ``report`` lists every fault seen."""

    def __init__(self, message: str, report: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.report = report


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: some rank is dead or stalled."""


@dataclass
class FaultPolicy:
    """When to call a step faulty and how to recover (field names match ``[fault]`` in the training config)."""

    spike_sigma: float = 6.0
    window: int = 50
    min_history: int = 10  # healthy losses needed before spikes are judged
    stable_after: int = 20
    max_retries: int = 3
    skip_extra_batches: int = 0
    collective_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("window", "min_history", "stable_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"FaultPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_history > self.window:
            raise ValueError(f"FaultPolicy.min_history ({self.min_history}) must be <= window ({self.window})")
        if not self.spike_sigma > 0:
            raise ValueError(f"FaultPolicy.spike_sigma must be > 0, got {self.spike_sigma}")
        if self.max_retries < 0 or self.skip_extra_batches < 0 or self.collective_timeout_s <= 0:
            raise ValueError("FaultPolicy.max_retries and skip_extra_batches must be >= 0 and "
                             f"collective_timeout_s > 0, got {self.max_retries}, {self.skip_extra_batches}, "
                             f"{self.collective_timeout_s}")

    @classmethod
    def from_config(cls, cfg: Any) -> FaultPolicy:
        """Build from any object with (some of) these attributes, e.g. ``TrainConfig.fault``."""
        kw = {f: getattr(cfg, f) for f in cls.__dataclass_fields__ if hasattr(cfg, f)}
        if "min_history" not in kw and "window" in kw:
            kw["min_history"] = min(cls.min_history, kw["window"])
        return cls(**kw)


class SpikeDetector:
    """Mean and standard deviation of the last ``window`` healthy losses; a spike is > mean + sigma * std."""

    def __init__(self, window: int, sigma: float, min_history: int) -> None:
        self.sigma, self.min_history = sigma, min_history
        self.history: deque[tuple[int, float]] = deque(maxlen=window)

    def is_spike(self, loss: float) -> bool:
        if len(self.history) < self.min_history:
            return False
        values = torch.tensor([v for _, v in self.history], dtype=torch.float64)
        mean, std = values.mean().item(), values.std(unbiased=False).item()
        std = max(std, 1e-6 * abs(mean), 1e-12)  # a flat history would otherwise flag any rounding
        return loss > mean + self.sigma * std

    def add(self, step: int, loss: float) -> None:
        self.history.append((step, loss))

    def forget_after(self, step: int) -> None:
        """Drop losses of steps after ``step`` (they belong to the trajectory that was rolled back)."""
        kept = [(s, v) for s, v in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)


@dataclass
class Verdict:
    """The agreed outcome of one step's check."""

    ok: bool
    step: int
    reason: str = ""
    rollback_step: int | None = None
    skip_batches: int = 0
    retry: int = 0
    details: dict[str, Any] = field(default_factory=dict)


class FaultTolerance:
    """Per-step health check, stability bookkeeping and rollback decisions for one rank.

    ``manager`` is the run's :class:`training.checkpoint.CheckpointManager`; ``metrics`` receives one
    dict per rollback (``{"event": "rollback", "step": ..., ...}``).
    """

    def __init__(self, policy: FaultPolicy, manager: Any, metrics: Callable[[dict[str, Any]], None] | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.policy, self.manager, self.metrics, self.group = policy, manager, metrics, group
        self.spikes = SpikeDetector(policy.window, policy.spike_sigma, policy.min_history)
        self.rank = manager.rank
        self._candidates: list[int] = []
        self._stable: int | None = manager.stable_step() if self.rank == 0 else None
        self.retries = 0
        self._agreed_stable = -1.0
        self.report: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------ bookkeeping
    def on_checkpoint(self, step: int) -> None:
        """Call after ``manager.save(step, ...)``: the checkpoint may become stable ``stable_after`` steps later."""
        self.manager.pin(step)
        self._candidates.append(step)

    def on_resume(self, step: int) -> None:
        """Call after loading checkpoint ``step`` at start-up (or a restart).

        The stable pointer saved by the previous attempt stays the rollback target when it is not newer
        than ``step``; the resumed checkpoint itself becomes a candidate like a fresh save.
        """
        if self.rank == 0:
            stable = self.manager.stable_step()
            self._stable = stable if stable is not None and stable <= step else None
            if self._stable is not None:
                self.manager.pin(self._stable)
        if step not in self._candidates and step != self._stable:
            self.on_checkpoint(step)

    def stable_step(self) -> int | None:
        return self._stable

    def _promote(self, step: int) -> None:
        """Mark candidates with ``stable_after`` healthy steps behind them stable (rank 0, once committed)."""
        ready = [c for c in self._candidates if step - c >= self.policy.stable_after]
        if not ready:
            return
        if self.rank == 0:
            committed = set(self.manager.committed_steps())
            latest = self.manager.latest_step()
            ready = [c for c in ready if c in committed and latest is not None and c <= latest]
            if not ready:
                return  # still being written: try again next step
            newest = max(ready)
            self.manager.mark_stable(newest)
            old = self._stable
            self._stable = newest
            if old is not None and old != newest:
                self.manager.unpin(old)
        for c in ready:
            self._candidates.remove(c)
            if c != self._stable:
                self.manager.unpin(c)

    # ------------------------------------------------------------------------------------------ the check
    def check(self, step: int, loss: float | torch.Tensor, grad_norm: float | torch.Tensor | None = None,
              fp8_shadow: bool = False) -> Verdict:
        """Judge step ``step`` on every rank together; a bad verdict carries the rollback target.
        ``fp8_shadow``: this step's BF16 shadow check found a sustained FP8 gap (:class:`Fp8Shadow`)."""
        loss_f = float(loss)
        grad_f = float(grad_norm) if grad_norm is not None else None
        flags = [0.0] * len(_REASONS)
        flags[_FP8_SHADOW] = float(fp8_shadow)
        if not math.isfinite(loss_f):
            flags[_NONFINITE_LOSS] = 1.0
        if grad_f is not None and not math.isfinite(grad_f):
            flags[_NONFINITE_GRAD] = 1.0
        if math.isfinite(loss_f) and self.spikes.is_spike(loss_f):
            flags[_SPIKE] = 1.0
        bad, stable = self._agree(flags, step)
        if not bad:
            self.spikes.add(step, loss_f)
            self._promote(step)
            return Verdict(ok=True, step=step)
        return self._fault(step, bad, stable, loss_f, grad_f)

    def check_state(self, step: int, state: Any) -> Verdict:
        """Before saving step ``step``: is every floating tensor in ``state`` finite on every rank?

        A non-finite state is a fault of step ``step`` (rollback verdict, or FaultToleranceError when there
        is nothing to roll back to): it must never be committed. Costs one read of the state on its device
        (the snapshot that follows copies it to host memory anyway) and one small all-reduce."""
        flags = [0.0] * len(_REASONS)
        if not tensors_finite(state):
            flags[_NONFINITE_STATE] = 1.0
        bad, stable = self._agree(flags, step)
        if not bad:
            return Verdict(ok=True, step=step)
        return self._fault(step, bad, stable, None, None)

    def _agree(self, flags: list[float], step: int) -> tuple[list[str], int]:
        """All-reduce (MAX) this rank's fault flags and rank 0's stable step: (agreed reasons, stable or -1)."""
        stable = float(self._stable) if self.rank == 0 and self._stable is not None else -1.0
        agreed = self._all_reduce_max(torch.tensor(flags + [stable], dtype=torch.float64), step)
        if agreed[-1] > self._agreed_stable:  # a new stable checkpoint: progress, the retry budget refills
            self._agreed_stable = agreed[-1]
            self.retries = 0
        return [_REASONS[i] for i in range(len(_REASONS)) if agreed[i] > 0], int(agreed[-1])

    def _fault(self, step: int, reasons: list[str], stable: int, loss: float | None, grad_norm: float | None
               ) -> Verdict:
        reason = " + ".join(reasons)
        self.retries += 1
        entry = {"event": "rollback", "step": step, "reason": reason, "loss": loss, "grad_norm": grad_norm,
                 "rollback_to": stable if stable >= 0 else None, "retry": self.retries}
        self.report.append(entry)
        if stable < 0:
            self._log(dict(entry, event="fault_unrecoverable"))
            raise FaultToleranceError(f"step {step}: {reason}; no good checkpoint to roll back to (no stable "
                                      "checkpoint yet: a committed checkpoint becomes stable "
                                      f"{self.policy.stable_after} healthy steps after it is saved, see "
                                      "checkpoint.interval and fault.stable_after); stopped without saving")
        if self.retries > self.policy.max_retries:
            self._log(dict(entry, event="fault_retries_exhausted"))
            seen = "; ".join(f"step {e['step']}: {e['reason']} (loss {e['loss']}, grad norm {e['grad_norm']}) "
                             f"-> rollback to {e['rollback_to']}" for e in self.report)
            raise FaultToleranceExhausted(f"step {step}: {reason}; giving up after {self.policy.max_retries} "
                                          f"rollbacks without a new stable checkpoint (faults seen: {seen}); "
                                          "stopped without saving", self.report)
        skip = step - stable + self.policy.skip_extra_batches
        entry["skip_batches"] = skip
        self._log(entry)
        if self.rank == 0:  # every rank agreed on it: one line per rollback, not one per rank
            log.warning("%s at step %d; rolling back to stable step %d and skipping %d batches (retry %d/%d)",
                        reason, step, stable, skip, self.retries, self.policy.max_retries)
        return Verdict(ok=False, step=step, reason=reason, rollback_step=stable, skip_batches=skip,
                       retry=self.retries, details=entry)

    def rolled_back(self, verdict: Verdict) -> None:
        """Call once the state of ``verdict.rollback_step`` is loaded: forget everything after it."""
        step = verdict.rollback_step
        self.spikes.forget_after(step)
        for c in [c for c in self._candidates if c > step]:
            self._candidates.remove(c)
            self.manager.unpin(c)
        self.manager.rollback_to(step)

    # ------------------------------------------------------------------------------------------ internals
    def _all_reduce_max(self, t: torch.Tensor, step: int) -> list[float]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            return t.tolist()
        timeout = self.policy.collective_timeout_s
        try:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            done = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise CollectiveTimeout(f"rank {self.rank}: fault-check all-reduce at step {step} failed or timed out "
                                    f"after {timeout:.0f}s (a rank is dead or stalled): {exc}") from exc
        if done is False:
            raise CollectiveTimeout(f"rank {self.rank}: fault-check all-reduce at step {step} did not complete in "
                                    f"{timeout:.0f}s: a rank is dead or stalled")
        return t.tolist()

    def _log(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics(record)


class Fp8Shadow:
    """The BF16 shadow's verdicts: a relative gap ``|loss_fp8 / loss_bf16 - 1|`` above ``threshold`` in
    ``patience`` checks in a row is sustained (one check alone is noise a single batch can make)."""

    def __init__(self, threshold: float, patience: int) -> None:
        if not threshold > 0 or patience < 1:
            raise ValueError(f"Fp8Shadow needs threshold > 0 and patience >= 1, got {threshold} and {patience}")
        self.threshold = threshold
        self.recent: deque[bool] = deque(maxlen=patience)

    def add(self, gap: float) -> bool:
        """Record one check's gap; True when the last ``patience`` gaps were all above the threshold (a NaN gap
        counts as above). The history then restarts, so a fault is raised once per ``patience`` bad checks."""
        self.recent.append(not abs(gap) <= self.threshold)
        if len(self.recent) == self.recent.maxlen and all(self.recent):
            self.recent.clear()
            return True
        return False


def fp8_modules(modules: Sequence[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Name -> module of every FP8 GEMM layer (a module with ``fp8`` on and a ``health`` slot: the FP8 Linear
    and the grouped experts) under ``modules``, named as in the checkpoint (``layers.3.attn.wq_b``)."""
    out: dict[str, torch.nn.Module] = {}
    for root in modules:
        for name, m in root.named_modules():
            if getattr(m, "fp8", False) and hasattr(m, "health"):
                out.setdefault(name, m)
    return out


@contextlib.contextmanager
def fp8_disabled(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The given FP8 layers run their GEMMs in BF16 (or the run's dtype) inside the block."""
    before = [m.fp8 for m in layers]
    for m in layers:
        m.fp8 = False
    try:
        yield
    finally:
        for m, fp8 in zip(layers, before):
            m.fp8 = fp8


def block_of(name: str) -> str:
    """The block a layer belongs to: ``layers.3.attn.wq_b`` -> ``layers.3``."""
    return ".".join(name.split(".")[:2])


def blame_layers(blocks: Sequence[str], gap_without: Callable[[list[str]], float], threshold: float) -> list[str]:
    """The blocks whose FP8 GEMMs make the gap: greedily, the block whose FP8-off forward shrinks the gap most,
    until the gap with all chosen blocks off is within ``threshold``. ``gap_without(blocks)`` is the relative
    gap with FP8 off in those blocks (a collective under a pipeline: every rank calls it with the same list).
    Costs one forward per block, plus one per block chosen after the first; all blocks when none suffices."""
    def size(gap: float) -> float:
        return abs(gap) if math.isfinite(gap) else math.inf

    alone = {b: size(gap_without([b])) for b in blocks}
    chosen: list[str] = []
    for b in sorted(blocks, key=lambda b: (alone[b], blocks.index(b))):
        chosen.append(b)
        gap = alone[b] if len(chosen) == 1 else size(gap_without(chosen))
        if gap <= threshold:
            break
    return chosen


def tensors_finite(state: Any) -> bool:
    """Whether every floating-point tensor in ``state`` (nested dicts, lists and tuples) is free of NaN and Inf.

    One read per tensor on its own device (its min and max, which NaN and Inf propagate to: on a CPU ~20x faster
    than ``isfinite(t).all()``, which writes a mask), and one host sync per device, not one per tensor."""
    extremes: dict[torch.device, list[torch.Tensor]] = {}
    todo = [state]
    while todo:
        node = todo.pop()
        if isinstance(node, torch.Tensor):
            if node.is_floating_point() and node.numel():
                t = node if node.dtype in _FLOAT_DTYPES else node.float()  # FP8 has no min/max kernels
                extremes.setdefault(t.device, []).extend(x.float() for x in torch.aminmax(t))
        elif isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return all(bool(torch.isfinite(torch.stack(e)).all()) for e in extremes.values())
