"""The DSA recipe on the CPU demo model through the real CLI (``recipes.dsa`` -> ``recipes.train`` and
``recipes.export_hf`` subprocesses): a V3 model is trained and exported, the dense warm-up lowers the indexer's
KL and raises its top-k recall of the main attention, and the sparse stage (top-32 of 128 keys) trains as
well as continuing densely, within a stated margin."""

from __future__ import annotations

import json

import pytest

from recipes import dsa


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_v3_to_v32_recipe_warmup_and_sparse_stage(tmp_path):
    out = tmp_path / "dsa"
    assert dsa.main(["--out", str(out), "--base-steps", "60", "--warmup-steps", "30", "--sparse-steps", "20"]) == 0
    r = json.loads((out / "dsa.json").read_text())["result"]
    # the indexer starts random (recall ~ k / mean causal keys ~ 0.4 for top-32 of up to 128) and learns the
    # attention it imitates: measured KL 0.76 -> 0.05 and recall 0.51 -> 0.89 over 60 steps; over 30, asserted
    # with a wide margin
    assert r["warmup_kl_last"] < 0.5 * r["warmup_kl_first"], r
    assert r["warmup_recall_last"] > r["warmup_recall_first"] + 0.1, r
    # sparse vs dense continuation from the same weights, steps and data: measured -0.2% (training) and -0.1%
    # (validation) over 60 steps. 3% is the stated margin: a broken selection (attending to random keys, or only
    # the newest) costs the byte model's attention its long-range copies, > 5% at this loss level
    assert abs(r["sparse_vs_dense"]) < 0.03 and abs(r["sparse_vs_dense_valid"]) < 0.03, r
    assert (out / "dsa.png").stat().st_size > 0
