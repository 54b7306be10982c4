"""``--nproc N``: re-launch the current command under ``torch.distributed.run`` (torchrun) on this machine.

The convenience is only for single-machine runs (CPU development, one GPU node); a cluster uses
``torchrun`` itself (``--nnodes``, ``--rdzv-endpoint``), which runs the same entry point. Torchrun's
own agent starts, watches and tears down the workers; nothing here is home-made distribution, except
passing SIGTERM / SIGINT on to the workers without a deadline (torchrun's agent would SIGKILL them 30 s
later, or after ``--shutdown-timeout`` where the installed torch has it) so they can save (``training.preempt``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from accel.cli import FAULT_STOP


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (torchrun sets these for every worker)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def strip_option(argv: Sequence[str], name: str, takes_value: bool = True) -> list[str]:
    """``argv`` without ``name`` (``--name V`` or ``--name=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == name:
            skip = takes_value
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


def relaunch(module: str, nproc: int, argv: Sequence[str], max_restarts: int = 0,
             latest_step: Callable[[], int | None] | None = None) -> int:
    """Run ``python -m module *argv`` as ``nproc`` torchrun workers on this machine; returns the exit code.

    Torchrun's agent starts, watches and reaps the workers, in a thread of this process; this (main) thread
    forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT (and SIGUSR1, the flight-recorder dump) to them (see
    ``_Forwarder``) and waits for them however long they take to save, then prints one line: the signal, how
    many workers got it, the step the run's ``latest`` checkpoint names (``latest_step``, when given) and
    their status, which it returns: 0 after a clean save, the workers' own status (e.g. 3, save failed)
    otherwise."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N workers on a few cores: no thread oversubscription
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                         f"--max-restarts={max_restarts}", "--module", module, *argv])
    outcome: dict[str, BaseException | None] = {"error": None}

    def agent() -> None:
        try:
            run(args)
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=agent, name="torchrun-agent", daemon=True)
    with _Forwarder(module) as forwarder:
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            forwarder.forward()
    status, failures = _status(outcome["error"])
    if forwarder.first is not None:
        print(forwarder.report(status, failures, latest_step() if latest_step is not None else None), flush=True)
    elif status and status != FAULT_STOP:  # after a fault stop rank 0 has printed the one line
        print(f"training failed ({failures}); see the error above", flush=True)
    return status


def _status(error: BaseException | None) -> tuple[int, str]:
    """(exit code, "rank r: exit code c; ...") of torchrun's outcome: the lowest failed rank's positive code,
    else 1 (workers killed by a signal). An error of the agent itself (not a worker's) is raised."""
    if error is None:
        return 0, ""
    if not isinstance(error, ChildFailedError):
        raise error
    failed = sorted(error.failures.items())
    codes = [f.exitcode for _, f in failed if f.exitcode > 0]
    status = FAULT_STOP if FAULT_STOP in codes else (codes[0] if codes else 1)  # the guard stopped every rank
    return status, "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in failed)


class _Forwarder:
    """While active (main thread only): SIGTERM, SIGINT, SIGHUP and SIGQUIT to this launcher are recorded by a
    handler and passed on by ``forward`` to the workers (this process's children running ``-m module``);
    SIGUSR1 is passed on as well, so that every worker dumps its flight recorder (``accel.flight``).

    Torchrun's own handling (the agent turns the signal into a ``SignalException``, forwards it, SIGKILLs the
    workers 30 s later, or after ``--shutdown-timeout`` where the torch version has it, and the launcher then
    fails with a traceback, the workers' statuses lost) is off because its agent runs in a thread, where torch
    registers no signal handlers. A signal that comes before the workers exist is held until they do. Repeated
    signals are forwarded too (the workers ignore repeats while saving).
    """

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
                    if hasattr(signal, n))
    DUMP = getattr(signal, "SIGUSR1", None)  # passed on too, but it asks for a flight-recorder dump, not a stop

    def __init__(self, module: str) -> None:
        self.module = module
        self.pending: list[int] = []
        self.first: int | None = None
        self.workers = 0
        self._previous: dict[int, Any] = {}
        self._log_filter = _AgentLogFilter()

    def __enter__(self) -> _Forwarder:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        logging.getLogger(_ELASTIC_API_LOGGER).addFilter(self._log_filter)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        logging.getLogger(_ELASTIC_API_LOGGER).removeFilter(self._log_filter)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.pending.append(signum)
        if self.first is None and signum != self.DUMP:
            self.first = signum

    def forward(self) -> None:
        """Send the pending signals to the workers (kept pending while there are none yet)."""
        if not self.pending:
            return
        pids = worker_pids(self.module)
        if not pids:
            return
        while self.pending:
            sig = self.pending.pop(0)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.workers = max(self.workers, len(pids))

    def report(self, status: int, failures: str, latest: int | None) -> str:
        name = signal.Signals(self.first).name
        if not self.workers:
            return f"received {name} before the workers started; exit code {status}"
        head = f"received {name}: forwarded to {self.workers} workers; they "
        if status == 0 and latest is not None:
            return head + f"saved step {latest} and exited 0"
        saved = "" if latest is None else f"; the latest committed checkpoint is step {latest}"
        return head + (f"exited 0{saved}" if status == 0 else f"exited {status} ({failures}){saved}")


_ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _AgentLogFilter(logging.Filter):
    """Drops the agent's records that would only repeat what the launcher or the workers say in one line:
    torch's warning that an agent in a thread registers no signal handlers (``_Forwarder`` does), its
    "failed (exitcode: 4)" after a fault stop (rank 0 said why), and its "Sending process N closing signal
    SIGTERM" teardown of the workers still exiting after the first one did."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "child thread" in msg or (msg.startswith("Sending process") and "closing signal" in msg):
            return False
        raw = record.msg if isinstance(record.msg, str) else ""
        return not (raw.startswith("failed (exitcode") and bool(record.args) and record.args[0] == FAULT_STOP)


def worker_pids(module: str, parent: int | None = None) -> list[int]:
    """The pids of the children of ``parent`` (default: this process) whose command line runs ``-m module``:
    torchrun's workers.

    Linux ``/proc``; elsewhere none are found and a signal stays with this launcher."""
    me, found = os.getpid() if parent is None else parent, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if any(a == b"-m" and b == module.encode() for a, b in zip(cmdline, cmdline[1:])):
            found.append(int(stat.parent.name))
    return found
