"""The DSA recipe on the CPU demo model through the real CLI (``recipes.dsa`` -> ``recipes.train`` and
``recipes.export_hf`` subprocesses): a V3 model is trained and exported, the dense warm-up lowers the indexer's
KL and raises its top-k recall of the main attention, and the sparse stage (top-32 of 128 keys) trains as
well as continuing densely, within a stated margin."""

from __future__ import annotations

import json
import os

import pytest

from recipes import dsa


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DSV3_DSA_RECIPE") != "1", reason="opt-in (DSV3_DSA_RECIPE=1): four CLI trainings")
@pytest.mark.timeout(900)
def test_v3_to_v32_recipe_warmup_and_sparse_stage(tmp_path):
    out = tmp_path / "dsa"
    assert dsa.main(["--out", str(out), "--base-steps", "60", "--warmup-steps", "30", "--sparse-steps", "20"]) == 0
    r = json.loads((out / "dsa.json").read_text())["result"]
    # the indexer starts random (recall ~ k / mean causal keys ~ 0.4 for top-32 of up to 128) and learns the
    # attention it imitates: measured KL 0.038 -> 0.0077, recall 0.55 -> 0.86 over these 30 steps (0.76 -> 0.05,
    # 0.51 -> 0.89 over 60 from a 150-step base); asserted with a wide margin
    assert r["warmup_kl_last"] < 0.5 * r["warmup_kl_first"], r
    assert r["warmup_recall_last"] > r["warmup_recall_first"] + 0.1, r
    # sparse vs dense continuation from the same weights, steps and data: measured +0.17% / +0.39% (training /
    # validation) over these 20 steps, -0.22% / -0.14% over 60. The stated margin is 3%: ~10x what was measured,
    # on 4 x 128-token batches whose loss moves by ~10% from step to step
    assert abs(r["sparse_vs_dense"]) < 0.03 and abs(r["sparse_vs_dense_valid"]) < 0.03, r
    assert (out / "dsa.png").stat().st_size > 0
