"""Training schedules by steps and tokens (``training.schedule``): the 671B recipe against the V3 report's
numbers, the ``--schedule-json`` rows, one-line errors for bad stages, and a run that follows the schedule
(MTP weight and bias speed change when the tokens say so) and resumes it exactly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.train import main as train_main
from training.checkpoint.manager import read_checkpoint
from training.config import load_config, schedule_of
from training.schedule import parse_curve

ROOT = Path(__file__).resolve().parent.parent
V3 = "recipes/configs/deepseek_v3_671b.toml"
DEMO = "recipes/configs/tiny_cpu.toml"
T = 1e12  # a trillion tokens


def v3_lr(tokens: float) -> float:
    """The V3 report's LR after warm-up (section 4.2), in float64: 2.2e-4 to 10T tokens, cosine to 2.2e-5 over
    4.3T, 2.2e-5 for 333B, then 7.3e-6."""
    if tokens < 10 * T:
        return 2.2e-4
    if tokens < 14.3 * T:
        return 2.2e-5 + (2.2e-4 - 2.2e-5) * 0.5 * (1 + math.cos(math.pi * (tokens - 10 * T) / (4.3 * T)))
    return 2.2e-5 if tokens < 14.3 * T + 333e9 else 7.3e-6


def test_v3_lr_at_the_reports_points():
    """LR by tokens seen, at any step past the warm-up: the report's values at its boundaries and the cosine in
    between. Tolerance 1e-12 relative: one cosine and a few float64 operations (error ~1e-16) apart."""
    s = schedule_of(load_config(V3)).lr
    assert s.at(0, 0) == 0.0 and s.at(1000, 0) == pytest.approx(1.1e-4, rel=1e-12)  # linear warm-up, 2K steps
    for tokens in (50e9, 9.99 * T, 10 * T, 11 * T, 12.15 * T, 14 * T, 14.3 * T - 1, 14.3 * T, 14.5 * T,
                   14.633 * T - 1, 14.633 * T, 14.7 * T, 14.8 * T):
        assert s.at(100_000, int(tokens)) == pytest.approx(v3_lr(tokens), rel=1e-12), tokens
    assert s.at(5000, int(10 * T)) == 2.2e-4 and s.at(5000, int(14.3 * T)) == 2.2e-5
    assert s.at(5000, int(12.15 * T)) == pytest.approx((2.2e-4 + 2.2e-5) / 2, rel=1e-12)  # the cosine's midpoint


def test_v3_batch_ramp_mtp_and_bias_switch_by_tokens():
    """Walking the whole 671B run: the batch ramps 4096 -> 15360 (DualPipe's minimum at dp 128, not the report's
    3072) linearly in tokens over 469B, rounded down to whole DualPipe steps; the MTP weight is 0.3 exactly for
    the steps that start before 10T tokens; the bias speed is 0 exactly for those starting in the last 500B;
    the run ends at 14.8T tokens."""
    cfg = load_config(V3)
    sched = schedule_of(cfg)
    prev = None
    switched = {}
    for p in sched.walk():
        if p.step == cfg.run.steps:
            break
        assert p.global_batch % 256 == 0 and 4096 <= p.global_batch <= 15360
        raw = 4096 + (15360 - 4096) * min(1.0, p.tokens / 469e9)
        assert raw - 256 < p.global_batch <= raw + 1e-6, p
        assert p.mtp_lambda == (0.3 if p.tokens < 10 * T else 0.1)
        assert p.bias_update_speed == (0.001 if p.tokens < 14.3 * T else 0.0)
        if prev is not None:
            assert p.global_batch >= prev.global_batch and p.tokens == prev.tokens + prev.global_batch * 4096
            for key in ("mtp_lambda", "bias_update_speed"):
                if getattr(p, key) != getattr(prev, key):
                    switched[key] = p
        prev = p
    assert prev.tokens < 14.8 * T <= prev.tokens + prev.global_batch * 4096  # the last step reaches 14.8T
    assert switched["mtp_lambda"].tokens >= 10 * T > switched["mtp_lambda"].tokens - 15360 * 4096
    assert switched["bias_update_speed"].tokens >= 14.3 * T > switched["bias_update_speed"].tokens - 15360 * 4096
    assert cfg.global_batch_at(0) == 4096 and cfg.global_batch_at(cfg.run.steps - 1) == 15360


def test_v3_schedule_rows():
    """The 671B run's rows: one at every step where a value changes, at least every 1000 steps, and the last
    step; a step the rows skip has the values of the row before it."""
    cfg = load_config(V3)
    sched = schedule_of(cfg)
    rows = sched.rows(cfg.run.steps)
    keys = ["step", "tokens", "lr", "global_batch", "mtp_lambda", "bias_update_speed"]
    assert all(list(r) == keys for r in rows)
    steps = [r["step"] for r in rows]
    assert steps[0] == 0 and steps[-1] == cfg.run.steps - 1
    assert all(0 < b - a <= 1000 for a, b in zip(steps, steps[1:]))
    for r in rows[::997]:
        assert sched.at(r["step"], r["tokens"]).as_row() == r
    for a, b in zip(rows, rows[1:]):
        if b["step"] - a["step"] > 1:  # the step before b, reached at a's batch
            before = sched.at(b["step"] - 1, b["tokens"] - a["global_batch"] * 4096).as_row()
            assert [before[k] for k in keys[2:]] == [a[k] for k in keys[2:]], (a, b)
    switch = next(r for r in rows if r["mtp_lambda"] == 0.1)
    assert switch["tokens"] >= 10 * T and switch["lr"] == pytest.approx(v3_lr(switch["tokens"]), rel=1e-12)


def test_schedule_json_cli(tmp_path, capsys):
    """``--dry-run --schedule-json FILE`` writes the schedule's rows (the demo with a token-defined schedule)."""
    out = tmp_path / "schedule.json"
    stages = ["schedule.lr=[{shape = \"linear\", from = 0.0, value = 1e-3, steps = 10}, {value = 1e-3, until_tokens "
              "= 1e6}, {shape = \"cosine\", value = 1e-4, tokens = 2e6}, {value = 1e-4}]", "run.steps=3000"]
    argv = ["--config", DEMO, "--dry-run", "--schedule-json", str(out)]
    assert train_main([*argv, *(a for s in stages for a in ("--set", s))]) == 2  # optim.lr is set in the demo
    assert "optim.lr' and schedule.lr both set" in capsys.readouterr().err
    cfg = load_config(DEMO, ["run.steps=3000"])
    assert train_main([*argv, "--set", "run.steps=3000"]) == 0
    rows = json.loads(out.read_text())
    # warm-up and cosine change the LR at every step but one (the warm-up's last step already has lr)
    assert rows == schedule_of(cfg).rows(3000) and len(rows) == 2999
    assert "schedule: 2999 rows" in capsys.readouterr().out


