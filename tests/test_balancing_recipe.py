"""Smoke test of recipes.expert_balance: tiny steps, two strategies, a complete report folder."""

import csv
import math

import pytest

from recipes.expert_balance import main

TINY = ["--set", "model.preset=debug_tiny", "--set", "model.overrides.n_mtp_layers=0", "--set", "data.seq_len=16",
        "--set", "data.global_batch=2", "--set", "data.micro_batch=2", "--eval-batches", "1"]


@pytest.mark.timeout(240)
def test_expert_balance_recipe_writes_a_complete_report(tmp_path):
    out = tmp_path / "report"
    assert main(["--steps", "2", "--strategies", "none,aux_free+seq_aux", "--out", str(out), *TINY]) == 0
    for name in ("max_vio.png", "load_heatmap.png", "results.md", "results.csv", "none.jsonl",
                 "aux_free_plus_seq_aux.jsonl"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["strategy"] for r in rows] == ["none", "aux_free+seq_aux"]
    for r in rows:
        loss = float(r["final_loss"])
        assert math.isfinite(loss) and 4.0 < loss < 7.0  # byte-level model near ln 256 = 5.55 after 2 steps
        assert float(r["max_vio_global"]) >= 0.0
    assert (out / "none.jsonl").read_text().count("\n") == 2  # one line per step


def test_expert_balance_recipe_rejects_bad_strategy_before_training(tmp_path, capsys):
    assert main(["--steps", "1", "--strategies", "none,magic", "--out", str(tmp_path), *TINY]) == 2
    assert "unknown part(s) ['magic']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
