"""The flight recorder (``accel.flight``) and ``recipes.diagnose``: hangs traced to the rank that stopped first.

Two real hangs, injected with the ``DSV3_STALL`` test hook: one rank stalls inside an expert all-to-all
of the PP 2 x EP 2 demo layout (the trainer in four gloo processes), another inside a pipeline P2P
receive of a 2-process ``recipes.train`` run; every rank's watchdog dumps, and the diagnosis names the
stalled rank, its operation and the ranks waiting on it.
"""

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

from accel.flight import FlightRecorder, FlightWatchdog, flight_path, measure_entry_cost, parse_stall
from recipes import diagnose
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
# The stalled rank sleeps STALL_S (past its watchdog, which dumps) and then fails, dumping again; its peers then
# fail too (the connection closes) and dump. The collective timeout is far above that: a loaded 2-core machine
# can take seconds for one exchange, and a false timeout would end the run before the stall.
TIMEOUT_S, WATCHDOG_S, STALL_S = 60.0, 1.0, 4.0
# the demo config, shortened (as tests/test_train_kill.py): 4 micro-batches of 1 x 32 tokens per dp rank
OVERRIDES = ["run.sample_tokens=0", "data.seq_len=32", "data.micro_batch=1", "logging.progress=false",
             "logging.eval_batches=1", "logging.eval_every=0", "logging.wandb=disabled", "logging.plot=false",
             "run.threads=1", "run.steps=3", "checkpoint.interval=0", "checkpoint.final=false", "model.fp8=false",
             f"run.timeout_s={TIMEOUT_S}", f"run.watchdog_s={WATCHDOG_S}"]


# ---- the recorder --------------------------------------------------------------------------------------
def test_ring_buffer_keeps_the_last_entries_and_dumps_them_atomically(tmp_path):
    flight = FlightRecorder(3, flight_path(tmp_path, 3), capacity=4, world_size=8, stall="")
    flight.step = 7
    for mb in range(6):
        with flight.record("action", f"0F{mb}", stage=0, mb=mb):
            pass
    flight.action = "0F6"
    hung = flight.begin("recv", "act stage 1 mb 6", stage=1, mb=6, peer=5, nbytes=128)
    path = flight.dump("test")
    assert path == tmp_path / "flight" / "rank_3.json" and not list(path.parent.glob(".*tmp"))
    d = json.loads(path.read_text())
    assert (d["rank"], d["world_size"], d["step"], d["reason"]) == (3, 8, 7, "test")
    assert [e["name"] for e in d["entries"]] == ["0F3", "0F4", "0F5", "act stage 1 mb 6"]  # the last 4
    last = d["entries"][-1]
    assert last["end"] is None and last["wait"] is not None and last["peer"] == 5 and last["context"] == "0F6"
    assert last["step"] == 7 and last["nbytes"] == 128 and last["seq"] == hung.seq == 7
    assert all(e["end"] >= e["start"] for e in d["entries"][:-1])


def test_an_entry_costs_a_few_microseconds():
    assert measure_entry_cost() < 20e-6  # ~2 us of CPU here; generous for a loaded machine


def test_a_failing_operation_dumps_before_the_error_leaves_it(tmp_path):
    flight = FlightRecorder(0, flight_path(tmp_path, 0), stall="")
    with pytest.raises(TimeoutError):
        with flight.record("all_reduce", "dp gradients", group="dp", ranks=(0, 1), posted=True):
            with flight.record("action", "inner"):  # the enclosing operation sees the same error: one dump
                raise TimeoutError("no peer")
    d = json.loads(flight_path(tmp_path, 0).read_text())
    assert flight.dumps == 1 and "'inner' failed: TimeoutError: no peer" in d["reason"]
    assert [e["end"] for e in d["entries"]] == [None, None]  # dumped in flight, as the rank gave up on them
    assert [e["error"] for e in d["entries"]] == [None, "TimeoutError: no peer"]
    assert [e.error is not None for e in flight.entries()] == [True, True]


def test_stall_hook_is_checked():
    assert parse_stall("rank=1,kind=recv,step=2,seconds=3") == {"rank": "1", "kind": "recv", "step": "2",
                                                                 "seconds": "3"}
    for bad in ("kind=recv", "rank=1,colour=red", "rank=x"):
        with pytest.raises(ValueError, match="DSV3_STALL"):
            parse_stall(bad)


