"""The BF16 shadow check through the real CLI: FP8 deliberately broken in one layer (its forward output 16x too
large, as from a dequantization scale off by 16x) must raise the warning naming that block, go through the fault
path (rollback to the stable checkpoint) and continue with that block in BF16; a healthy run must not trip it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.fault import Fp8Shadow, blame_layers

ROOT = Path(__file__).resolve().parent.parent
DEMO = "recipes/configs/tiny_cpu.toml"
# The demo model on one process, one micro-batch of 2 x 16 tokens per step, FP8 on, the shadow every step.
ONE_PROCESS = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", "run.sample_tokens=0",
               "data.seq_len=16", "data.global_batch=2", "data.micro_batch=2", "logging.progress=false",
               "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false", "run.threads=1",
               "optim.warmup_steps=2", "run.timeout_s=120", "model.fp8=true", "checkpoint.interval=2",
               "checkpoint.async_save=false", "checkpoint.final=false", "fault.stable_after=1",
               "fault.fp8_shadow_every=1", "fault.fp8_shadow_patience=2", "logging.fp8_health_every=0"]
BROKEN = ["fault.inject_fp8_scale_error_at_step=5",
          "fault.inject_fp8_scale_error_layer=layers.3.ffn.shared_experts.w13"]


def _train(run_dir: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [sys.executable, "-m", "recipes.train", "--config", DEMO, "--nproc", "1", "--run-dir", str(run_dir)]
    for o in ONE_PROCESS + overrides:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return proc, [json.loads(line) for line in lines]


@pytest.mark.slow
def test_broken_fp8_layer_warns_rolls_back_and_continues_in_bf16(tmp_path):
    proc, records = _train(tmp_path / "run", ["run.steps=9", *BROKEN])
    assert proc.returncode == 0, proc.stderr[-2000:]
    cut = next(i for i, r in enumerate(records) if r.get("event") == "rollback")
    before, rollback, after = records[:cut], records[cut], records[cut + 2:]  # cut + 1: the faulty step's line
    gaps = {r["step"]: r["fp8_shadow_gap"] for r in before}
    # healthy FP8 before the error: the block-scaled e4m3 forward moves this loss by ~1e-3 relative at most
    assert all(abs(gaps[s]) < 0.0025 for s in (1, 2, 3, 4)), gaps
    assert abs(gaps[5]) > 0.0025, gaps
    assert "FP8 shadow at step 6" in proc.stderr and "FP8 GEMMs of layers.3" in proc.stderr
    assert (rollback["step"], rollback["reason"], rollback["rollback_to"]) == (
        6, "FP8 loss gap to BF16 above threshold", 4)
    assert not [r for r in after if "event" in r]  # one fault only
    blame = records[cut + 1]["fp8_shadow_blame"]
    assert blame[0] == "layers.3", blame  # the broken block first (greedy: the largest gap reduction)
    # after the rollback layers.3 runs in BF16: the injected error (FP8 only) is gone and the gap is small again
    assert [r["step"] for r in after] == [5, 6, 7, 8, 9]
    assert all(abs(r["fp8_shadow_gap"]) < 0.0025 for r in after), after


@pytest.mark.slow
def test_warn_action_only_warns(tmp_path):
    proc, records = _train(tmp_path / "run", ["run.steps=6", "fault.fp8_shadow_action=warn", *BROKEN])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FP8 shadow at step 6" in proc.stderr and "action warn" in proc.stderr
    assert not [r for r in records if r.get("event") == "rollback"]


def test_shadow_needs_patience_consecutive_gaps():
    shadow = Fp8Shadow(0.0025, patience=3)
    assert [shadow.add(g) for g in (0.01, 0.01, 0.001, 0.01, -0.01, float("nan"))] == [
        False, False, False, False, False, True]
    assert not shadow.add(0.01)  # the history restarts after a fault


def test_blame_picks_the_broken_block_first():
    # a gap of 2% from layers.2 and 0.2% from layers.0, additive: layers.2 alone leaves 0.2% < 0.25%
    share = {"layers.0": 0.002, "layers.1": 0.0, "layers.2": 0.02}
    gap = lambda off: sum(v for b, v in share.items() if b not in off)  # noqa: E731
    assert blame_layers(list(share), gap, 0.0025) == ["layers.2"]
    assert blame_layers(list(share), gap, 0.001) == ["layers.2", "layers.0"]
