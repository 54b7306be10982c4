"""One job per run folder (``training.runlock``): the lock, its holder record, stale records, the sweep that
runs only under it, and the metrics stream of a resumed run (``training.metrics.supersede_after``)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.checkpoint import CheckpointManager
from training.checkpoint import format as fmt
from training.metrics import SUPERSEDED_FILE, supersede_after
from training.runlock import (
    HOLDER_FILE,
    LAUNCHER_ENV,
    RunFolderLocked,
    RunLock,
    launcher_env,
    owns,
    read_holder,
)

ROOT = Path(__file__).resolve().parent.parent


def _holder_process(run_dir: Path) -> subprocess.Popen:
    """Another job on this host: a process holding ``run_dir``'s lock until it is killed."""
    code = ("import sys, time; from training.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _write_record(run_dir: Path, host: str, pid: int, age_s: float) -> None:
    now = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HOLDER_FILE).write_text(json.dumps({"host": host, "pid": pid, "started": now - age_s - 60,
                                                   "heartbeat": now - age_s}))


@pytest.mark.timeout(60)
def test_holder_record_names_this_process_and_its_heartbeat_moves(tmp_path):
    run = tmp_path / "run"
    with RunLock(run, heartbeat_s=0.05) as lock:
        first = read_holder(run)
        assert (first.host, first.pid) == (socket.gethostname(), os.getpid()) and first.started == first.heartbeat
        assert lock.held and owns(run) and (run / ".lock").is_file()
        time.sleep(0.3)
        assert read_holder(run).heartbeat > first.heartbeat and read_holder(run).started == first.started
    assert not owns(run) and read_holder(run) is None  # released: the record goes, the lock file stays
    assert (run / ".lock").is_file()
    RunLock(run).acquire(announce=pytest.fail).release()  # free again, nothing to take over


