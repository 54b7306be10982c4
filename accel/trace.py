"""A timeline recorder: named intervals on named tracks, written as a Chrome / Perfetto trace.

One ``TraceRecorder`` per process, created by whoever wants a trace (``recipes.train --trace FILE``)
and handed explicitly to the parts that record (the pipeline runtime records its compute actions,
the expert-parallel exchange its communication). ``chrome_trace`` merges the recorders of all
ranks into the JSON that chrome://tracing and ui.perfetto.dev open: one process per rank, one
thread (track) per kind of work. Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux,
shared by the processes of one machine).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACKS = ("compute", "comm")


@dataclass
class TraceRecorder:
    """Intervals ``(track, name, start_s, end_s)`` of one rank; thread-safe (the comm thread records too)."""

    rank: int = 0
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, track: str, name: str, start: float, end: float) -> None:
        if track not in TRACKS:
            raise ValueError(f"TraceRecorder: track must be one of {TRACKS}, got {track!r}")
        with self._lock:
            self.spans.append((track, name, start, end))

    @contextmanager
    def span(self, track: str, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(track, name, start, time.perf_counter())

    def state(self) -> dict[str, Any]:
        """Picklable contents (for gathering to one rank)."""
        with self._lock:
            return {"rank": self.rank, "spans": list(self.spans)}


def chrome_trace(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event JSON of several ranks' ``TraceRecorder.state()``: complete ("X") events
    in microseconds from the earliest start, pid = rank, tid = track."""
    t0 = min((s[2] for st in states for s in st["spans"]), default=0.0)
    events: list[dict[str, Any]] = []
    for st in states:
        rank = st["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, track in enumerate(TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for track, name, start, end in st["spans"]:
            events.append({"ph": "X", "name": name, "cat": track, "pid": rank, "tid": TRACKS.index(track),
                           "ts": (start - t0) * 1e6, "dur": max(end - start, 0.0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, states: Sequence[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(states)))
    return path
