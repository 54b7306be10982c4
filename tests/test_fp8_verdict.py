"""The FP8-vs-BF16 verdict (recipes.fp8_vs_bf16) on synthetic loss curves with a known gap."""

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.fp8_vs_bf16 import WindowGap, parse_recipes, t_quantile, variant, verdict, verdict_line, window_gaps
from training.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def curves(gap: float, seeds: int, steps: int, noise: float, rng: random.Random):
    """Per seed a decaying baseline curve with seed-dependent level, and the FP8 curve ``(1 + gap)`` times it with
    independent per-step relative noise of sd ``noise`` (what the pairing leaves)."""
    base, fp8 = [], []
    for _ in range(seeds):
        level = 2.5 + rng.random()
        b = [level + 3.0 * math.exp(-i / 30) for i in range(steps)]
        base.append(b)
        fp8.append([x * (1 + gap) * (1 + rng.gauss(0, noise)) for x in b])
    return fp8, base


def test_t_quantile_matches_published_table():
    # Student-t 0.975 quantiles as printed in every statistics table (independent of our integration)
    for df, want in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=2e-4)


def test_window_gap_is_the_paired_relative_gap_per_window():
    fp8 = [[2.0, 2.0, 1.0, 1.0], [4.0, 4.0, 3.0, 3.0]]
    base = [[1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 2.0, 2.0]]
    rows = window_gaps(fp8, base, window=2)
    assert [(g.start, g.end) for g in rows] == [(1, 3), (3, 5)]
    assert rows[0].per_seed == [1.0, 0.0] and rows[1].per_seed == [0.0, 0.5]
    assert rows[0].mean == 0.5
    # sd over seeds of (1, 0) is sqrt(0.5); n = 2 -> t(0.975, 1) * sqrt(0.5) / sqrt(2)
    assert rows[0].half_width == pytest.approx(12.7062 * 0.5, rel=1e-4)


def test_interval_covers_a_known_gap_95_percent_of_the_time():
    """400 synthetic studies of 3 seeds with a true gap of +0.1%: the 95% t-interval must contain it in 360..395
    of them (binomial sd 4.4 around 380; a normal 1.96 instead of t(0.975, 2) = 4.30 would cover ~75%)."""
    rng = random.Random(7)
    covered = 0
    for _ in range(400):
        fp8, base = curves(0.001, seeds=3, steps=40, noise=0.004, rng=rng)
        g = window_gaps(fp8, base, window=20)[-1]
        covered += abs(g.mean - 0.001) <= g.half_width
    assert 360 <= covered <= 395


@pytest.mark.parametrize("gap,want", [(0.0005, "within"), (0.01, "outside"), (-0.01, "outside")])
def test_verdict_on_synthetic_curves(gap, want):
    # noise 0.1% per step over a 50-step window and 8 seeds: half-width ~ 2.4 * 1.4e-4 / sqrt(8) ~ 1e-4,
    # far below the distance of each true gap from 0.25%
    fp8, base = curves(gap, seeds=8, steps=100, noise=0.001, rng=random.Random(3))
    last = window_gaps(fp8, base, window=50)[-1]
    assert last.mean == pytest.approx(gap, abs=4 * last.half_width)
    assert verdict(last, 0.0025) == want


def test_verdict_straddling_or_single_seed_is_inconclusive():
    assert verdict(WindowGap(1, 11, 0.0024, 0.0005, [0.0, 0.0]), 0.0025) == "inconclusive"
    assert verdict(WindowGap(1, 11, 0.0, math.nan, [0.0]), 0.0025) == "inconclusive"
    fp8, base = curves(0.0, seeds=1, steps=10, noise=0.001, rng=random.Random(1))
    assert math.isnan(window_gaps(fp8, base, window=10)[0].half_width)


def test_recipes_option_names_the_bad_recipe():
    with pytest.raises(ValueError, match="--recipes"):
        parse_recipes("blockwise,fp4")


@pytest.mark.slow
def test_verdict_line_names_the_baseline_the_runs_had():
    """The baseline's label follows its config: BF16 / AdamW + BF16 experts by default, the FP8 recipe when
    ``--set model.fp8=true`` turns FP8 on in every run (the 2026-12-07 22:37 study's baseline, printed as BF16)."""
    gap = WindowGap(41, 61, -0.001, 0.01, [0.0, -0.002])

    def line(recipe: str, overrides: list[str]) -> str:
        cfg = load_config(None, variant(1, 60, 1234, "bf16", overrides))
        return verdict_line(recipe, gap, 0.0025, "a size", cfg)

    assert line("blockwise", []).startswith("FP8 (blockwise) vs BF16 at a size: ")
    assert line("mxfp4_qat", []).startswith("MXFP4 QAT experts vs AdamW + BF16 experts at a size: ")
    assert line("mxfp4_qat", ["model.fp8=true"]).startswith(
        "MXFP4 QAT experts vs AdamW + FP8 (blockwise) experts at a size: ")
    assert line("muon", ['optim.name="muon"']).startswith("Muon vs Muon + BF16 experts")


@pytest.mark.slow
def test_one_command_prints_the_verdict_line(tmp_path):
    """The user's view: one command, the verdict line, the plot and the JSON; a second call reads the runs back."""
    cmd = [sys.executable, "-m", "recipes.fp8_vs_bf16", "--steps", "3", "--seeds", "2", "--window", "3",
           "--recipes", "blockwise", "--out", str(tmp_path / "study")]
    for o in ("data.seq_len=16", "data.global_batch=2", "data.micro_batch=2", "run.threads=1"):
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    line = re.compile(r"^FP8 \(blockwise\) vs BF16 at debug 4 layers dim 64 .*3 steps x 32 tokens: "
                      r"gap [+-]\d+\.\d{3}% \+- \d+\.\d{3}% \(95% t-interval\) over 2 seeds, steps 1-3: "
                      r"(within|outside|inconclusive) 0\.25%$", re.M)
    assert line.search(first.stdout), first.stdout[-2000:]
    report = json.loads((tmp_path / "study" / "fp8_vs_bf16.json").read_text())
    assert len(report["curves"]["bf16"]) == 2 and len(report["curves"]["blockwise"][1]) == 3
    gap = report["gaps"]["blockwise"][0]
    want = [sum(f) / sum(b) - 1 for f, b in zip(report["curves"]["blockwise"], report["curves"]["bf16"])]
    assert gap["per_seed"] == pytest.approx(want, rel=1e-12)
    assert (tmp_path / "study" / "fp8_vs_bf16.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and line.search(again.stdout).group(0) == line.search(first.stdout).group(0)
