"""A flight recorder: each rank's last pipeline actions and collectives, dumped when the run hangs.

At PP x EP scale a hang is one rank that never joins an all-to-all or a P2P transfer; every other rank
then times out naming only itself. Like PyTorch's NCCL flight recorder, but for our backend-agnostic
runtime (gloo, NCCL, MCCL), each rank keeps a ring buffer of its last ``capacity`` operations:

- ``action``: a schedule action of ``dualpipe.runtime`` (``1F5``, ``3B2``, ``(0F7;3B1)OVERLAP_F_B``);
- ``send`` / ``recv``: a pipeline P2P message (``act stage 1 mb 5``) with its peer (global rank);
- ``all_to_all``: an expert-parallel exchange (``dispatch``, ``combine``, ``backward all-to-all``) of one
  MoE layer, with its group (label and global ranks) and ``coll_seq``, the exchange's number on that
  group on this rank (the n-th collective of a group is the same collective on every member);
- ``all_reduce``: a trainer collective (gradient reduction, gradient norm, loss mean).

Each entry has the step, the action it ran in, the bytes this rank sends, and wall-clock times:
``start``; ``posted`` with ``parts`` (how many of its collectives this rank has handed to the backend:
an exchange that is started but not posted is stuck on this rank); ``wait`` (when a thread began to
block on it); ``end`` (None while in flight); ``error``. Recording is host bookkeeping only (no tensor is
read, no device is synchronised), about a microsecond an entry (``measure_entry_cost``), so it is always on.

Dumps (``RUN_DIR/flight/rank_<r>.json``, written atomically) are taken when a recorded operation fails
(a timeout: the dump is written before the exception leaves the operation), on SIGUSR1, and by
``FlightWatchdog`` when no entry has completed for ``run.watchdog_s`` seconds (once per stall).
``python -m recipes.diagnose RUN_DIR`` reads them and names the rank that stopped first.

Test hook (fault injection, never set in production): ``DSV3_STALL="rank=1,kind=all_to_all,name=dispatch,
layer=2,step=1,seconds=30"`` makes the first matching operation of that rank sleep ``seconds`` (default
3600) inside the operation, after it is recorded and before it is posted, and then fail with
``InjectedStall`` (so the rank ends by itself, with the state it stalled in). Keys other than ``rank`` and
``seconds`` match the entry's fields (``kind``, ``name``, ``step``, ``stage``, ``mb``, ``layer``, ``peer``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

FORMAT = "dsv3-flight/1"
ENV_STALL = "DSV3_STALL"
DEFAULT_CAPACITY = 256
KINDS = ("action", "send", "recv", "all_to_all", "all_reduce", "barrier")
COLLECTIVES = ("all_to_all", "all_reduce", "barrier")
_STALL_KEYS = ("kind", "name", "step", "stage", "mb", "layer", "peer")


class InjectedStall(RuntimeError):
    """The end of a ``DSV3_STALL`` test-hook stall: the stalled operation fails, as a timeout would."""


class Entry:
    """One recorded operation (mutable: the recording threads fill in its times)."""

    __slots__ = ("seq", "kind", "name", "step", "stage", "mb", "context", "peer", "group", "ranks", "coll_seq",
                 "layer", "nbytes", "start", "posted", "parts", "wait", "end", "error")

    def __init__(self, kind: str, name: str, step: int | None, stage: int | None, mb: int | None,
                 context: str | None, peer: int | None, group: str | None, ranks: list[int] | None,
                 layer: int | None, nbytes: int, start: float, posted: float | None, wait: float | None) -> None:
        self.kind, self.name, self.step, self.stage, self.mb, self.context = kind, name, step, stage, mb, context
        self.peer, self.group, self.ranks, self.layer, self.nbytes = peer, group, ranks, layer, nbytes
        self.start, self.posted, self.parts, self.wait = start, posted, 0 if posted is None else 1, wait
        self.seq = self.coll_seq = self.end = self.error = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def flight_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` of the run in ``run_dir`` dumps its recorder."""
    return Path(run_dir) / "flight" / f"rank_{rank}.json"


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the world), as the entries of its collectives record them."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def parse_stall(spec: str | None) -> dict[str, str] | None:
    """The ``DSV3_STALL`` test hook's ``key=value`` list; ValueError naming the variable on a bad one."""
    if not spec:
        return None
    out: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("rank", "seconds", *_STALL_KEYS):
            raise ValueError(f"{ENV_STALL}={spec!r}: expected comma-separated key=value with keys rank, seconds, "
                             f"{', '.join(_STALL_KEYS)}; got {part!r}")
        out[key] = value.strip()
    if "rank" not in out:
        raise ValueError(f"{ENV_STALL}={spec!r}: needs rank=<global rank>")
    try:
        int(out["rank"]), float(out.get("seconds", "0"))
    except ValueError:
        raise ValueError(f"{ENV_STALL}={spec!r}: rank must be an integer and seconds a number") from None
    return out


