"""``recipes.memory_report``: the memory model's per-rank prediction against the measured peak of real steps.

CPU, one process, the debug model at 2 micro-batches of 1 x 128 tokens (32 rows per expert on
average, so every expert fills exactly one 128-row block and the balanced-routing assumption is exact).
The peak is the profiler's live-tensor bytes over model build + 3 steps; the prediction must be within
10% of it for each layout/option. Each run takes 15-40 s on a loaded 2-core box, so `make test` runs the
first layout only; all six: `DSV3_MEMORY_MATRIX=1 .venv/bin/python -m pytest -q tests/test_memory_report.py`.
Known gap (benchmarks/memory.md): multi-process layouts (DualPipeV with EP: measured 24.1 vs predicted
11.1 MiB) are not within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BASE = ["--config", "recipes/configs/tiny_cpu.toml", "--nproc", "1", "--steps", "3",
        "--set", "parallel.pp=1", "--set", "parallel.dp=1", "--set", "parallel.ep=1",
        "--set", "parallel.schedule=\"none\"", "--set", "data.global_batch=2", "--set", "data.micro_batch=1"]

LAYOUTS = {
    "bf16 baseline (no FP8)": ["model.fp8=false"],
    "FP8, activation caching on": ["model.fp8=true"],
    "FP8, activation caching off": ["model.fp8=true", "model.overrides.fp8_cache_activations=false"],
    "recompute v3 + FP8 caching": ["model.overrides.recompute=[\"v3\"]"],
    "recompute block": ["model.overrides.recompute=[\"block\"]"],
    "BF16 moments + host EMA": ["optim.moments_dtype=\"bfloat16\"", "optim.ema_decay=0.99"],
}


MATRIX = os.environ.get("DSV3_MEMORY_MATRIX") == "1"


@pytest.mark.parametrize("name", [n if MATRIX or i == 0 else pytest.param(n, marks=pytest.mark.skip(
    reason="opt-in: DSV3_MEMORY_MATRIX=1")) for i, n in enumerate(LAYOUTS)])
def test_prediction_within_10_percent_of_measured_peak(name, tmp_path):
    out = tmp_path / "rows.json"
    argv = BASE + [a for s in LAYOUTS[name] for a in ("--set", s)] + ["--json", str(out)]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    # a fresh process: a second run in the same one misses allocations its predecessor already made (caches)
    done = subprocess.run([sys.executable, "-m", "recipes.memory_report", *argv], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    r = rows[0]
    assert r["measured"] > 4 * 2**20  # the model's weights, gradients and moments alone are ~5.6 MiB
    assert 0.9 <= r["ratio"] <= 1.1, f"{name}: predicted {r['predicted'] / 2**20:.2f} MiB, " \
                                     f"measured {r['measured'] / 2**20:.2f} MiB"
