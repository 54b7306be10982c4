"""Interleaved 1F1B (``parallel.schedule=interleaved1f1b``, ``parallel.vpp``) through ``recipes.train``: the launch
checks refuse a bad vpp in one line, the dry run shows the chunks, and PP x vpp x EP x DP training equals one
process."""

from __future__ import annotations

import pytest

from recipes.train import main as train_main
from tests.test_training import DEMO, SINGLE, _train
from tests.test_training_recompute import REL
from training.config import load_config
from training.stages import chunk_layers, stage_ids
from training.trainer import model_args

NO_MTP = ["model.overrides.n_mtp_layers=0", "model.fp8=false"]
VPP = ["parallel.schedule=interleaved1f1b", "parallel.vpp=2"]


def test_chunks_cover_the_layers_round_robin_over_ranks():
    """DeepSeek-V3's 61 layers (no MTP) over pp 4 x vpp 4: 16 consecutive chunks of 4 or 3 layers covering every
    layer once, chunk c on rank c % 4 (Megatron-Bridge's VP4 runs cut them likewise, unevenly)."""
    args = model_args(load_config("recipes/configs/deepseek_v3_671b.toml", ["model.overrides.n_mtp_layers=0"]))
    chunks = chunk_layers(args, 4, 4)
    assert len(chunks) == 16 and chunks[0][0] == 0 and chunks[-1][1] == 61
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert sorted({hi - lo for lo, hi in chunks}) == [3, 4]
    assert [stage_ids("interleaved1f1b", 4, r, 4) for r in range(4)] == [[r, r + 4, r + 8, r + 12] for r in range(4)]
    with pytest.raises(ValueError, match="too few for parallel.pp x parallel.vpp = 8 x 8 = 64 model chunks"):
        chunk_layers(args, 8, 8)


@pytest.mark.parametrize("extra,message", [
    (["parallel.vpp=2"], "parallel.vpp=2 with parallel.schedule='dualpipev': vpp=2 needs schedule interleaved1f1b"),
    (["parallel.schedule=interleaved1f1b"], "interleaved1f1b needs vpp >= 2"),
    (VPP[:1] + ["parallel.vpp=0"], "vpp (model chunks per rank) must be a positive int, got 0"),
    (VPP + ["model.overrides.n_layers=3"], "too few for parallel.pp x parallel.vpp = 2 x 2 = 4 model chunks"),
    (VPP + ["data.global_batch=12"], "num_chunks must be a multiple of 2, got 3"),
    (VPP + ["model.overrides.n_mtp_layers=1"], "MTP shares the embedding"),
])
def test_bad_vpp_is_refused_in_one_line(capsys, extra, message):
    argv = ["--config", DEMO, "--dry-run"]
    for o in NO_MTP + extra:
        argv += ["--set", o]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def test_dry_run_shows_chunks_and_interleaved_activations(capsys):
    argv = ["--config", DEMO, "--dry-run"]
    for o in NO_MTP + VPP:
        argv += ["--set", o]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "schedule interleaved1f1b x vpp 2, 4 stages" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])}
    # rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3; with 4 micro-batches rank 0 keeps
    # 2 (pp - 1) + (vpp - 1) pp + 1 = 5 chunk activations alive at its peak, rank 1 3
    assert rows["0"][1:2] == ["0,2"] and rows["1"][1:2] == ["1,3"]
    assert rows["0"][6] == "5" and rows["1"][6] == "3", out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_interleaved_with_ep_and_dp_matches_one_process(tmp_path):
    """PP=2 x vpp 2 (4 chunks of one MoE layer) x EP=2 over DP=2 (4 processes) against one process: per-step loss,
    gradient norm and load imbalance within fp32 summation order (REL = 512 x 2^-24, test_training_recompute).
    Every layer is MoE so that each rank holds two: ``max_vio`` is the mean over ranks of each rank's mean over its
    layers, the mean over all layers only when ranks hold as many. Per-micro-batch losses are compared exactly in
    tests/test_dualpipe_runtime.py."""
    common = ["run.steps=3", "checkpoint.final=false", "checkpoint.interval=0", "optim.warmup_steps=2",
              "data.global_batch=16", "data.micro_batch=2", "data.seq_len=32", "model.overrides.n_dense_layers=0",
              *NO_MTP]
    one, _ = _train(tmp_path, "one", 1, common + SINGLE)
    four, out = _train(tmp_path, "four", 4, common + VPP + ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"])
    assert "schedule interleaved1f1b x vpp 2" in out
    for key in ("loss", "grad_norm", "max_vio"):
        assert [r[key] for r in four] == pytest.approx([r[key] for r in one], rel=REL), key