class FlightRecorder:
    """The last ``capacity`` operations of one rank; thread-safe (the EP comm thread records too).

    ``step`` (set by the trainer) and ``action`` (set by the pipeline runtime while an action runs) are
    copied into each new entry. ``path``: where ``dump`` writes (None: dumps are skipped).
    """

    def __init__(self, rank: int, path: str | os.PathLike | None = None, capacity: int = DEFAULT_CAPACITY,
                 world_size: int = 1, stall: str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"FlightRecorder: capacity must be >= 1, got {capacity}")
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.path = Path(path) if path is not None else None
        self.step: int | None = None
        self.action: str | None = None
        self.created = self.last_progress = time.time()  # last_progress: when an entry last completed
        self.dumps = 0
        self.history: list[tuple[float, str]] = []  # (time, reason) of every dump so far (each dump lists them)
        self.dumped_progress: float | None = None  # last_progress at the latest dump (the watchdog's once-per-stall)
        self._entries: deque[Entry] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._dump_lock = threading.Lock()
        self._seq = 0
        self._coll_seq: dict[tuple[str, tuple[int, ...]], int] = {}
        self._failed: int | None = None  # id of the exception already dumped (nested operations see it again)
        stall_spec = parse_stall(os.environ.get(ENV_STALL) if stall is None else stall)
        self._stall = stall_spec if stall_spec is not None and int(stall_spec["rank"]) == rank else None

    # -- recording ------------------------------------------------------------------------------------
    def begin(self, kind: str, name: str, *, stage: int | None = None, mb: int | None = None,
              context: str | None = None, peer: int | None = None, group: str | None = None,
              ranks: tuple[int, ...] | None = None, layer: int | None = None, nbytes: int = 0,
              blocking: bool = True, posted: bool = False, sequence: bool = True) -> Entry:
        """Record the start of an operation. ``blocking``: the caller waits on it from now on; ``posted``: it
        is handed to the backend at once; ``sequence=False``: a collective whose number on its group is given
        later by ``sequence`` (when it is actually issued: the EP comm thread's turn)."""
        now = time.time()
        if context is None and kind != "action":
            context = self.action
        e = Entry(kind, name, self.step, stage, mb, context, peer, group, None if ranks is None else list(ranks),
                  layer, nbytes, now, now if posted else None, now if blocking else None)
        with self._lock:
            self._seq += 1
            e.seq = self._seq
            if group is not None and sequence:
                e.coll_seq = self._next_coll(e)
            self._entries.append(e)
        if self._stall is not None and sequence:
            self._maybe_stall(e)
        return e

    def sequence(self, e: Entry) -> None:
        """Give ``e`` its number on its group now (it is being issued)."""
        with self._lock:
            e.coll_seq = self._next_coll(e)
        if self._stall is not None:
            self._maybe_stall(e)

    def _next_coll(self, e: Entry) -> int:
        key = (e.group, tuple(e.ranks or ()))
        n = self._coll_seq.get(key, 0) + 1
        self._coll_seq[key] = n
        return n

    def posted(self, e: Entry) -> None:
        """One more of ``e``'s collectives is handed to the backend."""
        e.parts += 1
        if e.posted is None:
            e.posted = time.time()

    def waiting(self, e: Entry) -> None:
        """A thread now blocks on ``e``."""
        if e.wait is None:
            e.wait = time.time()

    def end(self, e: Entry) -> None:
        e.end = self.last_progress = time.time()

    def fail(self, e: Entry, exc: BaseException) -> None:
        """``e`` raised: note the error and dump (once per exception: enclosing operations see it too); the
        entry stays in flight in the dump, as it was when the rank gave up."""
        e.error = f"{type(exc).__name__}: {exc}"[:2000]
        if isinstance(exc, Exception) and self._failed != id(exc) and not self._already_dumped(exc):
            self._failed = id(exc)
            self.dump(f"{e.kind} {e.name!r} failed: {e.error.splitlines()[0][:300]}")

    def _already_dumped(self, exc: BaseException) -> bool:
        cause = exc.__cause__ or exc.__context__
        for _ in range(64):  # a chain, not trusted to be acyclic
            if cause is None:
                return False
            if id(cause) == self._failed:
                return True
            cause = cause.__cause__ or cause.__context__
        return False

    def record(self, kind: str, name: str, **fields: Any) -> _Recording:
        """A context manager: ``begin`` on entry, then ``end`` when the block finishes, or ``fail`` (and the
        exception goes on) when it raises."""
        return _Recording(self, kind, name, fields)

    def _maybe_stall(self, e: Entry) -> None:
        spec = self._stall
        if any(str(getattr(e, k)) != v for k, v in spec.items() if k in _STALL_KEYS):
            return
        self._stall = None  # once
        seconds = float(spec.get("seconds", 3600))
        print(f"rank {self.rank}: {ENV_STALL} test hook: stalling {seconds:g} s in {e.kind} {e.name!r} "
              f"(step {e.step})", file=sys.stderr, flush=True)
        time.sleep(seconds)
        exc = InjectedStall(f"rank {self.rank}: {ENV_STALL} test hook: stalled {seconds:g} s in {e.kind} {e.name!r}")
        self.fail(e, exc)  # raised from begin(): no enclosing record() sees it
        raise exc

    # -- dumping --------------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    def snapshot(self, reason: str) -> dict[str, Any]:
        """What a dump holds: this rank's identity, why and when, and its entries (oldest first)."""
        with self._lock:
            entries = [e.to_dict() for e in self._entries]
        return {"format": FORMAT, "rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(),
                "pid": os.getpid(), "created": self.created, "reason": reason, "time": time.time(), "step": self.step,
                "action": self.action, "last_progress": self.last_progress, "capacity": self.capacity,
                "earlier_dumps": [list(h) for h in self.history], "entries": entries}

    def dump(self, reason: str) -> Path | None:
        """Write the snapshot to ``path`` atomically (a temporary file renamed over it); one line on stderr.
        Never raises: a failed dump must not hide the error that caused it (it is reported instead)."""
        if self.path is None:
            return None
        with self._dump_lock:
            self.dumped_progress = self.last_progress
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self.snapshot(reason)))
                os.replace(tmp, self.path)
            except OSError as exc:
                print(f"rank {self.rank}: could not write the flight recorder to {self.path}: {exc}",
                      file=sys.stderr, flush=True)
                return None
            self.dumps += 1
            self.history.append((time.time(), reason))
        run_dir = self.path.parent.parent
        print(f"rank {self.rank}: flight recorder written to {self.path} ({reason}); "
              f"python -m recipes.diagnose {run_dir}", file=sys.stderr, flush=True)
        return self.path


