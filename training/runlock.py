"""One job per run folder: an exclusive ``fcntl.flock`` on ``RUN/.lock`` held for the life of the job.

Two launches on one ``--run-dir`` would interleave their checkpoints, sweep each other's staging
folders mid-save and write every step twice to ``metrics.jsonl``. Rank 0 of a run (or the ``--nproc``
launcher, for its workers) takes the lock before it writes anything into the folder; a second launch
fails at once with :class:`RunFolderLocked`, whose one-line message names the holder.

- The kernel releases a flock when its holder dies, so a held flock means a live job on this host, and
  ``kill -9`` never leaves a lock that blocks the next launch.
- Beside the lock, ``RUN/.lock.holder`` records host, pid, start time and a heartbeat that a daemon thread
  refreshes every ``HEARTBEAT_S`` seconds (one small atomic file write). It names the holder in the error,
  and it is what protects a run folder on a shared filesystem where flock does not reach across hosts:
  a record from another host is honoured as a lock; once its heartbeat is older than ``STALE_AFTER_S``
  it is reported as possibly stale, and only ``break_lock`` (``--break-lock``) takes it over, never
  silently. A record left by a dead process of this host (flock free) is taken over with one line.
- Where the filesystem has no flock at all (``ENOSYS``/``ENOLCK``, e.g. Lustre without ``-o flock``), it
  says so in one line and the record alone is the lock (a live pid of this host is then refused too).
- Under ``--nproc`` the launcher holds the lock for its torchrun workers; their rank 0 stops within
  ``WATCH_LAUNCHER_S`` when the launcher is killed, so that a freed lock never hides a job still writing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK_FILE = ".lock"
HOLDER_FILE = ".lock.holder"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
WATCH_LAUNCHER_S = 2.0  # how often a --nproc worker checks that its launcher (the lock's holder) is alive
# Set by the ``--nproc`` launcher for its torchrun workers: "<lock path>:<launcher pid>" (the launcher holds it).
LAUNCHER_ENV = "DSV3_RUN_LOCK"

_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_HELD: dict[str, RunLock] = {}  # lock path -> the lock this process holds


@dataclass
class Holder:
    """Who holds (or last held) a run folder's lock."""

    host: str
    pid: int
    started: float  # epoch seconds
    heartbeat: float  # epoch seconds of the last refresh

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host} since {since}"

    def this_host(self) -> bool:
        return self.host == socket.gethostname()


class RunFolderLocked(Exception):
    """Another job holds the run folder (exit status ``accel.cli.LOCKED``); the message is one line."""

    def __init__(self, message: str, holder: Holder | None = None) -> None:
        super().__init__(message)
        self.holder = holder


def lock_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOCK_FILE


