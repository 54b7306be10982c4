"""DualPipe with the rest of the recipe: MTP (its embedding shared with stage 0, held by both ends and
summed once across the mirrored copies) and EPLB (the two copies of a stage plan from their summed
loads), over EP=2 x DP=2, equal one process."""

from __future__ import annotations

import pytest

from tests.test_training import SINGLE, _train
from tests.test_training_recompute import REL

COMMON = ["run.steps=3", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0", "optim.warmup_steps=2",
          "data.global_batch=16", "data.micro_batch=2", "data.seq_len=32"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dualpipe_with_mtp_and_eplb_matches_one_process(tmp_path):
    """PP=2 DualPipe x EP=2 over DP=2 (4 processes), MTP depth 1, EPLB re-planning after every step with
    2 redundant slots, against one process without EPLB (it moves experts, it does not change the math).
    Tolerance: fp32 summation order only, as in test_training_recompute (REL = 512 x 2^-24)."""
    one, _ = _train(tmp_path, "one", 1, COMMON + SINGLE)
    four, _ = _train(tmp_path, "four", 4, COMMON + [
        "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=dualpipe", "eplb.enabled=true",
        "eplb.redundant_experts=2", "eplb.interval=1"])
    assert all("mtp_loss" in r for r in four)
    assert any(r.get("eplb_moved_slots", 0) > 0 for r in four)  # the plan really changed
    for key in ("loss", "mtp_loss", "grad_norm", "max_vio"):
        assert [r[key] for r in four] == pytest.approx([r[key] for r in one], rel=REL), key