class _Recording:
    """``FlightRecorder.record``'s context manager (a class: cheaper than a generator-based one)."""

    __slots__ = ("flight", "kind", "name", "fields", "entry")

    def __init__(self, flight: FlightRecorder, kind: str, name: str, fields: dict[str, Any]) -> None:
        self.flight, self.kind, self.name, self.fields = flight, kind, name, fields

    def __enter__(self) -> Entry:
        self.entry = self.flight.begin(self.kind, self.name, **self.fields)
        return self.entry

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.flight.end(self.entry)
        else:
            self.flight.fail(self.entry, exc)


@dataclass(frozen=True)
class FlightSite:
    """Where a family of collectives records: the recorder, the group (label and global ranks) and the
    MoE layer. Handed down the same path as ``TraceRecorder`` (expert-parallel exchanges)."""

    flight: FlightRecorder
    group: str
    ranks: tuple[int, ...]
    layer: int | None = None


@contextmanager
def recorded(flight: FlightRecorder | None, kind: str, name: str, **fields: Any) -> Iterator[Entry | None]:
    """``flight.record(...)`` when there is a recorder, else nothing."""
    if flight is None:
        yield None
        return
    with flight.record(kind, name, **fields) as e:
        yield e


def record_collective(flight: FlightRecorder | None, name: str, label: str, group: dist.ProcessGroup | None,
                      nbytes: int = 0, kind: str = "all_reduce"):
    """A blocking collective of the trainer over ``group`` (labelled ``label``), recorded when there is a recorder."""
    if flight is None:
        return recorded(None, kind, name)
    return flight.record(kind, name, group=label, ranks=group_ranks(group), nbytes=nbytes, posted=True)


