"""Run untrusted code (a kernel candidate) in a child process whose exit, crash or hang cannot fake a result.

The parent (``run``) starts the child in its own session (so its process group holds everything the child
spawns), waits at most ``timeout`` seconds, then kills that whole group with SIGKILL (no grace period: a
child that ignores SIGTERM dies all the same). Whatever happened, every process left in the group is killed
once the child is gone. The child dies with the parent (``die_with_parent``), SIGKILL of the parent included.

The result does not come from the child's exit status or its stdout. The harness in the child (``Reporter``)
sends JSON messages over a result channel the parent opened: an unlinked temporary file, passed as an
inherited descriptor. The descriptor number, a random token and the parent's pid reach the child on its stdin, which the
harness reads (and replaces by /dev/null) before it imports anything of the candidate's; neither appears in
argv or the environment, and the descriptor is not inherited by processes the candidate starts. Every
message carries the token and the harness's pid; the parent accepts only messages with both right, and
reads the channel only after the child and its group are gone. So a child that exits (``sys.exit(0)``,
``os._exit(0)``), crashes, is killed or hangs before the harness sends its final message leaves no result,
and printing a fake verdict on stdout or into the descriptor is ignored or flagged as forged.

Limits, stated plainly: the candidate runs in the same Python process as the harness, so a deliberately
malicious candidate can read the token from the harness's memory (or stdin's buffer) and forge a result,
or patch the harness; the in-process integrity checks of ``verifier.candidate`` catch the common patches, not
all. A process that leaves the group (``setsid``, a double fork into a new session) escapes the kill. What
is guaranteed: exits, crashes, kills and hangs are failures, never a pass, and the parent always returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

MAX_RESULT_BYTES = 64 << 20  # a channel bigger than this is not the harness's
LOG_TAIL_LINES = 20


@dataclass
class Outcome:
    """What the parent observed: the harness's authenticated messages, how the child ended, its output tail."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None  # None when it timed out
    timed_out: bool = False
    timeout: float = 0.0
    forged: int = 0  # lines in the result channel the harness did not write
    log: list[str] = field(default_factory=list)  # last lines of the child's stdout + stderr
    seconds: float = 0.0

    @property
    def final(self) -> dict[str, Any] | None:
        """The harness's final message, when it sent one (``Reporter.finish``)."""
        return next((m for m in reversed(self.messages) if m.get("final")), None)

    def how_it_ended(self) -> str:
        """One phrase: ``timed out after 60 s``, ``killed by signal 11 (SIGSEGV)``, ``exited with status 0``."""
        if self.timed_out:
            return f"timed out after {self.timeout:g} s"
        code = self.returncode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {-code} ({name})"
        return f"exited with status {code}"


def _result_channel() -> tuple[int, int]:
    """(read fd, write-only append fd) on a fresh temporary file that no longer has a name."""
    folder = tempfile.mkdtemp(prefix="dsv3-sandbox-")
    path = os.path.join(folder, secrets.token_hex(8))
    try:
        write_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        read_fd = os.open(path, os.O_RDONLY)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.rmdir(folder)
    return read_fd, write_fd


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _group_dies_with_us(pgid: int) -> Iterator[None]:
    """While the parent waits, SIGTERM to the parent kills the child's group first (it has its own session,
    so neither a terminal's Ctrl-C nor a scheduler's signal to the parent reaches it); then the usual SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        _kill_group(pgid)
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _read_channel(fd: int) -> bytes:
    chunks, size = [], 0
    while size <= MAX_RESULT_BYTES:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _authentic(raw: bytes, token: str, pid: int) -> tuple[list[dict[str, Any]], int]:
    """(messages carrying ``token`` and ``pid``, count of other non-empty lines)."""
    messages, forged = [], 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            forged += 1
            continue
        if (isinstance(msg, dict) and isinstance(msg.get("token"), str)
                and hmac.compare_digest(msg["token"], token) and msg.get("pid") == pid):
            messages.append({k: v for k, v in msg.items() if k not in ("token", "pid")})
        else:
            forged += 1
    return messages, forged


def _tail(log_file: Any) -> list[str]:
    log_file.seek(0, os.SEEK_END)
    log_file.seek(max(0, log_file.tell() - 64_000))
    lines = log_file.read().decode(errors="replace").splitlines()
    return [line for line in lines if line.strip()][-LOG_TAIL_LINES:]


def run(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None) -> Outcome:
    """Run ``argv`` (a program whose harness uses ``Reporter``) as described in the module docstring."""
    token = secrets.token_hex(16)
    read_fd, write_fd = _result_channel()
    start = time.perf_counter()
    outcome = Outcome(timeout=timeout)
    try:
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                    pass_fds=(write_fd,), start_new_session=True, env=dict(env) if env else None,
                                    cwd=cwd)
            child_fd, write_fd = write_fd, -1  # pass_fds keeps the number in the child
            os.close(child_fd)
            try:
                with _group_dies_with_us(proc.pid):
                    with contextlib.suppress(OSError):  # the child may be gone already
                        proc.stdin.write(f"{child_fd} {token} {os.getpid()}\n".encode())
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
                    try:
                        outcome.returncode = proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        outcome.timed_out = True
                        _kill_group(proc.pid)
                        proc.wait()
            finally:
                _kill_group(proc.pid)  # anything the child left behind in its group
                if proc.poll() is None:
                    proc.wait()
            outcome.seconds = time.perf_counter() - start
            outcome.log = _tail(log)
        outcome.messages, outcome.forged = _authentic(_read_channel(read_fd), token, proc.pid)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    return outcome


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_PARENT_S = 0.5  # the watchdog's poll where the kernel cannot signal a parent's death


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the verifier that started it) exits, however it exits: SIGKILL included,
    which the parent cannot forward (``timeout=`` in ``subprocess.run``, a CI time limit, a generation harness).
    The child has a session of its own, so nothing else would stop a candidate that loops forever.

    On Linux the kernel sends SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``), which works while the
    candidate holds the interpreter in C code; elsewhere a daemon thread polls the parent's pid, as the
    ``--nproc`` launcher's workers do (``training.runlock``), and kills this process group. Either way a parent
    already gone when this runs ends the child at once."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the request took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_PARENT_S)
        _kill_group(os.getpgid(0))
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="sandbox-parent-watch", daemon=True).start()


class Reporter:
    """The child's end: reads its channel and token from stdin, then sends messages the parent can trust."""

    def __init__(self, fd: int, token: str) -> None:
        self.fd, self.token = fd, token

    @classmethod
    def from_stdin(cls) -> Reporter:
        """Call first thing in the child, before any untrusted code is imported."""
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(0, 256)
            if not chunk:
                break
            line += chunk
        try:
            fd_text, token, parent_text = line.decode().split()
            fd, parent = int(fd_text), int(parent_text)
            os.fstat(fd)
        except (ValueError, OSError):
            raise SystemExit("error: no result channel on stdin (this mode is started by the sandbox only)") from None
        die_with_parent(parent)
        os.set_inheritable(fd, False)  # processes the candidate starts do not get it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return cls(fd, token)

    def send(self, **message: Any) -> None:
        # os.getpid() now, not at construction: a forked copy of the harness is not the child the parent started
        data = (json.dumps({**message, "token": self.token, "pid": os.getpid()}) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def finish(self, status: int, **message: Any) -> NoReturn:
        """Send the final message and end the process at once with ``status`` (no atexit handlers, no waiting
        for threads the candidate left running)."""
        self.send(final=True, status=status, **message)
        os.close(self.fd)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
