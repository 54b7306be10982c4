"""Fault tolerance: detection, agreement across ranks, rollback to a stable checkpoint, skip, retry budget."""

import json
import math
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from training.checkpoint import CheckpointManager
from training.checkpoint.example_loop import main as example_main
from training.fault import (
    CollectiveTimeout,
    FaultPolicy,
    FaultTolerance,
    FaultToleranceError,
    SpikeDetector,
)


def test_spike_detector_against_float64_statistics():
    torch.manual_seed(1)
    losses = (2.0 + 0.05 * torch.randn(40, dtype=torch.float64)).tolist()
    det = SpikeDetector(window=30, sigma=4.0, min_history=10)
    for i, v in enumerate(losses[:9]):
        assert not det.is_spike(100.0), "no judgement before min_history losses"
        det.add(i, v)
    for i, v in enumerate(losses[9:], start=9):
        det.add(i, v)
    window = torch.tensor(losses[-30:], dtype=torch.float64)
    threshold = (window.mean() + 4.0 * window.std(unbiased=False)).item()  # independent reference
    assert det.is_spike(threshold * (1 + 1e-9)) and not det.is_spike(threshold * (1 - 1e-9))
    det.forget_after(20)
    assert [s for s, _ in det.history] == list(range(10, 21))


def test_policy_validation_and_config_mapping():
    with pytest.raises(ValueError, match="window"):
        FaultPolicy(window=0)
    with pytest.raises(ValueError, match="min_history"):
        FaultPolicy(window=5, min_history=10)
    with pytest.raises(ValueError, match="spike_sigma"):
        FaultPolicy(spike_sigma=0)

    class Section:  # what the trainer's [fault] section carries
        enabled, spike_sigma, window, stable_after, max_retries = True, 3.0, 8, 4, 1

    p = FaultPolicy.from_config(Section)
    assert (p.spike_sigma, p.window, p.min_history, p.stable_after, p.max_retries) == (3.0, 8, 8, 4, 1)


def _guard(tmp_path, **kw):
    mgr = CheckpointManager(tmp_path, async_save=False, keep_last=1)
    events = []
    ft = FaultTolerance(FaultPolicy(window=20, min_history=5, stable_after=3, **kw), mgr, events.append)
    return mgr, ft, events


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["nan_loss", "inf_grad", "spike"])
def test_each_fault_kind_rolls_back_to_the_stable_checkpoint(tmp_path, bad):
    mgr, ft, events = _guard(tmp_path)
    state = {"model": {"w": torch.randn(4)}}
    torch.manual_seed(3)
    for step in range(0, 12):
        if step % 4 == 0:
            mgr.save(step, state)
            ft.on_checkpoint(step)
        if step:
            assert ft.check(step, 2.0 + 0.01 * torch.randn(()).item(), 1.0).ok
    # 0, 4, 8 saved; 0 and 4 have had 3 healthy steps (8 has 3 too: steps 9, 10, 11); keep_last=1 keeps pins
    assert mgr.stable_step() == 8 and set(mgr.committed_steps()) >= {8}
    loss, grad = {"nan_loss": (math.nan, 1.0), "inf_grad": (2.0, math.inf), "spike": (50.0, 1.0)}[bad]
    v = ft.check(12, loss, grad)
    reason = {"nan_loss": "non-finite loss", "inf_grad": "non-finite gradient norm", "spike": "loss spike"}[bad]
    assert not v.ok and v.reason == reason and v.rollback_step == 8 and v.skip_batches == 4
    assert events[-1]["event"] == "rollback" and events[-1]["step"] == 12 and events[-1]["rollback_to"] == 8
    ft.rolled_back(v)
    assert mgr.latest_step() == 8
    mgr.close()


@pytest.mark.timeout(60)
def test_retries_exhausted_and_no_stable_checkpoint_stop_with_a_report(tmp_path):
    mgr, ft, events = _guard(tmp_path, max_retries=2)
    mgr.save(0, {"model": {"w": torch.randn(2)}})
    ft.on_checkpoint(0)
    with pytest.raises(FaultToleranceError, match="no stable checkpoint"):
        ft.check(1, math.nan)
    for step in range(1, 5):
        assert ft.check(step, 1.0).ok
    assert not ft.check(5, math.nan).ok and not ft.check(2, math.nan).ok
    expected = r"(?s)giving up after 2 rollbacks.*step 5.*step 2.*step 3: non-finite loss \(loss inf"
    with pytest.raises(FaultToleranceError, match=expected) as info:
        ft.check(3, math.inf)
    assert len(info.value.report) == 4 and events[-1]["event"] == "fault_retries_exhausted"
    mgr.close()


@pytest.mark.timeout(120)
def test_injected_nan_in_training_rolls_back_skips_and_finishes(tmp_path, capsys):
    common = ["--steps", "16", "--interval", "3", "--resume", "none", "--fault", "--stable-after", "2"]
    clean = example_main(["--root", str(tmp_path / "clean"), *common])
    poisoned = example_main(["--root", str(tmp_path / "poison"), *common, "--poison-batch", "10"])
    out = capsys.readouterr().out
    rollbacks = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("METRIC") and "rollback" in line]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    # batch 10 is read at step 11. Checkpoint 9 has one healthy step behind it (10), so the newest stable one
    # is 6 (healthy 7, 8); the window of batches 6..10 read since then is skipped: 11 - 6 = 5 batches.
    assert rb["step"] == 11 and rb["reason"].startswith("non-finite loss") and rb["rollback_to"] == 6
    assert rb["skip_batches"] == 5
    assert all(math.isfinite(v) for v in poisoned.values()) and len(poisoned) == 16
    assert all(poisoned[s] == clean[s] for s in range(1, 7))  # up to the rollback target: bit-identical
    assert poisoned[7] != clean[7]  # replayed on the data after the skipped window


def _agree_then_stall_worker(rank, world, root):
    mgr = CheckpointManager(root, async_save=False)
    ft = FaultTolerance(FaultPolicy(window=10, min_history=3, stable_after=2, collective_timeout_s=3.0), mgr)
    mgr.save(0, {"model": {"w": torch.full((3,), float(rank))}})
    ft.on_checkpoint(0)
    for step in range(1, 4):
        assert ft.check(step, 1.0 + 0.01 * step, 1.0).ok
    v = ft.check(4, 1.05, math.nan if rank == 1 else 0.5)  # only rank 1 sees the bad gradient
    if not v.ok:
        ft.rolled_back(v)
    agreed = (v.ok, v.reason, v.rollback_step, mgr.latest_step())
    if rank == 1:
        time.sleep(8)  # now rank 1 stalls and never joins step 5's check
        return agreed, "stalled"
    try:
        ft.check(5, 1.0)
    except CollectiveTimeout as exc:
        return agreed, str(exc)
    return agreed, "no error"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(150)
def test_ranks_agree_on_a_fault_seen_by_one_and_a_stalled_rank_times_out(tmp_path):
    (agreed0, msg), (agreed1, stalled) = run_distributed(_agree_then_stall_worker, 2, str(tmp_path), timeout=120)
    assert agreed0 == agreed1 == (False, "non-finite gradient norm", 0, 0)
    assert stalled == "stalled"
    assert msg.startswith("rank 0: fault-check all-reduce at step 5") and "dead or stalled" in msg