def test_default_schedule_is_warmup_then_cosine():
    """Without stage lists the optim keys give the earlier shape: lr x (s + 1) / warmup for s < warmup, then cosine
    to min_lr over the remaining steps (float64 reference below; 1e-12 relative)."""
    cfg = load_config(DEMO, ["optim.warmup_steps=4", "run.steps=20", "optim.lr=1e-3", "optim.min_lr=1e-4"])
    s = schedule_of(cfg)
    for step in range(20):
        want = 1e-3 * (step + 1) / 4 if step < 4 else \
            1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * (step - 4) / 16))
        assert s.at(step, 0).lr == pytest.approx(want, rel=1e-12), step


@pytest.mark.parametrize("stages, needle", [
    ('[{value = 1e-3, shape = "spiral"}]', "schedule.lr[0].shape must be one of constant, linear, cosine"),
    ('[{shape = "linear", value = 1e-3, steps = 10}]', "schedule.lr[0]: the first stage is a linear ramp"),
    ('[{value = 1e-3}, {value = 1e-4}]', "schedule.lr[0]: only the last stage may omit its end"),
    ('[{value = 1e-3, steps = 10, tokens = 5}]', "schedule.lr[0]: give one of steps, tokens"),
    ('[{value = 1e-3, until_tokens = 1e6}, {shape = "cosine", value = 0.0, steps = 10}]',
     "schedule.lr[1]: a stage measured in steps (steps) follows a stage that ends after a number of tokens"),
    ('[{value = 1e-3, until_steps = 10}, {value = 1e-4, until_steps = 5}]', "schedule.lr[1].until_steps=5"),
    ('[{value = -1.0}]', "schedule.lr[0].value must be in [0, inf]"),
    ('[{value = 1e-3, steps = 0}]', "schedule.lr[0].steps must be > 0"),
    ('[{value = 1e-3, wait = 3}]', "schedule.lr[0]: unknown key 'wait'"),
    ('[{shape = "linear", from = 2.0, value = 16.0, tokens = 1e6}]',
     "schedule.global_batch: 2 sequences is below 4096"),
])
def test_bad_stages_are_one_line_errors(stages, needle, capsys):
    key = "schedule.global_batch" if "global_batch" in needle else "schedule.lr"
    code = train_main(["--config", V3, "--dry-run", "--set", f"{key}={stages}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and needle in err, err


def test_stage_list_and_the_keys_it_replaces_are_refused_together(capsys):
    code = train_main(["--config", DEMO, "--dry-run", "--set", "schedule.mtp_lambda=[{value = 0.1}]",
                       "--set", "model.mtp_lambda=0.2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.mtp_lambda' and schedule.mtp_lambda both set" in err and "\n" not in err


def test_schedule_json_needs_dry_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train_main(["--config", DEMO, "--schedule-json", str(tmp_path / "s.json")])
    assert exc.value.code == 2 and "add --dry-run" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_tokens_stage_after_steps_stage_is_fine_when_constant():
    c = parse_curve("k", [{"shape": "linear", "from": 0.0, "value": 1.0, "steps": 10},
                          {"value": 1.0, "until_tokens": 100}, {"shape": "cosine", "value": 0.0, "tokens": 100},
                          {"value": 0.0}])
    assert c.at(5, 0) == 0.5 and c.at(50, 99) == 1.0 and c.at(50, 150) == pytest.approx(0.5, abs=1e-15)
    assert c.at(50, 200) == 0.0 and c.at(0, 10**9) == 0.0


# -- a run that follows the schedule, and its resume ---------------------------------------------------------

# 1 process, the demo model at 32 tokens, the batch ramping 4 -> 8 sequences over 640 tokens (steps of 4, 4, 5, 6, 7, 8
# sequences start after 0, 128, 256, 416, 608, 832 tokens); the MTP weight switches at 400 tokens (step 3), the bias
# speed at 600 (step 4).
RUN = ["run.sample_tokens=0", "data.seq_len=32", "logging.progress=false", "logging.eval_batches=1",
       "logging.wandb=disabled", "run.threads=1", "parallel.pp=1", "parallel.dp=1", "parallel.ep=1",
       "parallel.schedule=none", "model.fp8=false", "data.global_batch=8", "data.micro_batch=1",
       "checkpoint.async_save=false", "run.steps=6", "checkpoint.interval=1", "checkpoint.keep_last=6",
       'schedule.global_batch=[{shape = "linear", from = 4, value = 8, tokens = 640}, {value = 8}]',
       "schedule.mtp_lambda=[{value = 0.3, until_tokens = 400}, {value = 0.1}]",
       "schedule.bias_update_speed=[{value = 0.01, until_tokens = 600}, {value = 0.0}]"]
DROP = ("model.mtp_lambda", "balance.gamma")  # replaced by the stage lists above


def _run(config: Path, run_dir: Path, overrides: list[str], resume: bool = False) -> list[dict]:
    cmd = [sys.executable, "-m", "recipes.train", "--config", str(config), "--nproc", "1", "--run-dir", str(run_dir)]
    cmd += ["--resume", "auto"] if resume else []
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _biases(folder: Path) -> dict[str, torch.Tensor]:
    model = read_checkpoint(folder, 0, sections=["model"]).state["model"]
    return {k: v for k, v in model.items() if k.endswith("gate.e_score_correction_bias")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_follows_the_schedule_and_resumes_it_exactly(tmp_path):
    """Each step's batch, LR, MTP weight and bias speed are the schedule's at (step, tokens seen); the MTP weight
    enters the loss (total = main + lambda x mtp, float32 sums of ~5-nat terms: 1e-5 relative); the expert biases
    stop moving when the speed is 0; a run stopped at step 3 and resumed gives the same rows, bit for bit."""
    text = (ROOT / DEMO).read_text().splitlines()  # the demo less the keys the stage lists replace
    config = tmp_path / "demo.toml"
    config.write_text("\n".join(line for line in text if not any(line.startswith(f"{k.split('.')[1]} =")
                                                                  for k in DROP)) + "\n")
    full = _run(config, tmp_path / "full", RUN)
    sched = schedule_of(load_config(config, RUN))
    want = [p for _, p in zip(range(6), sched.walk())]
    assert [r["global_batch"] for r in full] == [p.global_batch for p in want] == [4, 4, 5, 6, 7, 8]
    for r, p in zip(full, want):
        assert (r["lr"], r["mtp_lambda"], r["bias_update_speed"]) == (p.lr, p.mtp_lambda, p.bias_update_speed)
        assert r["tokens_seen"] == p.tokens + p.global_batch * 32
        assert r["total_loss"] == pytest.approx(r["loss"] + p.mtp_lambda * r["mtp_loss"], rel=1e-5)
    assert [r["mtp_lambda"] for r in full] == [0.3, 0.3, 0.3, 0.1, 0.1, 0.1]
    assert [r["bias_update_speed"] for r in full] == [0.01] * 4 + [0.0] * 2
    ckpt = tmp_path / "full" / "checkpoints"
    biases = [_biases(ckpt / f"step_{n:09d}") for n in range(1, 7)]  # after steps 0 .. 5
    assert biases[0] and all(b.keys() == biases[0].keys() for b in biases)
    for n in range(1, 6):  # step n moved the biases while its speed was 0.01 (steps 1-3), not after (steps 4, 5)
        moved = any(not torch.equal(biases[n][k], biases[n - 1][k]) for k in biases[0])
        assert moved == (n <= 3), n

    part = _run(config, tmp_path / "part", [*RUN, "run.steps=3"])
    resumed = _run(config, tmp_path / "part", RUN, resume=True)
    keys = ("loss", "total_loss", "lr", "global_batch", "mtp_lambda", "bias_update_speed", "tokens_seen")
    assert [[r[k] for k in keys] for r in part + resumed[-3:]] == [[r[k] for k in keys] for r in full]


def test_written_config_reads_back_with_the_same_schedule(tmp_path):
    """A run folder's config.toml (``TrainConfig.to_toml``: every key, the stage lists as inline tables) loads
    again, with the same schedule (what a resume without --run-dir compares)."""
    cfg = load_config(V3)
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again.schedule == cfg.schedule and again.to_dict() == cfg.to_dict()
    s, t = schedule_of(cfg), schedule_of(again)
    assert [t.at(n, n * 10**8) for n in range(0, 240_000, 9_973)] == [s.at(n, n * 10**8) for n in range(0, 240_000,
                                                                                                          9_973)]
