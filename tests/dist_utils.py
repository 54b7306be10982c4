"""Run a function on N gloo ranks in fresh processes, with a hard timeout and results returned.

Shared by every multi-rank test: ports come from the OS, each rank's exception is re-raised in
the parent with its rank named, and a rank that hangs is killed when the timeout passes.

Ranks are forked from a ``forkserver`` that imported torch and the toolkit once (``PRELOAD``), instead of
each rank being spawned and importing them again: that import is seconds of CPU per process, most of a
small multi-rank test's time on the 2-core CI machine. The server is a fresh interpreter that never
touches an accelerator, so its forks may. It starts from the environment of the first call; each
rank takes the caller's environment as it is at that call (``_worker``), as a spawned rank would. (Only
what is read while the preloaded modules import, such as OpenMP's thread count, keeps the server's value;
the toolkit reads its switches when used.)
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

# torch._dynamo: what the first model built on the meta device imports (seconds of CPU in every rank otherwise)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "training.trainer", "tests.dist_utils"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str, pg_timeout: float,
            environ: dict[str, str]):
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = {"ok": fn(rank, world_size, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the rank named
        result = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes). Raises
    RuntimeError naming the failing rank, or TimeoutError if the ranks have not all finished
    within ``timeout`` seconds (the processes are then killed).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, timeout, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while not ctx.join(timeout=1.0):
            if datetime.datetime.now() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                missing = [r for r in range(world_size) if not os.path.exists(os.path.join(out_dir, f"rank{r}.pkl"))]
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s; ranks still running: {missing}")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                res = pickle.load(f)
            if "error" in res:
                raise RuntimeError(res["error"])
            results.append(res["ok"])
        return results


def current_load(seconds: float = 1.0, samples: int = 10) -> float:
    """Processes running now besides this one: the median over ``samples`` readings of ``/proc/loadavg``'s
    runnable count in ``seconds``. Unlike the 1-minute load average it does not still count the suite's
    previous multi-process test, which had finished; where there is no ``/proc`` it is that average."""
    try:
        counts = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus this reader
            time.sleep(seconds / samples)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return float(sorted(counts)[len(counts) // 2])
