"""The V3 recipe at CPU size (recipes/configs/v3_layout_cpu.toml: DualPipe, EP over DP, ZeRO-1, FP8,
MTP, V3 recompute, aux-free + sequence-wise balance, node-limited routing, async checkpoints) trains
on 8 gloo processes through ``recipes.train`` and equals one process training the same model."""

from __future__ import annotations

import pytest

from tests.matrix import train_cli
from tests.test_combinations import FP8_LOSS_ATOL, FP8_RTOL, LOSS_ATOL

CONFIG = "recipes/configs/v3_layout_cpu.toml"
# Three steps with a checkpoint after the second (async save while step 3 runs); AdamW in its smooth
# regime (eps 1 above every |g|, as in tests/matrix.py) so that test_combinations' FP8 tolerances
# apply: the run is FP8, and its backward quantises loss gradients scaled by 1/4 (4 micro-batches
# per rank) where the one-process run scales by 1/16 (see test_combinations' docstring).
QUICK = ["run.steps=3", "checkpoint.interval=2", "checkpoint.final=false", "optim.warmup_steps=0",
         "optim.lr=0.5", "optim.min_lr=0.5", "optim.eps=1.0", "balance.gamma_stop_step=0", "run.sample_tokens=0",
         "logging.progress=false", "logging.wandb=disabled", "logging.plot=false", "logging.eval_batches=1",
         "run.threads=1", "data.seq_len=16"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_v3_layout_on_8_processes_matches_one_process(tmp_path):
    eight = train_cli(CONFIG, QUICK, tmp_path / "eight", 8, [])
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, SINGLE)
    assert [r["step"] for r in eight] == [1, 2, 3]
    for key in ("loss", "mtp_loss"):
        a, b = [r[key] for r in eight], [r[key] for r in one]
        assert abs(a[0] - b[0]) <= LOSS_ATOL, (key, a, b)  # the forward quantises identically
        assert a[1:] == pytest.approx(b[1:], abs=FP8_LOSS_ATOL), (key, a, b)
    assert [r["grad_norm"] for r in eight] == pytest.approx([r["grad_norm"] for r in one], rel=FP8_RTOL)
    assert [r["max_vio"] for r in eight][0] == pytest.approx(one[0]["max_vio"], abs=1e-6)  # step 1: same routing
    assert "checkpoint_stall_s" in eight[1]
    assert (tmp_path / "eight" / "checkpoints" / "step_000000002").is_dir()
