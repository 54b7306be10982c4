"""``--nproc N``: re-launch the current command under ``torch.distributed.run`` (torchrun) on this machine.

The convenience is only for single-machine runs (CPU development, one GPU node); a cluster uses
``torchrun`` itself (``--nnodes``, ``--rdzv-endpoint``), which runs the same entry point. Torchrun's
own agent starts, watches and tears down the workers; nothing here is home-made distribution.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from accel.cli import FAULT_STOP


class _QuietFaultStop(logging.Filter):
    """Drops torchrun's "failed (exitcode: 4)" record (the workers said why in one line) and its "Sending process
    N closing signal SIGTERM" records (teardown of the workers still exiting after the first one did; on a
    crash, the traceback and the launcher's own line say what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False
        return not (msg.startswith("failed (exitcode") and bool(record.args) and record.args[0] == FAULT_STOP)


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


def relaunch(module: str, nproc: int, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Run ``python -m module *argv`` as ``nproc`` torchrun workers on this machine; returns the exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N workers on a few cores: no thread oversubscription
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                         f"--max-restarts={max_restarts}", "--module", module, *argv])
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _QuietFaultStop()
    agent_log.addFilter(quiet)
    try:
        run(args)
    except ChildFailedError as exc:
        if any(f.exitcode == FAULT_STOP for f in exc.failures.values()):
            return FAULT_STOP  # the fault guard stopped every rank; rank 0 printed the line
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(exc.failures.items()))
        print(f"training failed ({failures}); see the error above")
        return 1
    finally:
        agent_log.removeFilter(quiet)
    return 0