def read_holder(run_dir: str | os.PathLike) -> Holder | None:
    """The holder record of ``run_dir`` (None when there is none or it is unreadable)."""
    try:
        raw = json.loads((Path(run_dir) / HOLDER_FILE).read_text())
        return Holder(host=str(raw["host"]), pid=int(raw["pid"]), started=float(raw["started"]),
                      heartbeat=float(raw["heartbeat"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _key(run_dir: str | os.PathLike) -> str:
    return str(lock_path(Path(run_dir).resolve()))


def owns(run_dir: str | os.PathLike) -> bool:
    """Whether this job owns ``run_dir``: this process holds its lock, or the ``--nproc`` launcher that
    started this process does (it says so in ``DSV3_RUN_LOCK``, naming the lock and its own pid)."""
    key = _key(run_dir)
    if key in _HELD:
        return True
    path, _, pid = os.environ.get(LAUNCHER_ENV, "").rpartition(":")
    return bool(path) and path == key and pid.isdigit() and int(pid) == os.getppid()


def launcher_env(lock: RunLock) -> dict[str, str]:
    """What the launcher puts in its workers' environment: the lock is held for them (``follow_launcher``)."""
    return {LAUNCHER_ENV: f"{_key(lock.run_dir)}:{os.getpid()}"}


class RunLock:
    """The exclusive lock of one run folder; ``acquire`` raises :class:`RunFolderLocked` when it is taken.

    Use as a context manager, or ``acquire()`` ... ``release()`` in a ``finally``."""

    def __init__(self, run_dir: str | os.PathLike, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.run_dir = Path(run_dir)
        self.path = lock_path(self.run_dir)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._fd: int | None = None
        self._flock = True  # False where the filesystem has no flock: the holder record alone is the lock
        self._record: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ public
    def acquire(self, *, break_lock: bool = False, announce: Callable[[str], None] = print) -> RunLock:
        """Take the lock (creating the folder); ``announce`` gets the one line of a take-over."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ValueError(f"run folder {self.run_dir}: cannot create its lock {self.path}: "
                             f"{exc.strerror or exc}") from None
        self._flock = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_FLOCK:  # e.g. Lustre mounted without flock: the holder record is the lock
                self._flock = False
                announce(f"run folder {self.run_dir}: this filesystem does not support flock ({exc.strerror}); "
                         "relying on the holder record alone")
            else:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                self._refuse_held()
        try:
            self._check_record(break_lock, announce)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        now = time.time()
        self._record = Holder(host=socket.gethostname(), pid=os.getpid(), started=now, heartbeat=now)
        self._write_record()
        _HELD[_key(self.run_dir)] = self
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _refuse_held(self) -> None:
        """The flock is held by another job: name it."""
        holder = read_holder(self.run_dir)
        if holder is not None and holder.this_host() and not _pid_alive(holder.pid):
            holder = None  # a dead holder's record: the new holder has not replaced it yet
        who = holder.describe() if holder is not None else "another process (its holder record is not written yet)"
        raise RunFolderLocked(f"run folder {self.run_dir} is in use by {who} (lock {self.path}); "
                              "wait for it or choose another --run-dir", holder)

    def release(self) -> None:
        """Stop the heartbeat, remove the holder record, drop the lock (idempotent)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        mine = read_holder(self.run_dir)
        if mine is not None and mine.pid == os.getpid() and mine.this_host():
            try:
                (self.run_dir / HOLDER_FILE).unlink()
            except FileNotFoundError:
                pass
        _HELD.pop(_key(self.run_dir), None)
        if self._flock:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------------------------------ internals
    def _check_record(self, break_lock: bool, announce: Callable[[str], None]) -> None:
        """We hold the flock: decide about a record left in the folder by another process."""
        old = read_holder(self.run_dir)
        if old is None or (old.this_host() and old.pid == os.getpid()):
            return
        if old.this_host() and not self._flock and _pid_alive(old.pid):
            raise RunFolderLocked(f"run folder {self.run_dir} is in use by {old.describe()} (lock {self.path}); "
                                  "wait for it or choose another --run-dir", old)
        if old.this_host():
            state = "that process is gone" if not _pid_alive(old.pid) else "that process no longer holds it"
            announce(f"run folder {self.run_dir}: taking over the lock left by {old.describe()} ({state})")
            return
        # another host: flock may not reach across hosts on this filesystem, so its record is the lock
        age = time.time() - old.heartbeat
        if break_lock:
            announce(f"run folder {self.run_dir}: --break-lock: taking over the lock of {old.describe()} "
                     f"(last heartbeat {age / 60:.1f} min ago)")
            return
        if age > self.stale_after_s:
            raise RunFolderLocked(
                f"run folder {self.run_dir} is held by {old.describe()}, whose last heartbeat was {age / 60:.0f} min "
                f"ago: possibly stale (lock {self.path}); if that job is gone relaunch with --break-lock to take it "
                "over, else wait for it or choose another --run-dir", old)
        raise RunFolderLocked(f"run folder {self.run_dir} is in use by {old.describe()} (lock {self.path}; last "
                              f"heartbeat {age:.0f} s ago); wait for it or choose another --run-dir", old)

    def _write_record(self) -> None:
        assert self._record is not None
        target = self.run_dir / HOLDER_FILE
        tmp = target.with_name(f"{HOLDER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self._record)))
        os.replace(tmp, target)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            assert self._record is not None
            self._record.heartbeat = time.time()
            try:
                self._write_record()
            except OSError:  # a full or flaky disk must not kill the job; the next beat retries
                pass


def take(run_dir: str | os.PathLike, *, break_lock: bool = False,
         announce: Callable[[str], None] = print) -> RunLock | None:
    """The lock of ``run_dir`` for this job: acquired here, or None when this process or the ``--nproc``
    launcher that started it already holds it (``owns``). Raises :class:`RunFolderLocked` when another job
    holds it."""
    if _key(run_dir) in _HELD or follow_launcher(run_dir, announce):
        return None
    return RunLock(run_dir).acquire(break_lock=break_lock, announce=announce)


def follow_launcher(run_dir: str | os.PathLike, announce: Callable[[str], None] = print) -> bool:
    """For a worker of the ``--nproc`` launcher that holds ``run_dir``'s lock (every rank calls it): True, and
    this process stops within ``WATCH_LAUNCHER_S`` once that launcher is gone (``kill -9``: the kernel freed the
    lock, and torchrun's workers, each in a session of its own, would otherwise go on writing unlocked).
    RunFolderLocked when the launcher is already gone; False for any other process."""
    path, _, pid = os.environ.get(LAUNCHER_ENV, "").rpartition(":")
    if path != _key(run_dir) or not pid.isdigit():
        return False
    if int(pid) != os.getppid():
        raise RunFolderLocked(f"run folder {run_dir}: the --nproc launcher (pid {pid}) that holds its lock for "
                              "this worker is gone; not starting")
    _watch_launcher(int(pid), Path(run_dir), announce)
    return True


def _watch_launcher(pid: int, run_dir: Path, announce: Callable[[str], None]) -> None:
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(WATCH_LAUNCHER_S)
        announce(f"run folder {run_dir}: the --nproc launcher (pid {pid}) that held its lock is gone; "
                 "stopping so that the folder is free for the next launch")
        os._exit(1)  # accel.cli.FAILED (not imported: this module stays stdlib-only)

    threading.Thread(target=watch, name="run-lock-launcher-watch", daemon=True).start()
