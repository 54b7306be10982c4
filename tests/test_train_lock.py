"""``recipes.train`` and its run folder: one job per folder (a second, identical launch on a held folder
exits 5 at once naming the holder, and the first finishes with single metrics and intact checkpoints),
``--resume auto`` without ``--run-dir`` (the newest run of this config), a refused resume that leaves
``config.toml`` alone, and ``--resume`` / ``--trace`` / ``--run-dir`` refused in one line before any work."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.train import main
from training.checkpoint import format as fmt
from training.metrics import SUPERSEDED_FILE
from training.runlock import HOLDER_FILE, RunLock

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "recipes/configs/tiny_cpu.toml"
# One process, 4 steps of 2 x 32 tokens, a checkpoint at step 3 only: step 4 is logged after the last checkpoint.
OVERRIDES = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", "run.steps=4",
             "data.seq_len=32", "data.global_batch=4", "data.micro_batch=2", "logging.progress=false",
             "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false", "run.sample_tokens=0",
             "checkpoint.interval=3", "checkpoint.final=false", "model.fp8=false", "run.threads=1"]


def _argv(run_dir: Path | None, *extra: str) -> list[str]:
    argv = ["--config", CONFIG, "--nproc", "1", "--wandb", "disabled"]
    argv += ["--run-dir", str(run_dir)] if run_dir else []
    for o in OVERRIDES:
        argv += ["--set", o]
    return argv + list(extra)  # after the overrides: an extra --set wins


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference",
            "PYTHONPATH": str(ROOT)}


def _steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    """``recipes.train``'s entry point run here: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A run launched through the CLI into ``runs/first``, frozen (SIGSTOP) after its first metrics line while
    an identical second launch and a ``--nproc 2`` launch on its folder run to their end, then let go.
    Returns (run folder, first process, the two launches' (status, stdout, stderr), log, folder untouched)."""
    runs = tmp_path_factory.mktemp("lock") / "runs"
    run = runs / "first"
    log = runs.parent / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, "-m", "recipes.train", *_argv(run)], cwd=ROOT, env=_env(),
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # mid-run, holding the lock, for as long as the launches below take
        before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.toml")}
        second = _in_process(_argv(run))
        # the --nproc launcher checks the lock itself, before torchrun starts any worker
        launcher = _in_process(_argv(run) + ["--nproc", "2", "--set", "parallel.dp=2"])
        untouched = all((run / name).read_bytes() == data for name, data in before.items())
    finally:
        first.send_signal(signal.SIGCONT)
    first.wait(180)
    return run, first, (second, launcher), log, untouched


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_second_launch_on_a_held_folder_exits_5_at_once_and_the_first_finishes_intact(first_run):
    run, first, launches, log, untouched = first_run
    line = (rf"error: run folder {re.escape(str(run))} is in use by pid {first.pid} on host "
            rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(lock "
            rf"{re.escape(str(run / '.lock'))}\); wait for it or choose another --run-dir\n")
    for status, out, err in launches:
        assert status == 5 and out == "" and re.fullmatch(line, err), (status, out, err)
    assert untouched  # refused before writing anything into the folder
    assert first.returncode == 0, log.read_text()[-3000:]
    assert _steps(run) == [1, 2, 3, 4]  # every step once: the second launch wrote nothing
    assert fmt.committed_steps(run / "checkpoints") == [3]
    assert not (run / HOLDER_FILE).exists() and not list((run / "checkpoints").glob(fmt.STAGING_PREFIX + "*"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_auto_without_run_dir_continues_the_newest_run_of_this_config(first_run, tmp_path):
    run, first = first_run[:2]
    assert first.returncode == 0
    runs = tmp_path / "runs"
    shutil.copytree(run, runs / "first")
    shutil.copytree(run, runs / "older-same")  # same config, but launched earlier
    os.utime(runs / "older-same" / "config.toml", (time.time() - 3600, time.time() - 3600))
    shutil.copytree(run, runs / "newer-other")  # newer, but another config (another learning rate)
    other = runs / "newer-other" / "config.toml"
    other.write_text(re.sub(r"(?m)^lr = .*$", "lr = 0.001", other.read_text()))
    status, out, err = _in_process(_argv(None, "--resume", "auto", "--set", f"run.runs_root={runs}", "--set",
                                         "run.steps=6"))
    assert status == 0, (out + err)[-3000:]
    assert out.startswith(f"resume auto: continuing {runs / 'first'} (newest run of this config, step 3)\n"), out
    assert sorted(p.name for p in runs.iterdir()) == ["first", "newer-other", "older-same"]  # no new folder
    # the first launch logged step 4 after its last checkpoint (3): that line moved aside, the stream is single
    assert _steps(runs / "first") == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["step"] for line in (runs / "first" / SUPERSEDED_FILE).read_text().splitlines()] == [4]
    assert fmt.read_pointer(runs / "first" / "checkpoints", fmt.LATEST_FILE) == 3  # (no save after 3: interval)
    assert _steps(runs / "older-same") == [1, 2, 3, 4] and _steps(runs / "newer-other") == [1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_resume_auto_without_an_earlier_run_says_it_starts_a_new_one(tmp_path, capsys):
    from training.config import load_config
    from training.rundir import choose_run_dir

    cfg = load_config(CONFIG, OVERRIDES + [f"run.runs_root={tmp_path / 'runs'}"])
    said: list[str] = []
    new = choose_run_dir(cfg, None, "auto", announce=said.append)
    assert new.parent == tmp_path / "runs" and said == [
        f"resume auto: no earlier run of this config under {tmp_path / 'runs'}/; starting a new run in {new}"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_refused_resume_leaves_config_toml_and_the_lock_as_they_were(first_run, tmp_path, capsys):
    run, first = first_run[:2]
    assert first.returncode == 0
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    saved = (copy / "config.toml").read_bytes()
    status = main(_argv(copy, "--resume", "auto", "--set", "optim.lr=0.001"))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: checkpoint "), err
    assert "written for another config" in err and "optim.lr" in err
    assert (copy / "config.toml").read_bytes() == saved
    RunLock(copy).acquire(announce=pytest.fail).release()  # released on the error, no record left behind
    step = copy / "checkpoints" / fmt.step_dirname(3)  # a corrupt checkpoint given by path: one line too
    shard = sorted(step.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0xFF]))
    status = main(_argv(copy, "--resume", str(step)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --resume {str(step)!r}: checkpoint {step} is invalid: sha256 mismatch"), err
    assert (copy / "config.toml").read_bytes() == saved


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_trace_and_run_dir_are_refused_in_one_line_before_any_work(first_run, tmp_path, capsys):
    run = first_run[0]
    new = tmp_path / "never"
    (tmp_path / "file").write_text("")
    cases = [
        (["--resume", "/nonexistent"], "error: --resume '/nonexistent': no such folder; expected 'auto' or a "
                                       "checkpoint folder such as RUN/checkpoints/step_000000100"),
        (["--resume", str(run)], f"error: --resume {str(run)!r} is not a checkpoint folder (no metadata.json) (a run "
                                 f"folder: to continue it use --run-dir {run} --resume auto); expected 'auto' or a"),
        (["--trace", "/tmp"], "error: --trace '/tmp' is a folder; expected a file path"),
    ]
    for extra, expected in cases:
        assert main(_argv(new, *extra)) == 2
        out = capsys.readouterr()
        assert out.err.startswith(expected) and out.err.count("\n") == 1 and out.out == "", (extra, out)
        assert not new.exists()  # nothing was started
    assert main(_argv(tmp_path / "file")) == 2
    assert capsys.readouterr().err == f"error: --run-dir {str(tmp_path / 'file')!r} is a file; expected a folder\n"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fresh_launch_into_a_folder_with_checkpoints_is_refused(first_run, tmp_path, capsys):
    """Without --resume, a launch must not start over on top of an earlier run's checkpoints (its metrics would be
    superseded and its rollback pointers reused): one line naming --run-dir, status 2, the folder unchanged."""
    run, first = first_run[:2]
    assert first.returncode == 0
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"}
    for nproc in ("1", "2"):  # one process, and the --nproc launcher (refused before any worker starts)
        argv = _argv(copy, "--set", f"parallel.dp={nproc}")
        argv[argv.index("--nproc") + 1] = nproc
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.err == (f"error: --run-dir {str(copy)!r} already holds an earlier run's checkpoints (latest step "
                           "3); continue it with --resume auto, or choose another --run-dir\n"), out
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"} == before