@pytest.mark.timeout(60)
def test_live_holder_refuses_then_kill9_leaves_a_lock_taken_over_with_one_line(tmp_path):
    run = tmp_path / "run"
    proc = _holder_process(run)
    try:
        with pytest.raises(RunFolderLocked) as info:
            RunLock(run).acquire()
        msg = str(info.value)
        assert "\n" not in msg and info.value.holder.pid == proc.pid
        assert msg.startswith(f"run folder {run} is in use by pid {proc.pid} on host {socket.gethostname()} since ")
        assert msg.endswith(f"UTC (lock {run / '.lock'}); wait for it or choose another --run-dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert read_holder(run).pid == proc.pid  # kill -9: the record stays, the kernel dropped the flock
    said: list[str] = []
    lock = RunLock(run).acquire(announce=said.append)
    try:
        assert len(said) == 1, said
        assert said[0].startswith(f"run folder {run}: taking over the lock left by pid {proc.pid} on host "
                                  f"{socket.gethostname()} since ")
        assert said[0].endswith("UTC (that process is gone)")
        assert read_holder(run).pid == os.getpid()
    finally:
        lock.release()


@pytest.mark.timeout(60)
def test_record_of_another_host_is_honoured_and_only_break_lock_takes_a_stale_one(tmp_path):
    run = tmp_path / "run"
    _write_record(run, "node-17", 4242, age_s=5)  # flock free (it does not reach across hosts), heartbeat fresh
    with pytest.raises(RunFolderLocked, match=r"in use by pid 4242 on host node-17 since .* last heartbeat \d+ s ago"):
        RunLock(run).acquire()
    _write_record(run, "node-17", 4242, age_s=3600)
    with pytest.raises(RunFolderLocked) as info:
        RunLock(run, stale_after_s=600).acquire()
    msg = str(info.value)
    assert "\n" not in msg and "pid 4242 on host node-17" in msg and "60 min ago: possibly stale" in msg
    assert "--break-lock" in msg and read_holder(run).host == "node-17"  # reported, never silently stolen
    said: list[str] = []
    with RunLock(run).acquire(break_lock=True, announce=said.append):
        assert len(said) == 1 and said[0].startswith(f"run folder {run}: --break-lock: taking over the lock of pid "
                                                     "4242 on host node-17")
        assert read_holder(run).pid == os.getpid()


@pytest.mark.timeout(60)
def test_workers_of_the_launcher_own_the_folder_only_through_their_parent(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with RunLock(run) as lock:
        env = launcher_env(lock)
    key, value = next(iter(env.items()))
    assert key == LAUNCHER_ENV
    path = value.rpartition(":")[0]
    monkeypatch.setenv(LAUNCHER_ENV, f"{path}:{os.getppid()}")  # as a torchrun worker of the launcher sees it
    assert owns(run) and not owns(tmp_path / "other")
    monkeypatch.setenv(LAUNCHER_ENV, f"{path}:{os.getpid() + 100000}")  # a stale variable: not our parent
    assert not owns(run)


@pytest.mark.timeout(60)
def test_manager_sweeps_only_when_asked_by_the_folders_owner(tmp_path):
    """A reader (export, a second job's tools) never removes a staging folder: it may be a live save."""
    staging = tmp_path / (fmt.STAGING_PREFIX + fmt.step_dirname(8))
    staging.mkdir()
    (staging / "model-rank00000.safetensors").write_bytes(b"\x00" * 10)
    CheckpointManager(tmp_path).close()
    assert staging.is_dir()
    CheckpointManager(tmp_path, sweep=True).close()
    assert not staging.exists()


@pytest.mark.timeout(60)
def test_trainer_hooks_sweep_only_under_the_run_folders_lock(tmp_path, monkeypatch):
    from training.checkpoint import trainer_hooks

    seen = []
    monkeypatch.setattr(trainer_hooks, "CheckpointManager", lambda root, **kw: seen.append(kw["sweep"]) or 1 / 0)

    class Trainer:
        cfg = type("C", (), {"checkpoint": type("K", (), {"async_save": False, "keep_last": 1, "keep_every": 0,
                                                          "write_delay_s": 0})(),
                             "run": type("R", (), {"timeout_s": 5})()})()
    for held in (False, True):
        lock = RunLock(tmp_path).acquire() if held else None
        with pytest.raises(ZeroDivisionError):
            trainer_hooks.CheckpointHooks(Trainer(), tmp_path / "checkpoints")
        if lock is not None:
            lock.release()
    assert seen == [False, True]


def test_resumed_stream_moves_the_lines_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text("".join(lines) + '{"step": 5, "lo')  # killed mid-line after its last checkpoint (step 2)
    assert supersede_after(path, 2) == 3
    assert path.read_text() == "".join(lines[:2])
    assert (tmp_path / SUPERSEDED_FILE).read_text() == "".join(lines[2:]) + '{"step": 5, "lo\n'
    assert supersede_after(path, 2) == 0 and path.read_text() == "".join(lines[:2])
    assert supersede_after(path, 0) == 2 and path.read_text() == ""  # a new run supersedes everything


@pytest.mark.timeout(60)
def test_without_flock_the_holder_record_alone_is_the_lock(tmp_path, monkeypatch):
    """A filesystem without flock (Lustre's default): a live pid of this host in the record is refused, a dead
    one is taken over, and both say so in one line."""
    import fcntl

    real_flock = fcntl.flock

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    run = tmp_path / "run"
    _write_record(run, socket.gethostname(), os.getppid(), age_s=1)  # a live process of this host
    monkeypatch.setattr(fcntl, "flock", no_flock)
    said: list[str] = []
    with pytest.raises(RunFolderLocked, match=rf"is in use by pid {os.getppid()} on host"):
        RunLock(run).acquire(announce=said.append)
    assert said == [f"run folder {run}: this filesystem does not support flock ({os.strerror(errno.ENOSYS)}); "
                    "relying on the holder record alone"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_record(run, socket.gethostname(), int(dead.stdout), age_s=1)
    said.clear()
    lock = RunLock(run).acquire(announce=said.append)
    assert len(said) == 2 and "(that process is gone)" in said[1] and read_holder(run).pid == os.getpid()
    lock.release()
    monkeypatch.setattr(fcntl, "flock", real_flock)


@pytest.mark.timeout(60)
def test_worker_stops_when_the_launcher_holding_the_lock_is_killed(tmp_path):
    """kill -9 of the ``--nproc`` launcher frees the lock; its worker (in a session of its own, as torchrun
    starts it) must not go on training in a folder the next launch may take: it stops within seconds."""
    worker = ("import sys, time; from training.runlock import take; assert take(sys.argv[1]) is None; "
              "print('working', flush=True); time.sleep(60)")
    launcher = ("import os, subprocess, sys; from training.runlock import RunLock, launcher_env; "
                "lock = RunLock(sys.argv[1]).acquire(); "
                "w = subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]], start_new_session=True, "
                "env={**os.environ, **launcher_env(lock)}); print(w.pid, flush=True); w.wait()")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", launcher, str(run), worker], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker_pid = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "working"  # its rank 0 accepted the launcher's lock
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{worker_pid}").exists() and Path(f"/proc/{worker_pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the worker outlived its launcher"
        time.sleep(0.1)
    said = []
    RunLock(run).acquire(announce=said.append).release()
    assert len(said) == 1 and "(that process is gone)" in said[0]
    late = subprocess.run([sys.executable, "-c", worker, str(run)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), LAUNCHER_ENV: f"{run.resolve() / '.lock'}:1"})
    assert late.returncode != 0 and "the --nproc launcher (pid 1) that holds its lock for this worker is gone; " \
        "not starting" in late.stderr  # a worker starting after its launcher died takes nothing either
