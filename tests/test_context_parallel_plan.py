"""Context parallelism in planning: the config and launch checks, the dry run's layout, the memory model at the
local length plus the all-gathered latent, the planner's cost model and search (the runtime's equality with one
process is tests/test_context_parallel.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.costs import OpTimer, Workload, attention_core, block_durations, context_parallel_seconds
from planner.memory import context_parallel_extra, estimate
from planner.search import Layout, Request, Space, evaluate, layouts
from planner.system import load_system
from recipes.train import main as train_main
from training.config import load_config
from training.trainer import model_args

DEMO = "recipes/configs/tiny_cpu.toml"
# the demo model on one pipeline rank, no FP8 (the CPU reference kernels), two ranks per stage
BASE = ["parallel.pp=1", "parallel.schedule=none", "model.fp8=false", "data.global_batch=8", "data.micro_batch=2"]


@pytest.mark.parametrize("sets, needle", [
    (["parallel.cp=0"], "parallel.cp must be >= 1"),
    (["parallel.cp=3", "data.seq_len=128"], "parallel.cp=3 must divide data.seq_len=128"),
    (["parallel.cp=4", "data.seq_len=36"], "data.seq_len=36 must be divisible by 2 x parallel.cp = 8"),
    (["parallel.cp=2", "parallel.dp=1", "parallel.ep=4"], "parallel.ep=4 must divide parallel.cp x parallel.dp"),
])
def test_bad_cp_values_are_one_line_errors(sets, needle, capsys):
    argv = ["--config", DEMO, "--dry-run"] + [a for s in BASE + sets for a in ("--set", s)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_cp_not_dividing_the_ranks_is_refused(capsys):
    sets = BASE + ["parallel.cp=4", "parallel.dp=1", "parallel.ep=1"]
    argv = ["--config", DEMO, "--dry-run", "--nproc", "6"] + [a for s in sets for a in ("--set", s)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.cp=4 x parallel.pp=1 = 4 does not divide the world size 6" in err, err


def test_the_dry_run_lays_out_cp_ranks(capsys):
    argv = ["--config", DEMO, "--dry-run", "--nproc", "2"] + [
        a for s in BASE + ["parallel.cp=2", "parallel.dp=1", "parallel.ep=2"] for a in ("--set", s)]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "pp 1 x cp 2 x dp 1" in out and "64 each" in out and "verdict" in out
    assert "rank    1: pp 0 cp 1 dp 0 (ep 1, edp 0)" in out  # EP spans the CP ranks of the stage


def test_memory_at_the_local_length_plus_the_gathered_latent():
    """cp = 2 at 2L against cp = 1 at L on the same cp x dp ranks: weights, gradients and optimizer shards are the
    same; each block adds the whole sequence's latent (576 values per token for V3's shapes, here kv_lora_rank +
    qk_rope_head_dim of the demo) per micro-batch in flight, and the exchange buffers in comm."""
    ref = load_config(DEMO, BASE + ["parallel.dp=2", "parallel.ep=2", "data.seq_len=64", "data.global_batch=8",
                                    "run.nproc=2"])
    cp = load_config(DEMO, BASE + ["parallel.dp=1", "parallel.ep=2", "parallel.cp=2", "data.seq_len=128",
                                   "data.global_batch=4", "run.nproc=2"])
    args = model_args(cp)
    a, b = estimate(ref, device="H100"), estimate(cp, device="H100")
    (ra,), (rb,) = a.ranks, b.ranks
    for key in ("weights", "gradients", "optimizer"):
        assert ra.items[key] == rb.items[key], key
    latent = 2 * 128 * (args.kv_lora_rank + args.qk_rope_head_dim) * 2  # micro-batch 2 x 128 tokens, bf16
    blocks = args.n_layers + args.n_mtp_layers
    assert context_parallel_extra(args, 1, 2, 128, 2, 2).saved == latent
    assert context_parallel_extra(args, 1, 2, 128, 1, 2).saved == 0  # no CP, nothing added
    assert rb.items["activations"] - ra.items["activations"] == blocks * latent  # 1 micro-batch alive: no pipeline
    assert rb.items["comm"] - ra.items["comm"] == 2 * latent


def test_dsa_adds_the_gathered_indexer_keys():
    args = model_args(load_config("recipes/configs/deepseek_v32_671b_sparse.toml",
                                  ['model.overrides={ recompute = ["v3"] }']))
    extra = context_parallel_extra(args, 5, 1, 131072, 16, 2)
    assert extra.saved == 131072 * (576 + 128) * 2  # 151 MB of latent + 34 MB of indexer keys per layer at 128K
    dense = model_args(load_config("recipes/configs/deepseek_v3_671b_128k.toml"))
    assert context_parallel_extra(dense, 5, 1, 131072, 32, 2).saved == 0  # block recompute: re-gathered in backward


def test_cost_model_splits_attention_and_times_the_latent_exchange():
    """Under CP the core is the whole sequence's causal core / cp on every rank; the exchange moves (cp - 1) / cp
    of the sequence's latent (576 x 2 bytes per token) over NVLink inside a node; a block's time never drops
    below its share of the cp = 1 block."""
    system = load_system("H800")
    timer = OpTimer(system)
    args = model_args(load_config("recipes/configs/deepseek_v3_671b.toml"))
    whole = attention_core(args, 32768, 32768)
    w = Workload(1, 32768, 64, True, ("mla_up", "norm"), cp=8)
    assert w.tokens == 4096
    assert attention_core(args, w.tokens, w.seq_len).flops == pytest.approx(whole.flops / 8, rel=1e-12)
    link = system.intra_node
    want = 7 * link.latency_us * 1e-6 + 32768 * 7 / 8 * 576 * 2 / (link.bandwidth_gb_s * 1e9
                                                                   * system.collective_efficiency["ring"])
    assert context_parallel_seconds(timer, args, w) == pytest.approx(want, rel=1e-12)
    one = block_durations(timer, args, 5, dataclasses.replace(w, cp=1))
    eight = block_durations(timer, args, 5, w)
    assert eight.f + eight.i + eight.w >= (one.f + one.i + one.w) / 8


def test_search_offers_cp_for_long_sequences_only():
    """CP sizes whose 2 x cp chunks split the sequence and leave >= 4096 tokens per rank; none at 4K."""
    base = load_config("recipes/configs/deepseek_v3_671b.toml")
    args = model_args(base)
    space = Space(micro_batch=(1,), schedules=("dualpipev",), recompute=("v3",), fp8=(True,), moments=("bfloat16",))
    h800 = load_system("H800")
    sizes = lambda seq, batch: {x.cp for x in layouts(Request(base, h800, 2048, seq, batch), args, space)}
    assert sizes(4096, 15360) == {1}
    assert sizes(32768, 1920) == {1, 2, 4, 8}
    # at 128K x 480 there is no layout without CP: dp must divide 480 and 2048, so 2048 / dp >= 64 pipeline ranks,
    # more than the 61 layers + MTP
    assert sizes(131072, 480) == {2, 4, 8, 16, 32}
    lay = Layout(16, 16, 64, "dualpipev", 1, 120, "v3", True, cp=8)
    assert str(lay).startswith("pp16 cp8 dp16 ep64") and lay.pp * lay.cp * lay.dp == 2048


@pytest.mark.slow
def test_the_extension_configs_fit_80gb_and_the_planner_agrees():
    """The 32K and 128K extension configs and V3.2's 128K sparse config dry-run within an H800 (79.6 GiB, margin
    included), and the planner, asked for the 32K config's layout, finds it fitting with the same memory."""
    for name in ("deepseek_v3_671b_32k", "deepseek_v3_671b_128k", "deepseek_v32_671b_sparse"):
        cfg = load_config(f"recipes/configs/{name}.toml")
        est = estimate(cfg, device="H800")
        assert est.fits and cfg.parallel.cp > 1 and cfg.parallel.world_size == 2048, (name, est.verdict())
    cfg = load_config("recipes/configs/deepseek_v3_671b_32k.toml", ["model.init_from="])  # (a folder on the cluster)
    p = cfg.parallel
    req = Request(cfg, load_system("H800"), 2048, cfg.data.seq_len, cfg.data.global_batch)
    ev = evaluate(req, Layout(p.pp, p.dp, p.ep, p.schedule, 1, 120, "v3", True, cp=p.cp))
    assert ev.status == "ok" and math.isfinite(ev.step_time_s), ev.reason
    assert ev.peak_bytes == estimate(cfg, device="H800").peak_bytes