def test_watchdog_dumps_once_per_stall_and_on_sigusr1(tmp_path):
    flight = FlightRecorder(0, flight_path(tmp_path, 0), stall="")
    watchdog = FlightWatchdog(flight, 0.3, poll_s=0.05).start()
    try:
        with flight.record("action", "0F0"):
            pass
        flight.begin("recv", "act stage 0 mb 1", peer=1)  # never ends: a stall
        deadline = time.time() + 10
        while flight.dumps < 1 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert flight.dumps == 1  # once per stall
        reason = json.loads(flight_path(tmp_path, 0).read_text())["reason"]
        assert reason.startswith("watchdog: no progress for")
        # SIGUSR1 while the main thread is blocked: the watchdog thread writes the dump
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        deadline = time.time() + 10
        while flight.dumps < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads(flight_path(tmp_path, 0).read_text())["reason"] == "SIGUSR1"
    finally:
        watchdog.stop()
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)


# ---- the diagnosis on recorded states ---------------------------------------------------------------------
def _dumps(*flights: FlightRecorder) -> dict[int, dict]:
    return {f.rank: f.snapshot("test") for f in flights}


def test_diagnosis_follows_receives_and_collectives_to_the_rank_that_stopped():
    """Rank 2 never joins the EP all-to-all of ranks 0, 2 (it is computing); rank 0 posted it; rank 1 waits
    on a message from rank 0; rank 3 waits on a message rank 2 has not sent."""
    f = [FlightRecorder(r, world_size=4, stall="") for r in range(4)]
    for r in (0, 2):  # one completed exchange each: the group's first
        f[r].end(f[r].begin("all_to_all", "dispatch", group="ep", ranks=(0, 2), layer=1, posted=True))
    f[0].action = "0F5"
    f[0].begin("all_to_all", "combine", group="ep", ranks=(0, 2), layer=1, posted=True)  # blocks: seq 2
    f[2].begin("action", "1F5", stage=1, mb=5, blocking=False)
    f[1].begin("recv", "act stage 0 mb 5", peer=0, context="1F5")
    f[3].begin("recv", "grad stage 2 mb 4", peer=2, context="3B4")
    diag = diagnose.diagnose(_dumps(*f))
    assert diag["culprit"] == 2 and diag["waiting_on_culprit"] == [0, 3] and diag["waiting_behind"] == [1]
    text = diagnose.format_diagnosis(diag)
    assert text.startswith("rank 2 stopped first: in action 1F5, micro-batch 5"), text
    assert "rank 0 (all-to-all 'combine' of layer 1 (group ep [0, 2]), micro-batch 5, action 0F5" in text
    # the same with rank 2 inside the exchange but stuck before posting it, and without rank 3's dump
    f[2].begin("all_to_all", "combine", group="ep", ranks=(0, 2), layer=1)
    dumps = _dumps(*f)
    del dumps[3]
    diag = diagnose.diagnose(dumps)
    states = {s["rank"]: s for s in diag["ranks"]}
    assert diag["culprit"] == 2 and states[2]["state"] == "stuck" and states[3]["state"] == "missing"
    assert "nothing of it posted" in diagnose.format_diagnosis(diag)


def test_a_receive_of_a_message_already_sent_is_stuck_on_the_receiver():
    f = [FlightRecorder(r, world_size=2, stall="") for r in range(2)]
    f[0].begin("send", "act stage 0 mb 2", peer=1, blocking=False, posted=True)
    f[0].begin("recv", "act stage 2 mb 0", peer=1)
    f[1].begin("recv", "act stage 0 mb 2", peer=0)
    diag = diagnose.diagnose(_dumps(*f))
    assert diag["culprit"] == 1 and diag["waiting_on_culprit"] == [0]
    assert "already sent by rank 0" in diagnose.format_diagnosis(diag)


def test_diagnose_without_dumps_is_one_line(tmp_path, capsys):
    assert diagnose.main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "holds no flight-recorder dumps" in err
    assert diagnose.main([str(tmp_path / "absent")]) == 2
    assert "is not a folder" in capsys.readouterr().err


