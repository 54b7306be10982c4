"""DeepSeek-V4 through ``python -m recipes.train`` on gloo: 1F1B, ZB-V and the demo's DualPipeV x EP x DP with FP8
and MTP (the per-layer plan's overlapped forward-and-backward, the EP all-to-alls inside it) equal one process.

DualPipe, interleaved 1F1B and ZB1P go through the same stage interface (checked by hand, equal to one process).

Tolerances: fp32 runs differ in summation order only (``REL``: the mean over a step's 16 x 64 = 1024 tokens,
1024 x 2^-24 = 6e-5 relative; a lost or doubled gradient moves step 2's loss by > 1e-2). FP8 quantises the same
values on both sides in the forward (activations and the dispatch per token, weights per block; each data-parallel
rank's micro-batches are some of the reference's), so step 1's loss keeps ``REL``; the backward's casts are taken
over other row sets, as in ``tests/test_combinations.py`` (whose derivation gives FP8_RTOL for the gradient norm and
FP8_LOSS_ATOL for later losses)."""

from __future__ import annotations

import math

import pytest
import torch

from models.deepseek_v4 import ModelArgs, Transformer, save_hf_checkpoint
from tests.matrix import train_cli
from tests.test_combinations import FP8_LOSS_ATOL, FP8_RTOL

CONFIG = "recipes/configs/v4_tiny_cpu.toml"
QUICK = ["run.steps=3", "run.sample_tokens=4", "data.seq_len=64", "data.global_batch=16", "data.micro_batch=2",
         "logging.progress=false", "logging.eval_batches=1", "logging.wandb=disabled", "run.threads=1",
         "optim.warmup_steps=2", "checkpoint.interval=0", "checkpoint.final=false"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]
# the two-process schedules: 2 steps (step 2's loss sees step 1's update) of 4 micro-batches of 2 sequences
SHORT = ["run.steps=2", "data.global_batch=8"]
REL = 1024 * 2.0**-24


def _equal(got: list[dict], want: list[dict], keys: tuple[str, ...]) -> None:
    assert len(got) == len(want) >= 2
    for key in keys:
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=REL), key


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_1f1b_matches_one_process(tmp_path):
    """PP=2 1F1B (one stage per rank: the streams and token ids cross ranks once each way); MTP needs the embedding
    beside the head, which 1F1B does not give, so both runs have none."""
    common = SHORT + ["model.overrides.n_mtp_layers=0"]
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, common + SINGLE)
    two = train_cli(CONFIG, QUICK, tmp_path / "two", 2,
                    common + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=1f1b"])
    _equal(two, one, ("loss", "grad_norm", "indexer_kl"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_zbv_with_mtp_and_block_recompute_matches_one_process(tmp_path):
    """PP=2 ZB-V (4 stages in a V, weight gradients deferred), MTP on the rank holding the embedding, whole-block
    recompute, against one process without recompute."""
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, SHORT + SINGLE)
    two = train_cli(CONFIG, QUICK, tmp_path / "two", 2,
                    SHORT + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=zbv",
                             'model.overrides.recompute=["block"]'])
    _equal(two, one, ("loss", "mtp_loss", "grad_norm", "indexer_kl"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_v4_demo_dualpipev_ep_fp8_mtp_matches_one_process(tmp_path):
    """The demo layout (``v4_tiny_cpu.toml``: PP=2 DualPipeV, EP=2 over DP=2, the per-layer plan's overlapped F&B
    with the hash-routed and scored MoE layers' all-to-alls in it) with FP8 experts and MTP, against one process
    with FP8; both runs' losses fall from a fresh model's ln 256."""
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, SINGLE + ["model.fp8=true"])
    four = train_cli(CONFIG, QUICK, tmp_path / "four", 4, ["model.fp8=true"])
    for runs in (one, four):
        assert runs[0]["loss"] == pytest.approx(math.log(256), abs=0.15)
        assert runs[-1]["loss"] < runs[0]["loss"] - 0.2, [r["loss"] for r in runs]
        assert "ep_imbalance" in runs[-1] or runs is one
    for key in ("loss", "mtp_loss"):
        assert four[0][key] == pytest.approx(one[0][key], rel=REL), key
        for a, b in zip(four[1:], one[1:]):
            assert abs(a[key] - b[key]) <= FP8_LOSS_ATOL, (key, a[key], b[key])
    assert [r["grad_norm"] for r in four] == pytest.approx([r["grad_norm"] for r in one], rel=FP8_RTOL)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_init_from_one_process_and_expert_parallel_match(tmp_path):
    """``model.init_from`` of a V4 folder in DeepSeek's released layout (FP8 + MXFP4): one process and DP=2 x EP=2
    (each rank loading its expert slice) run the same losses and gradient norms, and they are the loaded model's,
    not the seeded one's (a seeded run's first loss is a fresh model's ln 256)."""
    args = ModelArgs.preset("debug_v4", vocab_size=256, max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():  # other weights than the run's seeded ones
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    save_hf_checkpoint(model, tmp_path / "v4", layout="release", quantize=True)
    start = [f"model.init_from={tmp_path / 'v4'}"]
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, SHORT + SINGLE + start)
    two = train_cli(CONFIG, QUICK, tmp_path / "two", 2,
                    SHORT + start + ["parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=none"])
    _equal(two, one, ("loss", "mtp_loss", "grad_norm", "indexer_kl"))
    assert abs(one[0]["loss"] - math.log(256)) > 0.05, one[0]["loss"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_eplb_changes_placement_not_math(tmp_path):
    """EPLB on V4 (DP=2 x EP=2, 2 redundant slots per MoE layer, a re-plan after every step): the hash-routed and
    the scored layers' experts move and replicate by their measured loads, and the losses and gradient norms are
    the run's without EPLB (replicas are exact copies whose gradients are summed; fp32 summation order only)."""
    layout = SHORT + ["run.steps=3", "parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=none"]
    off = train_cli(CONFIG, QUICK, tmp_path / "off", 2, layout)
    on = train_cli(CONFIG, QUICK, tmp_path / "on", 2,
                   layout + ["eplb.enabled=true", "eplb.redundant_experts=2", "eplb.interval=1", "eplb.ema_decay=0.5"])
    _equal(on, off, ("loss", "mtp_loss", "grad_norm", "indexer_kl"))
    assert sum(r.get("eplb_moved_slots", 0) for r in on) > 0, on


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_v4_indexer_warmup_1f1b_matches_one_process(tmp_path):
    """V3.2's dense warm-up on V4 (``model.overrides.dsa_warmup``: CSA attends every visible entry, only the
    indexers train): PP=2 1F1B equals one process in loss, gradient norm (the indexers' alone), the indexer KL and
    the top-k recall the metrics stream reports."""
    common = SHORT + ["run.steps=3", "model.overrides.n_mtp_layers=0", "model.overrides.dsa_warmup=true",
                      "optim.lr=1e-2", "optim.warmup_steps=1"]
    one = train_cli(CONFIG, QUICK, tmp_path / "one", 1, common + SINGLE)
    two = train_cli(CONFIG, QUICK, tmp_path / "two", 2,
                    common + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=1f1b"])
    _equal(two, one, ("loss", "grad_norm", "indexer_kl", "indexer_recall"))
    assert all(0.0 <= r["indexer_recall"] <= 1.0 for r in one)
