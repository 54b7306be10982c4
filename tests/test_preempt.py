"""Preemption through the real CLI (``python -m recipes.train``): SIGTERM / SIGINT mid-step and the
``run.max_minutes`` time budget stop the run after a step with a committed checkpoint of it, one line and
exit 0 (3 when the save failed), never a traceback; ``--resume auto`` then continues with every loss equal
to an uninterrupted run's (JSON floats round-trip exactly). Also: the ranks' agreement (one rank signalled
stops all after the same step), the budget rule, and the ``--nproc`` launcher forwarding the signal.

The demo layout (4 processes: DualPipeV x EP; 5 launches, ~160 s of CPU) is opt-in: ``DSV3_KILL_TRIALS=1``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recipes.train import main as train_main
from tests.dist_utils import run_distributed
from tests.test_train_kill import _losses
from training.checkpoint import format as fmt
from training.launch import relaunch, worker_pids
from training.preempt import TIME_BUDGET, Preemption

ROOT = Path(__file__).resolve().parent.parent
STEPS = 5
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]
# The demo model, shortened (as tests/test_train_kill.py): 2 micro-batches of 2 x 32 tokens in one process.
OVERRIDES = ["run.sample_tokens=0", "data.seq_len=32", "data.global_batch=4", "data.micro_batch=2",
             "logging.progress=false", "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false",
             "run.threads=1", f"run.steps={STEPS}", "checkpoint.keep_last=3", "checkpoint.final=false",
             "optim.warmup_steps=2", "run.timeout_s=120"]


def _cmd(run_dir: Path, nproc: int, overrides: list[str], *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "recipes.train", "--config", "recipes/configs/tiny_cpu.toml", "--nproc", str(nproc),
           "--run-dir", str(run_dir), *extra]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference",
            "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.PIPE, text=True)


def _wait_until(moment, proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not moment():
        assert proc.poll() is None, f"the run ended first:\n{log.read_text()[-3000:]}\n{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"never reached:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> tuple[int, str, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, log.read_text(), err


def _stop_line(out: str, cause: str) -> tuple[int, str]:
    """(step, line) of the one line the run printed on stopping."""
    lines = [ln for ln in out.splitlines() if ln.startswith(cause)]
    assert len(lines) == 1, out[-3000:]
    return int(lines[0].split(" after step ")[1].split(":")[0]), lines[0]


def _assert_committed(run_dir: Path, step: int) -> None:
    root = run_dir / "checkpoints"
    assert fmt.read_pointer(root, fmt.LATEST_FILE) == step
    assert step in fmt.committed_steps(root)
    assert not list(root.glob(fmt.STAGING_PREFIX + "*")), list(root.iterdir())
    assert sorted(s for s, _ in _losses(run_dir)) == list(range(1, step + 1))  # nothing past the stop


def _assert_equal(run_dir: Path, reference: dict[int, float]) -> None:
    seen = _losses(run_dir)
    assert sorted(s for s, _ in seen) == sorted(reference), seen  # every step once
    mismatched = [(s, loss, reference[s]) for s, loss in seen if loss != reference[s]]
    assert not mismatched, f"(step, resumed loss, uninterrupted loss): {mismatched}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted 1-process run's loss per step."""
    run_dir = tmp_path_factory.mktemp("preempt") / "ref"
    proc = _run(_cmd(run_dir, 1, SINGLE + OVERRIDES + ["checkpoint.interval=0"]))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    losses = dict(_losses(run_dir))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_mid_step_commits_the_last_step_and_resumes_bit_identical(tmp_path, reference):
    """SIGTERM while step 2 runs: the step finishes, ``step_1`` or ``step_2`` is committed (synchronously: no
    interval save falls there), one line, exit 0. A SIGINT that lands while that checkpoint is written
    (writes paused by ``checkpoint.write_delay_s``) is ignored. ``--resume auto`` runs to the end, and every
    step's loss equals the uninterrupted run's."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    overrides = SINGLE + OVERRIDES + ["checkpoint.interval=4"]
    proc = _start(_cmd(run, 1, overrides + ["checkpoint.write_delay_s=0.5"]), log)
    _wait_until(lambda: _losses(run), proc, log)
    proc.send_signal(signal.SIGTERM)
    _wait_until(lambda: list((run / "checkpoints").glob(fmt.STAGING_PREFIX + "*")), proc, log)
    proc.send_signal(signal.SIGINT)  # a second signal, mid-save
    rc, out, err = _finish(proc, log)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    step, line = _stop_line(out, "preempted by SIGTERM")
    assert step in (1, 2) and out.rstrip().endswith(line)
    assert line == (f"preempted by SIGTERM after step {step}: checkpoint {fmt.step_dirname(step)} committed in "
                    f"{run / 'checkpoints'}; resume with --resume auto")
    _assert_committed(run, step)
    assert json.loads((run / "summary.json").read_text())["stopped"] == {"cause": "SIGTERM", "step": step,
                                                                         "exit_status": 0}

    resumed = _run(_cmd(run, 1, overrides, "--resume", "auto"))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"{fmt.step_dirname(step)} at step {step}" in resumed.stdout
    _assert_equal(run, reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_never_prints_a_traceback_and_a_failed_save_exits_3(tmp_path):
    """SIGINT (Ctrl-C) mid-step, with every step's staging path taken by a file so the final save fails:
    one line on stderr naming the step and the reason, exit 3 (``accel.cli.SAVE_FAILED``), no traceback,
    no ``KeyboardInterrupt``, nothing committed."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(_cmd(run, 1, SINGLE + OVERRIDES + ["checkpoint.interval=100"]), log)
    _wait_until(lambda: _losses(run), proc, log)
    for s in range(STEPS + 1):  # after the start-up sweep of leftovers: the save's staging folder cannot be made
        (run / "checkpoints" / (fmt.STAGING_PREFIX + fmt.step_dirname(s))).write_text("in the way")
    proc.send_signal(signal.SIGINT)
    rc, out, err = _finish(proc, log)
    assert rc == 3, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    step, line = _stop_line(err, "preempted by SIGINT")
    assert line.startswith(f"preempted by SIGINT after step {step}: checkpoint not saved (CheckpointWriteError: "
                           f"rank 0: checkpoint of step {step} failed: FileExistsError"), line
    assert fmt.read_pointer(run / "checkpoints", fmt.LATEST_FILE) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_budget_stops_with_a_checkpoint_and_bad_budgets_are_refused(tmp_path, capsys):
    """``run.max_minutes=0.001`` (60 ms, less than building the model and running one step on any machine; 1.2 s
    was not always, on a fast machine): the first step boundary sees that another step and a save would pass the
    budget; the run saves step 1 (checkpointing otherwise off) and exits 0 with one
    line. ``-1``, ``nan`` and ``inf`` are refused with one line naming the key, before anything starts."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(_cmd(run, 1, SINGLE + OVERRIDES + ["checkpoint.interval=0", "run.max_minutes=0.001"]), log)
    rc, out, err = _finish(proc, log)
    assert rc == 0, out[-3000:] + err[-3000:]
    step, line = _stop_line(out, "stopped for the time budget (run.max_minutes=0.001)")
    assert step == 1 and line.endswith(f"checkpoint {fmt.step_dirname(1)} committed in {run / 'checkpoints'}; "
                                       "resume with --resume auto")
    _assert_committed(run, 1)

    for bad in ("-1", "nan", "inf"):
        assert train_main(["--config", "recipes/configs/tiny_cpu.toml", "--set", f"run.max_minutes={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        expected = ("error: run.max_minutes must be a finite number >= 0" if bad == "-1" else  # the range check
                    f"error: config key 'run.max_minutes' must be a finite number, got {bad}")  # every float key
        assert len(err) == 1 and err[0].startswith(expected), err


def test_sigint_before_training_starts_is_one_line(monkeypatch, capsys):
    """Ctrl-C before the training loop's handlers exist (config checks, imports): one line, status 130."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("recipes.train.load_config", interrupted)
    assert train_main(["--config", "recipes/configs/tiny_cpu.toml"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines() == ["interrupted (SIGINT) before training started: nothing to save"]


def test_time_budget_rule():
    """Stop when elapsed + the slowest recent step + the last measured save would pass the budget (a step's
    time stands in for the save before one is measured); never on the last step, never with 0 (off)."""
    now = [0.0]
    p = Preemption(max_minutes=1.0, clock=lambda: now[0])  # 60 s
    now[0] = 40.0
    assert p.check(1, 10, 9.0, 1) is None  # 40 + 9 + 9 = 58
    now[0] = 43.0
    stop = p.check(2, 10, 2.0, 1)  # 43 + 9 (slowest recent) + 9 = 61
    assert stop is not None and stop.step == 2 and stop.code == TIME_BUDGET and stop.cause == "the time budget"
    p.save_seconds = lambda: 1.0
    assert p.check(3, 10, 2.0, 1) is None  # 43 + 9 + 1
    now[0] = 100.0
    assert p.check(10, 10, 2.0, 1) is None  # the last step: the run ends anyway
    assert Preemption(max_minutes=0.0, clock=lambda: 1e9).check(1, 10, 5.0, 1) is None


def _agree(rank: int, world: int) -> list:
    """Three stops in a row on every rank: a budget seen by rank 2 only, then SIGTERM delivered to rank 1 only,
    then both at once (the signal wins)."""
    out = []
    for budget_rank, signal_rank, at in ((2, None, 2), (None, 1, 3), (0, 2, 1)):
        clock = [0.0]
        with Preemption(max_minutes=1.0 if rank == budget_rank else 0.0, clock=lambda c=clock: c[0]) as p:
            for step in range(1, 6):
                if step == at:
                    clock[0] = 1e6
                    if rank == signal_rank:
                        os.kill(os.getpid(), signal.SIGTERM)
                stop = p.check(step, 6, 0.1, world)
                if stop is not None:
                    out.append((stop.step, stop.cause, p.received))
                    break
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_agree_to_stop_after_the_same_step():
    results = run_distributed(_agree, 3)
    for rank, got in enumerate(results):
        assert got == [(2, "the time budget", None),
                       (3, "SIGTERM", signal.SIGTERM if rank == 1 else None),
                       (1, "SIGTERM", signal.SIGTERM if rank == 2 else None)], (rank, got)


@pytest.fixture
def restored_environ():
    """torchrun's launcher sets variables in this process's environment: put it back afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_launcher_forwards_the_signal_and_returns_the_workers_status(tmp_path, capfd, restored_environ):
    """``--nproc``'s launcher (``relaunch``: torchrun's agent in a thread) passes SIGTERM, then SIGINT, on to its
    2 workers, waits for them, prints one line and returns their status (0, then 3); no traceback. A SIGUSR1
    before them (the flight-recorder dump) reaches both workers and is not reported as a stop."""
    for name, status in (("SIGTERM", 0), ("SIGINT", 3)):
        folder = tmp_path / name
        folder.mkdir()

        def signal_when_ready(folder=folder, sig=signal.Signals[name]) -> None:
            deadline = time.monotonic() + 120
            while len(list(folder.glob("*.ready"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGUSR1)
            while len(list(folder.glob("*.usr1"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), sig)  # to this process: the launcher

        sender = threading.Thread(target=signal_when_ready, daemon=True)
        sender.start()
        assert relaunch("tests.preempt_child", 2, [str(folder), str(status)]) == status
        sender.join()
        assert [p.read_text().split(",")[0] for p in sorted(folder.glob("*.got"))] == [name, name]
        assert len(list(folder.glob("*.usr1"))) == 2
        out, err = capfd.readouterr()
        assert "Traceback" not in err and "SignalException" not in err and "KeyboardInterrupt" not in err, err
        assert "child thread" not in err  # torch's warning about its agent in a thread: the launcher handles signals
        lines = [ln for ln in out.splitlines() if ln.startswith("received")]
        assert len(lines) == 1 and lines[0].startswith(f"received {name}: forwarded to 2 workers; they exited "
                                                       f"{status}"), out


# ---- the demo layout: 4 processes, PP=2 DualPipeV x EP=2 over DP=2 (opt-in) -------------------
DEMO = ["run.sample_tokens=0", "data.seq_len=32", "data.global_batch=8", "data.micro_batch=1",
        "logging.progress=false", "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false",
        "run.threads=1", "run.steps=8", "checkpoint.interval=5", "checkpoint.keep_last=3", "checkpoint.final=false",
        "optim.warmup_steps=2", "run.timeout_s=120"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("DSV3_KILL_TRIALS"),
                    reason="5 launches of 4 processes, ~3-6 min: set DSV3_KILL_TRIALS=1")
def test_demo_layout_sigterm_to_one_worker_then_to_the_launcher_resumes_bit_identical(tmp_path):
    """The demo layout under ``--nproc 4``: (1) SIGTERM to one worker only (rank agreement: all 4 stop after
    the same step and commit it, exit 0); (2) resumed, then SIGTERM to the launcher: it forwards it, the
    workers save, the launcher prints its line and exits 0; (3) resumed under plain torchrun, SIGTERM to it;
    (4) resumed to the end: every step's loss equals an uninterrupted run's."""
    ref = _run(_cmd(tmp_path / "ref", 4, DEMO))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    reference = dict(_losses(tmp_path / "ref"))
    run, log = tmp_path / "run", tmp_path / "run.log"

    proc = _start(_cmd(run, 4, DEMO), log)
    _wait_until(lambda: _losses(run), proc, log)
    os.kill(worker_pids("recipes.train", proc.pid)[-1], signal.SIGTERM)
    rc, out, err = _finish(proc, log)
    assert rc == 0 and "Traceback" not in err, out[-3000:] + err[-3000:]
    first, _ = _stop_line(out, "preempted by SIGTERM")
    _assert_committed(run, first)

    proc = _start(_cmd(run, 4, DEMO, "--resume", "auto"), log)
    _wait_until(lambda: max(s for s, _ in _losses(run)) > first, proc, log)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = _finish(proc, log)
    assert rc == 0 and "Traceback" not in err and "SignalException" not in err, out[-3000:] + err[-3000:]
    second, _ = _stop_line(out, "preempted by SIGTERM")
    assert out.rstrip().endswith(f"received SIGTERM: forwarded to 4 workers; they saved step {second} and exited 0")
    assert second > first
    _assert_committed(run, second)

    # (3) plain torchrun, as on a cluster: its agent forwards SIGTERM and gives the workers 30 s (it then exits
    # non-zero with its own SignalException, which is torchrun's behaviour, not checked here)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                "recipes.train", "--config", "recipes/configs/tiny_cpu.toml", "--run-dir", str(run), "--resume", "auto"]
    torchrun += [a for o in DEMO for a in ("--set", o)]
    proc = _start(torchrun, log)
    _wait_until(lambda: max(s for s, _ in _losses(run)) > second, proc, log)
    proc.send_signal(signal.SIGTERM)
    _, out, err = _finish(proc, log)
    third, _ = _stop_line(out, "preempted by SIGTERM")
    assert third > second
    _assert_committed(run, third)

    resumed = _run(_cmd(run, 4, DEMO, "--resume", "auto"))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    _assert_equal(run, reference)