# ---- real hangs ---------------------------------------------------------------------------------------------
def _train_rank(rank: int, world: int, run_dir: str, overrides: list[str]) -> str:
    """The demo config with ``overrides`` on this rank, through ``training.run``; the error it ended with."""
    from training.config import load_config
    from training.run import RunOptions, run_training

    cfg = load_config("recipes/configs/tiny_cpu.toml", [*OVERRIDES, *overrides])
    try:
        run_training(cfg, RunOptions(run_dir=run_dir, sample=False))
    except Exception as exc:  # noqa: BLE001 - every rank is expected to fail: the stall, then its peers
        return f"{type(exc).__name__}: {exc}"
    return "finished"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_rank_stalled_in_an_all_to_all_is_named(tmp_path, monkeypatch):
    """PP 2 (DualPipeV) x EP 2 over DP 2: rank 1 stalls in step 0's first dispatch of layer 1 (stage 0, EP group
    0, 1; pipeline peer 3). Rank 0 waits in the all-to-all, rank 3 on a receive from rank 1, rank 2 behind them."""
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "reference")
    monkeypatch.setenv("DSV3_STALL", f"rank=1,kind=all_to_all,name=dispatch,layer=1,step=0,seconds={STALL_S}")
    errors = run_distributed(_train_rank, 4, str(tmp_path), ["data.global_batch=8"], timeout=240)
    assert "InjectedStall" in errors[1] and all(e != "finished" for e in errors), errors
    assert sorted(p.name for p in (tmp_path / "flight").iterdir()) == [f"rank_{r}.json" for r in range(4)]
    dumps = diagnose.load_dumps(tmp_path)[0]
    assert any(reason.startswith("watchdog: no progress") for _, reason in dumps[1]["earlier_dumps"])
    assert "InjectedStall" in dumps[1]["reason"]
    diag = diagnose.diagnose(dumps)
    culprit = diag["ranks"][1]
    assert diag["culprit"] == 1 and culprit["state"] == "stuck", diagnose.format_diagnosis(diag)
    assert (culprit["op"]["kind"], culprit["op"]["name"], culprit["op"]["layer"], culprit["op"]["step"]) == (
        "all_to_all", "dispatch", 1, 0)
    assert 0 in diag["waiting_on_culprit"] and diag["ranks"][0]["op"]["kind"] == "all_to_all"
    assert 3 in diag["waiting_on_culprit"] and diag["ranks"][3]["op"]["kind"] == "recv"
    assert diag["ranks"][3]["op"]["peer"] == 1
    text = diagnose.format_diagnosis(diag)
    assert text.startswith("rank 1 stopped first: in-flight all-to-all 'dispatch' of layer 1 (group ep [0, 1])")
    assert "step 0" in text.splitlines()[0]


P2P_LAYOUT = ["parallel.dp=1", "parallel.ep=1", "data.global_batch=4"]  # PP 2 DualPipeV, 4 micro-batches


def _check_p2p_diagnosis(run_dir: Path, capsys) -> None:
    """Rank 1 stalled in a receive of step 1 whose message rank 0 had sent; rank 0 waits for rank 1."""
    assert diagnose.main([str(run_dir), "--json"]) == 0
    out = capsys.readouterr().out
    diag = json.loads(out)
    culprit = diag["ranks"][1]
    assert diag["culprit"] == 1 and diag["waiting_on_culprit"] == [0], out
    assert (culprit["state"], culprit["op"]["kind"], culprit["op"]["peer"], culprit["op"]["step"]) == (
        "stuck", "recv", 0, 1)
    assert diag["ranks"][0]["op"]["kind"] == "recv" and diag["ranks"][0]["op"]["peer"] == 1
    assert diagnose.main([str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"rank 1 stopped first: in-flight recv {culprit['op']['name']!r} from rank 0"), text
    assert "already sent by rank 0" in text.splitlines()[0] and "waiting on rank 1: rank 0 (recv" in text


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_rank_stalled_in_a_p2p_receive_is_named(tmp_path, monkeypatch, capsys):
    """PP 2 (DualPipeV) in two gloo processes: rank 1 stalls in its first receive of step 1 and rank 0 blocks on
    a message from rank 1."""
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "reference")
    monkeypatch.setenv("DSV3_STALL", f"rank=1,kind=recv,step=1,seconds={STALL_S}")
    errors = run_distributed(_train_rank, 2, str(tmp_path), P2P_LAYOUT, timeout=240)
    assert "InjectedStall" in errors[1] and errors[0] != "finished", errors
    dump = json.loads(flight_path(tmp_path, 1).read_text())
    assert any(reason.startswith("watchdog: no progress") for _, reason in dump["earlier_dumps"])
    assert "InjectedStall" in dump["reason"]
    _check_p2p_diagnosis(tmp_path, capsys)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("DSV3_FLIGHT_CLI"), reason="opt-in (DSV3_FLIGHT_CLI=1): ~35 s of torchrun")
def test_a_rank_stalled_in_a_p2p_receive_is_named_through_the_cli(tmp_path, capsys):
    """``recipes.train --nproc 2`` (PP 2 DualPipeV): rank 1 stalls in its first receive of step 1 and
    rank 0 blocks on a message from rank 1; ``recipes.diagnose`` names rank 1, the receive and rank 0 waiting on it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes.train", "--config", "recipes/configs/tiny_cpu.toml", "--nproc", "2",
           "--run-dir", str(run_dir)]
    for o in [*OVERRIDES, *P2P_LAYOUT]:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference",
           "PYTHONPATH": str(ROOT), "DSV3_STALL": "rank=1,kind=recv,step=1,seconds=10"}  # rank 0's watchdog too
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    _check_p2p_diagnosis(run_dir, capsys)
