"""Every recompute option trains under the pipeline schedules, overlapped forward/backward included,
and equals one process."""

from __future__ import annotations

import pytest

from tests.test_training import SINGLE, _train

COMMON = ["run.steps=2", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0", "optim.warmup_steps=2",
          "data.global_batch=8", "data.micro_batch=2", "parallel.schedule=dualpipev"]
# fp32 on both sides: the runs differ only in summation order. The longest reduction behind a logged
# loss is its mean over the step's 8 x 64 = 512 tokens (the model's dot products are shorter: dim 128,
# vocab 256), so |loss_1 - loss_2| <~ 512 * u * |loss| with u = 2^-24: 3e-5 relative. A missing or
# doubled gradient (the failures this guards) moves step 2's loss by > 1e-2.
REL = 512 * 2.0**-24


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recompute_with_overlapped_dualpipev_matches_one_process(tmp_path):
    """V3's recompute (RMSNorm + MLA up-projections) and SwiGLU with DualPipeV over 2 pipeline ranks
    (the overlapped F&B runs its backward piece by piece) equals one process without recompute. The
    other recompute options with every schedule, EP included, are in the all-pairs matrix
    (tests/test_combinations.py)."""
    one, _ = _train(tmp_path, "one", 1, COMMON + SINGLE)
    two, _ = _train(tmp_path, "two", 2, COMMON + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1",
                                                   'model.overrides.recompute=["v3", "swiglu"]'])
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=REL), key