class FlightWatchdog:
    """A daemon thread that dumps ``flight`` on SIGUSR1 and after ``seconds`` without a completed entry.

    The no-progress dump happens once per stall (again only after some entry has completed since). SIGUSR1
    reaches the thread through ``signal.set_wakeup_fd`` (its C handler writes the signal number to a pipe
    at once), so the dump is written even while the main thread is blocked inside a collective, where a
    Python-level handler would not run; ``start`` and ``stop`` must then be called from the main thread
    (elsewhere, or when another wakeup fd is already in use, SIGUSR1 is left alone). ``seconds = 0``: no
    no-progress dumps.
    """

    def __init__(self, flight: FlightRecorder, seconds: float, poll_s: float | None = None) -> None:
        if seconds < 0:
            raise ValueError(f"FlightWatchdog: seconds must be >= 0, got {seconds}")
        self.flight, self.seconds = flight, seconds
        self.poll_s = poll_s if poll_s is not None else (min(1.0, seconds / 4) if seconds else None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_handler: Any = None
        self._old_fd = -1

    def start(self) -> FlightWatchdog:
        self._install_signal()
        self._thread = threading.Thread(target=self._run, name=f"dsv3-flight-watchdog-{self.flight.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._pipe is not None:
            try:
                os.write(self._pipe[1], b"\0")  # wake the thread
            except OSError:  # the pipe is full: the thread is awake anyway
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._uninstall_signal()

    def _install_signal(self) -> None:
        if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return
        if self._old_fd != -1:  # someone else's wakeup pipe: leave it and SIGUSR1 alone
            signal.set_wakeup_fd(self._old_fd)
            os.close(r), os.close(w)
            return
        self._pipe = (r, w)
        # the Python-level handler does nothing: its C part writes to the pipe, which the thread reads
        self._old_handler = signal.signal(signal.SIGUSR1, lambda signum, frame: None)

    def _uninstall_signal(self) -> None:
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGUSR1, self._old_handler if self._old_handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_fd)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    def _run(self) -> None:
        flight = self.flight
        while not self._stop.is_set():
            got_signal = False
            if self._pipe is not None:
                ready, _, _ = select.select([self._pipe[0]], [], [], self.poll_s)
                if ready:
                    try:
                        got_signal = signal.SIGUSR1 in os.read(self._pipe[0], 512)
                    except (BlockingIOError, OSError):
                        pass
            else:
                self._stop.wait(self.poll_s)
            if self._stop.is_set():
                return
            if got_signal:
                flight.dump("SIGUSR1")
                continue
            idle = time.time() - flight.last_progress
            if self.seconds and idle > self.seconds and flight.dumped_progress != flight.last_progress:
                flight.dump(f"watchdog: no progress for {idle:.1f} s (run.watchdog_s={self.seconds:g})")


def measure_entry_cost(n: int = 20000) -> float:
    """CPU seconds one recorded operation costs (``record`` with its begin and end), averaged over ``n`` (CPU
    time of this thread, so a loaded machine does not count other processes' turns)."""
    flight = FlightRecorder(0, stall="")
    t0 = time.thread_time()
    for i in range(n):
        with flight.record("recv", "act stage 1 mb 0", stage=1, mb=i, peer=1, nbytes=4096):
            pass
    return (time.thread_time() - t0) / n
