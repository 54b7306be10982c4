"""End-to-end training on CPU with gloo: the demo layout trains, PP x EP x DP equals one process,
the 671B dry run, and bad input rejected before any process starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.train import main as train_main

ROOT = Path(__file__).resolve().parent.parent
DEMO = "recipes/configs/tiny_cpu.toml"
# Small and quick: the demo model with 2 micro-batches of 2 sequences of 64 tokens per data-parallel rank.
QUICK = ["run.sample_tokens=8", "data.seq_len=64", "logging.progress=false", "logging.eval_batches=1",
         "logging.wandb=disabled", "run.threads=1"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]


def _train(tmp_path: Path, name: str, nproc: int, overrides: list[str], timeout: float = 420.0
           ) -> tuple[list[dict], str]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "recipes.train", "--config", DEMO, "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for o in QUICK + overrides:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_demo_layout_trains_and_reports(tmp_path):
    """The demo config itself (PP=2 DualPipeV, EP=2 over DP=2, FP8, MTP, aux-free balancing, async
    checkpoints), shortened: the loss falls, a checkpoint is committed, the end report is printed."""
    rows, out = _train(tmp_path, "demo", 4, ["run.steps=8", "checkpoint.interval=4", "optim.warmup_steps=2"])
    losses = [r["loss"] for r in rows]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.15)  # a fresh byte-level model: ~ln 256
    assert losses[-1] < losses[0] - 0.3, losses  # 8 steps at lr 3e-3 already cut the loss by > 0.3 nats
    for key in ("mtp_loss", "grad_norm", "lr", "tokens_per_s", "max_vio", "checkpoint_stall_s"):
        assert any(key in r for r in rows), key
    run_dir = tmp_path / "demo"
    assert (run_dir / "loss.png").stat().st_size > 1000 and (run_dir / "config.toml").exists()
    assert (run_dir / "checkpoints" / "latest").exists()
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed == ["step_000000004", "step_000000008"], committed
    for needle in ("run folder", "loss curve", "checkpoints", "sample"):
        assert needle in out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp_ep_dp_run_matches_one_process(tmp_path):
    """A 4-process PP=2 (DualPipeV) x EP=2 x DP=2 run and a 1-process run of the same model, data and
    seed give the same loss curve. FP8 is off (its wgrad tiles group tokens differently once experts
    receive tokens from both EP ranks) and the check uses float32 (the attention kernel's widest type).

    Tolerance: the two runs differ only in float32 summation order (all-to-all regrouping of expert
    rows, gradient all-reduce, loss averaging over ranks); measured agreement is ~1e-7 over 4 steps,
    so 1e-5 absolute on losses (which move by ~0.6 nats in that time) leaves room without hiding a
    missing gradient reduction or a wrong expert shard, each of which shifts step 2 by > 1e-2.
    """
    common = ["run.steps=4", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0",
              "optim.warmup_steps=2", "data.global_batch=16", "data.micro_batch=2"]
    one, _ = _train(tmp_path, "one", 1, common + SINGLE)
    four, _ = _train(tmp_path, "four", 4, common)
    a, b = [r["loss"] for r in one], [r["loss"] for r in four]
    assert a == pytest.approx(b, abs=1e-5), (a, b)
    assert [r["mtp_loss"] for r in one] == pytest.approx([r["mtp_loss"] for r in four], abs=1e-5)
    assert [r["grad_norm"] for r in one] == pytest.approx([r["grad_norm"] for r in four], rel=1e-5)
    assert [r["max_vio"] for r in one] == pytest.approx([r["max_vio"] for r in four], abs=1e-6)  # same bias updates
    assert a[-1] < a[0] - 0.3


@pytest.mark.slow
def test_671b_dry_run_reports_params_and_memory(capsys):
    """The 671B config passes the launch's checks (the dry run runs check_static; its data files are
    cluster paths, reported absent) and reports V3's published sizes."""
    assert train_main(["--config", "recipes/configs/deepseek_v3_671b.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "671.0B parameters" in out and "36.6B activated" in out  # V3 report: 671B total, 37B activated
    assert "world 2048 = pp 16 x dp 128" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()
            and len(line.split()) == 12]
    assert len(rows) == 16  # one estimate per pipeline rank
    totals = [float(r[-1]) for r in rows]
    assert all(10 < t < 1000 for t in totals)  # GiB: plausible, not bytes or TiB


@pytest.mark.parametrize("argv, message", [
    (["--set", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["--nproc", "3"], "world size 3 != parallel.pp x parallel.dp"),
    (["--set", "data.global_batch=4"], "data.global_batch"),
    (["--set", "data.source=/nonexistent/corpus.txt"], "data.source"),
    (["--set", "model.overrides.n_heads=0"], "n_heads"),
    (["--set", "model.overrides.n_layers=1"], "too few for 4"),
])
def test_bad_input_fails_before_any_process_starts(argv, message, capsys, monkeypatch):
    import training.launch

    def no_launch(*a, **k):
        raise AssertionError("a process group was started despite bad input")

    monkeypatch.setattr(training.launch, "relaunch", no_launch)
    monkeypatch.setattr("recipes.train.relaunch", no_launch)
    assert train_main(["--config", DEMO, *argv]) == 2
    assert message in capsys.readouterr().err


def test_corpus_too_small_fails_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("recipes.train.relaunch", lambda *a, **k: pytest.fail("launched"))
    small = tmp_path / "small.txt"
    small.write_text("too short " * 100)
    assert train_main(["--config", DEMO, "--set", f"data.source={small}"]) == 2
    assert "fewer than one global batch" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_dualpipe_mirrored_run_matches_one_process(tmp_path):
    """DualPipe over 2 pipeline ranks (each stage held twice, micro-batches fed from both ends, mirrored
    gradients and expert loads summed) equals one process. No MTP (refused with DualPipe for now).
    Same float32 summation-order tolerance as above (measured ~1e-6)."""
    common = ["run.steps=3", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0",
              "optim.warmup_steps=2", "data.global_batch=8", "data.micro_batch=2", "model.overrides.n_mtp_layers=0",
              "parallel.dp=1", "parallel.ep=1"]
    one, _ = _train(tmp_path, "one", 1, common + SINGLE)
    two, _ = _train(tmp_path, "dualpipe", 2, common + ["parallel.schedule=dualpipe"])
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], abs=1e-5)
    assert [r["grad_norm"] for r in one] == pytest.approx([r["grad_norm"] for r in two], rel=1e-5)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero_bubble_schedules_match_one_process(tmp_path):
    """ZB-H1 (one stage per rank) and ZB-V (two stages in a V) over 2 pipeline ranks, with the model's
    weight-gradient GEMMs deferred to the pipeline's W actions, equal one process. No MTP (ZB-H1 keeps
    embedding and head on different ranks). Same float32 summation-order tolerance as above."""
    common = ["run.steps=3", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0",
              "optim.warmup_steps=2", "data.global_batch=8", "data.micro_batch=2", "model.overrides.n_mtp_layers=0",
              "parallel.dp=1", "parallel.ep=1"]
    one, _ = _train(tmp_path, "one", 1, common + SINGLE)
    for schedule in ("zb1p", "zbv"):
        two, _ = _train(tmp_path, schedule, 2, common + ["parallel.pp=2", f"parallel.schedule={schedule}"])
        assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], abs=1e-5), schedule
        assert [r["grad_norm"] for r in one] == pytest.approx([r["grad_norm"] for r in two], rel=1e-5), schedule


def test_dry_run_checks_the_eplb_table(capsys):
    """--dry-run validates [eplb] too: a bad value fails there, not at launch."""
    argv = ["--config", DEMO, "--dry-run", "--set", "eplb.enabled=true", "--set", "eplb.redundant_experts=3"]
    assert train_main(argv) == 2
    assert "eplb.redundant_experts=3" in capsys.readouterr().err
