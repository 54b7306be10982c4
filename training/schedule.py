"""Training schedules as stages measured in steps or in tokens seen: LR, global batch, MTP weight, bias speed.

A config states each scheduled quantity as a list of stages (``[[schedule.lr]]``, ``[[schedule.global_batch]]``,
``[[schedule.mtp_lambda]]``, ``[[schedule.bias_update_speed]]``); this module turns such lists into ``Curve``s
and evaluates them. A stage is a table:

- ``shape``: ``"constant"`` (default), ``"linear"`` or ``"cosine"`` (half a cosine from ``from`` to ``value``);
- ``value``: the value at the stage's end (a constant stage's value throughout);
- ``from``: a ramp's start value (default: the previous stage's ``value``);
- its end, one of ``steps`` / ``tokens`` (the stage's length) or ``until_steps`` / ``until_tokens`` (where it
  ends, counted from the start of training). Only the last stage may have none: it lasts to the end of the run.
  A quantity holds its last value after the last stage has ended.

Step ``s`` uses the values at the point it starts from: ``s`` steps done and the tokens seen before it. So a
schedule defined by tokens holds under a batch ramp (the V3 report states its schedules by tokens), and a
resumed run that restores its step and tokens seen continues the schedule exactly. A ramp measured in one unit
needs its start in that unit: a stage measured in tokens cannot follow one that ends after a number of steps
unless it is constant (its start in tokens depends on the batch history), and vice versa.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SHAPES = ("constant", "linear", "cosine")
LENGTHS = {"steps": "steps", "tokens": "tokens", "until_steps": "steps", "until_tokens": "tokens"}
STAGE_KEYS = ("shape", "value", "from", *LENGTHS)


@dataclass(frozen=True)
class Stage:
    """One stage of a curve: ``shape`` from ``start`` to ``value`` over [``begin``, ``end``) in ``unit``."""

    shape: str
    value: float
    start: float
    unit: str | None  # "steps" | "tokens" | None (the open last stage)
    begin: float | None  # where the stage starts in ``unit`` (None: unknown, only for constant stages)
    end: float  # where it ends in ``unit`` (inf for the open last stage)

    def at(self, position: float) -> float:
        if self.shape == "constant":
            return self.value
        p = min(1.0, max(0.0, (position - self.begin) / (self.end - self.begin)))
        if self.shape == "linear":
            return self.start + (self.value - self.start) * p
        return self.value + (self.start - self.value) * 0.5 * (1.0 + math.cos(math.pi * p))


@dataclass(frozen=True)
class Curve:
    """A scheduled quantity: its stages in order; ``at(steps, tokens)`` is the value of the first stage not ended."""

    name: str
    stages: tuple[Stage, ...]

    def at(self, steps: int, tokens: int) -> float:
        for stage in self.stages:
            position = steps if stage.unit == "steps" else tokens
            if stage.unit is None or position < stage.end:
                return stage.at(position)
        return self.stages[-1].value

    def values(self) -> list[float]:
        """Every value a stage starts or ends at (the curve's range lies between their min and max)."""
        return [v for s in self.stages for v in (s.start, s.value)]

    @property
    def by_steps_only(self) -> bool:
        """True when the curve depends on the step alone (no stage ends by tokens)."""
        return all(s.unit != "tokens" for s in self.stages)


def _number(key: str, value: Any, *, positive: bool = False, integral: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")
    if integral and float(value) != int(value):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    return float(value)


def parse_curve(key: str, rows: list[dict[str, Any]], minimum: float = 0.0, maximum: float = math.inf) -> Curve:
    """The ``Curve`` of the stage tables ``rows`` (config key ``key``, e.g. ``schedule.lr``); a ValueError naming
    ``key[i]`` and what was expected for any bad stage. Every value must lie in [``minimum``, ``maximum``]."""
    if not rows:
        raise ValueError(f"{key}: expected at least one stage")
    stages: list[Stage] = []
    known = {"steps": 0.0, "tokens": 0.0}  # where the next stage starts, in each unit (None: not known)
    previous: float | None = None
    for i, row in enumerate(rows):
        where = f"{key}[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a table (a [[{key}]] stage), got {row!r}")
        unknown = sorted(set(row) - set(STAGE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; a stage takes {', '.join(STAGE_KEYS)}")
        shape = row.get("shape", "constant")
        if shape not in SHAPES:
            raise ValueError(f"{where}.shape must be one of {', '.join(SHAPES)}, got {shape!r}")
        if "value" not in row:
            raise ValueError(f"{where}: missing 'value' (the value at the stage's end)")
        value = _number(f"{where}.value", row["value"])
        if shape == "constant" and "from" in row:
            raise ValueError(f"{where}: a constant stage takes no 'from' (use shape = \"linear\" or \"cosine\")")
        if "from" in row:
            start = _number(f"{where}.from", row["from"])
        elif shape == "constant":
            start = value
        elif previous is None:
            raise ValueError(f"{where}: the first stage is a {shape} ramp: give its start value 'from'")
        else:
            start = previous
        for name, v in (("value", value), ("from", start)):
            if not minimum <= v <= maximum:
                raise ValueError(f"{where}.{name} must be in [{minimum:g}, {maximum:g}], got {v:g}")
        bounds = [k for k in LENGTHS if k in row]
        if len(bounds) > 1:
            raise ValueError(f"{where}: give one of steps, tokens, until_steps, until_tokens, got {', '.join(bounds)}")
        if not bounds:
            if i != len(rows) - 1:
                raise ValueError(f"{where}: only the last stage may omit its end (steps, tokens, until_steps or "
                                 "until_tokens)")
            if shape != "constant":
                raise ValueError(f"{where}: a {shape} ramp needs an end (steps, tokens, until_steps or until_tokens)")
            stages.append(Stage(shape, value, start, None, None, math.inf))
            break
        bound = bounds[0]
        unit = LENGTHS[bound]
        amount = _number(f"{where}.{bound}", row[bound], positive=True, integral=True)
        begin = known[unit]
        if bound in ("steps", "tokens") or shape != "constant":
            if begin is None:
                other = "tokens" if unit == "steps" else "steps"
                raise ValueError(f"{where}: a stage measured in {unit} ({bound}) follows a stage that ends after a "
                                 f"number of {other}, so its start in {unit} is not known; end the previous stage "
                                 f"by {unit} (until_{unit}) or make this one constant with until_{unit}")
        end = begin + amount if bound in ("steps", "tokens") else amount
        if begin is not None and end <= begin:
            raise ValueError(f"{where}.{bound}={amount:g} must lie after the stage's start ({unit} {begin:g})")
        stages.append(Stage(shape, value, start, unit, begin, end))
        known = {"steps": None, "tokens": None}
        known[unit] = end
        previous = value
    return Curve(key, tuple(stages))


@dataclass(frozen=True)
class Point:
    """The scheduled values of one step (it starts after ``step`` steps and ``tokens`` tokens)."""

    step: int
    tokens: int
    lr: float
    global_batch: int
    mtp_lambda: float
    bias_update_speed: float

    def as_row(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "lr": self.lr, "global_batch": self.global_batch,
                "mtp_lambda": self.mtp_lambda, "bias_update_speed": self.bias_update_speed}


@dataclass(frozen=True)
class Schedule:
    """The four curves of a run plus what turns the batch curve into batches the pipeline can run: a step's
    global batch is the curve's value rounded down to a multiple of ``batch_multiple`` (data-parallel ranks x
    micro-batch, x 2 for DualPipe's even micro-batch count), and at least ``min_batch``."""

    lr: Curve
    global_batch: Curve
    mtp_lambda: Curve
    bias_update_speed: Curve
    seq_len: int
    batch_multiple: int
    min_batch: int

    def batch(self, step: int, tokens: int) -> int:
        raw = self.global_batch.at(step, tokens)
        return max(self.min_batch, int(raw + 1e-9) // self.batch_multiple * self.batch_multiple)

    def at(self, step: int, tokens: int) -> Point:
        """The values of step ``step`` when ``tokens`` tokens were seen before it."""
        return Point(step, tokens, self.lr.at(step, tokens), self.batch(step, tokens), self.mtp_lambda.at(step, tokens),
                     self.bias_update_speed.at(step, tokens))

    def walk(self, step: int = 0, tokens: int = 0) -> Iterator[Point]:
        """Each step's point from (``step``, ``tokens``) on, tokens advancing by each step's batch x seq_len."""
        while True:
            point = self.at(step, tokens)
            yield point
            step, tokens = step + 1, tokens + point.global_batch * self.seq_len

    def batch_at(self, step: int) -> int:
        """The global batch of step ``step`` in a run that followed this schedule from step 0."""
        if self.global_batch.by_steps_only:
            return self.batch(step, 0)
        tokens = 0
        for s in range(step):
            tokens += self.batch(s, tokens) * self.seq_len
        return self.batch(step, tokens)

    def batch_sizes(self) -> list[int]:
        """The smallest and largest global batch any step can have (every batch in between is a multiple of
        ``batch_multiple``)."""
        values = self.global_batch.values()
        return sorted({max(self.min_batch, int(v + 1e-9) // self.batch_multiple * self.batch_multiple)
                       for v in (min(values), max(values))})

    def rows(self, steps: int, every: int = 1000) -> list[dict[str, Any]]:
        """The schedule of a ``steps``-step run as rows: step 0, every step where a value changes, at least one row
        every ``every`` steps, and the last step."""
        out: list[dict[str, Any]] = []
        last: Point | None = None
        for point in self.walk():
            if point.step >= steps:
                break
            changed = last is None or (point.lr, point.global_batch, point.mtp_lambda, point.bias_update_speed) != (
                last.lr, last.global_batch, last.mtp_lambda, last.bias_update_speed)
            if changed or point.step - out[-1]["step"] >= every or point.step == steps - 1:
                out.append(point.as_row())
            last = point
        return out
