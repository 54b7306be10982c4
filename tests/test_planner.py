"""The parallel-strategy planner (planner, recipes/plan): time model against independent counts,
system files, legality and memory shared with the dry run, the CLI, and the schedule assembly against
the real runtime (dualpipe.bench's sleep stages over gloo)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from accel import specs
from dualpipe.ir import Action, Overlap
from dualpipe.schedules import build
from dualpipe.simulator import Costs, program, simulate
from models.deepseek_v3 import ModelArgs
from planner import Request, Space, evaluate, load_system, search
from planner.costs import (
    Durations,
    OpTimer,
    Workload,
    all_to_all_seconds,
    attention_core,
    block_durations,
)
from planner.memory import estimate
from planner.search import Layout, StageCosts, assemble, layouts, to_config
from planner.system import SYSTEMS_DIR, known_systems, system_from_json
from recipes import plan
from tests.dist_utils import current_load
from training.config import load_config
from training.trainer import model_args

V3 = ModelArgs()


# ---- system files ------------------------------------------------------------------------------

def test_shipped_systems_match_accel_specs_and_are_uncalibrated():
    assert set(known_systems()) >= {"H800", "H100", "H200", "B200", "B300", "GB200", "GB300", "A100", "MTT-S4000",
                                    "MTT-S5000"}
    for name in known_systems():
        s = load_system(name)
        spec = specs.lookup(name.replace("-", " "))
        assert spec is not None, name
        assert (s.bf16_tflops, s.fp8_tflops, s.memory_gbps) == (spec.bf16_tflops, spec.fp8_tflops, spec.memory_gbps)
        assert s.memory_gib == spec.memory_gib or not spec.memory_gib
        assert not s.calibrated and s.sources["peaks"] and s.sources["links"]


def test_system_errors_name_the_input(tmp_path):
    with pytest.raises(ValueError, match=r"unknown GPU 'H900'.*H800.*did you mean"):
        load_system("H900")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_system(str(bad))
    doc = json.loads((SYSTEMS_DIR / "H800.json").read_text())
    del doc["links"]["inter_node"]["bandwidth_gb_s"]
    with pytest.raises(ValueError, match=r"links.inter_node.*missing key 'bandwidth_gb_s'"):
        system_from_json(doc)
    doc = json.loads((SYSTEMS_DIR / "H800.json").read_text())
    doc["efficiency"]["gemm"] = 1.7
    with pytest.raises(ValueError, match=r"efficiency.gemm must be in \(0, 1.0\]"):
        system_from_json(doc)
    doc = json.loads((SYSTEMS_DIR / "H800.json").read_text())
    doc["recv_overhead_us"] = -3
    with pytest.raises(ValueError, match=r"recv_overhead_us must be a number >= 0, got -3"):
        system_from_json(doc)


def test_an_unmeasured_row_count_takes_the_largest_measured_one_below_it():
    # the file's own figures are the reference: same N x K, the largest measured M not above the question's
    s = load_system("B200")
    g = s.shape_efficiency["grouped_gemm"]
    for p in "fiw":
        assert s.kernel_efficiency("grouped_gemm", "1024x4096x7168", p) == g["1024x4096x7168"][p]
        assert s.kernel_efficiency("grouped_gemm", "8192x4096x7168", p) == g["1024x4096x7168"][p]  # above them all
        assert s.kernel_efficiency("grouped_gemm", "700x7168x2048", p) == g["512x7168x2048"][p]
        assert s.kernel_efficiency("grouped_gemm", "64x4096x7168", p) == g["128x4096x7168"][p]  # below them all
        assert s.kernel_efficiency("grouped_gemm", "700x4096x7000", p) == s.efficiency["grouped_gemm"]  # no such N x K
        assert s.kernel_efficiency("gemm", "8192x129280x7168", p) == s.shape_efficiency["gemm"]["4096x129280x7168"][p]
    assert s.kernel_efficiency("grouped_gemm") == s.efficiency["grouped_gemm"]


# ---- the time model ----------------------------------------------------------------------------

def test_block_flops_match_activated_parameters():
    """Independent reference: a token's GEMM FLOPs forward are 2 x the parameters it multiplies (ModelArgs'
    activated count, minus norms/router bias), plus the attention core's 2 x context x heads x (d_qk + d_v)."""
    timer = OpTimer(load_system("H800"))
    t, s = 4096, 4096
    work = Workload(1, s, ep=1, fp8=False, recompute=())
    dense, moe = block_durations(timer, V3, 0, work), block_durations(timer, V3, 5, work)
    core = attention_core(V3, t, s).flops
    d = V3.dim
    counts = ModelArgs(n_layers=1, n_dense_layers=1).param_counts()["activated"]
    embed_head = V3.vocab_size * d + d
    dense_params = counts - embed_head - 2 * d - V3.kv_lora_rank - V3.q_lora_rank  # minus the four norms
    # model FLOPs = 3 x forward GEMMs + 3.5 x the attention core
    assert math.isclose(dense.flops, 3 * 2 * t * dense_params + 3.5 * core, rel_tol=1e-12)
    moe_counts = ModelArgs(n_layers=1, n_dense_layers=0).param_counts()["activated"]
    moe_params = moe_counts - embed_head - 2 * d - V3.kv_lora_rank - V3.q_lora_rank
    assert math.isclose(moe.flops, 3 * 2 * t * moe_params + 3.5 * core, rel_tol=1e-12)
    assert math.isclose(core, 2 * t * (s + 1) / 2 * V3.n_heads * (192 + 128), rel_tol=1e-12)


def test_roofline_and_switches_move_time_the_right_way():
    timer = OpTimer(load_system("H800"))
    base = Workload(1, 4096, ep=8, fp8=False, recompute=())
    bf16 = block_durations(timer, V3, 5, base)
    fp8 = block_durations(timer, V3, 5, Workload(1, 4096, ep=8, fp8=True, recompute=()))
    v3rc = block_durations(timer, V3, 5, Workload(1, 4096, ep=8, fp8=False, recompute=("norm", "mla_up", "swiglu")))
    full = block_durations(timer, V3, 5, Workload(1, 4096, ep=8, fp8=False, recompute=("block",)))
    assert fp8.f < bf16.f and fp8.comm_f < bf16.comm_f  # FP8 GEMMs and FP8 dispatch
    assert bf16.i < v3rc.i < full.i and v3rc.f == bf16.f and full.comm_b == bf16.comm_b + bf16.comm_f
    assert math.isclose(full.i, bf16.i + bf16.f, rel_tol=1e-12)  # a full block recompute = one more forward
    a100 = OpTimer(load_system("A100"))  # no FP8: fp8 requested runs BF16
    assert block_durations(a100, V3, 5, Workload(1, 4096, 8, True, ())) == block_durations(a100, V3, 5, Workload(
        1, 4096, 8, False, ()))


def test_all_to_all_volumes():
    """Inside a node: top-k copies x (ep-1)/ep over NVLink; across nodes IB carries one copy per distinct
    remote node, capped by node-limited routing."""
    s = load_system("H800")
    t, d, k = 4096, V3.dim, V3.n_activated_experts
    intra = all_to_all_seconds(V3, t, 8, s, 2, None, 1.0)
    eff = s.collective_efficiency["all_to_all"]
    fixed = s.all_to_all_latency_us[8] * 1e-6  # the call's fixed cost at 8 ranks, from the system file
    assert math.isclose(intra, fixed + s.intra_node.latency_us * 1e-6 + t * k * 7 / 8 * d * 2 / (160e9 * eff),
                        rel_tol=1e-12)
    capped = all_to_all_seconds(V3, t, 64, s, 2, 4, 1.0)  # 8 nodes, at most 4 per token
    ib = fixed + s.inter_node.latency_us * 1e-6 + t * 4 * 7 / 8 * d * 2 / (50e9 * eff)
    assert math.isclose(capped, ib, rel_tol=1e-12)
    assert all_to_all_seconds(V3, t, 64, s, 2, None, 1.0) > capped
    assert all_to_all_seconds(V3, t, 1, s, 2, None, 1.0) == 0.0


def test_overlapped_chunk_hides_the_shorter_of_compute_and_communication():
    d = Durations(f=1.0, i=1.5, w=0.5, comm_f=0.4, comm_b=0.4)
    c = StageCosts([d, d], [0, 1], p2p=0.0, sm_fraction=0.2)
    alone_f, alone_b = c.of(Action("F", 0, 0)), c.of(Action("B", 1, 0))
    assert alone_f == 1.4 and alone_b == 2.4
    fb = c.of(Overlap(Action("F", 0, 1), Action("B", 1, 0)))
    assert math.isclose(fb, 3.0 / 0.8)  # compute-bound: comm hidden, compute slowed by the comm SMs
    comm_bound = StageCosts([Durations(f=0.1, i=0.1, comm_f=1.0, comm_b=1.0)] * 2, [0, 1], 0.0, 0.2)
    assert comm_bound.of(Overlap(Action("F", 0, 1), Action("B", 1, 0))) == 2.0


def test_heads_and_tails_follow_the_exchanges():
    """A MoE block's forward head is what runs before its dispatch, its tail what runs after its combine; a
    dense block (no exchange) joins the neighbouring head or tail, in forward order forward and reversed
    backward; the count exchange costs one link latency forward only."""
    timer = OpTimer(load_system("H800"))
    work = Workload(1, 4096, ep=8, fp8=True, recompute=())
    dense, moe = block_durations(timer, V3, 0, work), block_durations(timer, V3, 5, work)
    assert not dense.exchanges and (dense.head_f, dense.tail_f, dense.head_b, dense.tail_b) == (0, 0, 0, 0)
    assert 0 < moe.head_f < moe.f and 0 < moe.tail_f < moe.head_f and 0 < moe.head_b < moe.tail_b < moe.i + moe.w
    assert math.isclose(moe.comm_f - moe.comm_b, load_system("H800").intra_node.latency_us * 1e-6, rel_tol=1e-9)
    part = dense + moe + moe  # forward: dense, then two MoE blocks
    assert math.isclose(part.head_f, dense.f + moe.head_f) and part.tail_f == moe.tail_f
    assert part.head_b == moe.head_b and math.isclose(part.tail_b, moe.tail_b + dense.i + dense.w)
    last = moe + dense
    assert last.head_f == moe.head_f and math.isclose(last.tail_f, moe.tail_f + dense.f)
    assert math.isclose(last.head_b, dense.i + dense.w + moe.head_b) and last.tail_b == moe.tail_b
    assert block_durations(timer, V3, 5, Workload(1, 4096, 1, True, ())).exchanges is False


def test_overlapped_chunk_is_bound_by_its_wire_and_unhidden_ends():
    """comm-bound chunk: the shorter head + both actions' exchanges end to end + the shorter tail; an I's
    head and tail are its share of the full backward's."""
    d = Durations(f=1.0, i=1.5, w=0.5, comm_f=1.5, comm_b=1.5, head_f=0.3, tail_f=0.2, head_b=0.1, tail_b=0.6)
    c = StageCosts([d, d], [0, 1], p2p=0.0, sm_fraction=0.0)
    assert math.isclose(c.of(Overlap(Action("F", 0, 1), Action("B", 1, 0))), 0.1 + 3.0 + 0.2)
    assert math.isclose(c.of(Overlap(Action("F", 0, 1), Action("I", 1, 0))), 0.075 + 3.0 + 0.2)
    assert c.of(Action("F", 0, 1)) == 2.5 and c.of(Action("B", 1, 0)) == 3.5  # alone: nothing hides
    short = StageCosts([dataclasses.replace(d, comm_f=0.5, comm_b=0.5)] * 2, [0, 1], 0.0, 0.0)
    assert short.of(Overlap(Action("F", 0, 1), Action("B", 1, 0))) == 3.0  # compute-bound


def test_assembly_is_the_simulator_with_uniform_costs():
    """With identical stages and no communication, assembling equals dualpipe.simulator on Costs."""
    d = Durations(f=1.0, i=1.2, w=0.8)
    for name, stages in (("1f1b", 4), ("zb1p", 4), ("zbv", 8), ("dualpipe", 4), ("dualpipev", 8)):
        got = assemble(name, 4, 8, [d] * stages, p2p=0.05, sm_fraction=0.0)
        ref = simulate(build(name, 4, 8), Costs(F=1.0, B=2.0, W=0.8, FB=3.0, p2p=0.05))
        assert math.isclose(got.makespan, ref.makespan, rel_tol=1e-12), name


def test_compiled_program_equals_simulate():
    costs = Costs(F=1.0, B=2.1, W=0.7, FB=2.5, p2p=0.13)
    for name in ("1f1b", "zb1p", "zbv", "dualpipe", "dualpipev"):
        a = program(name, 4, 12).run(costs)
        b = simulate(build(name, 4, 12), costs)
        assert [[(iv.start, iv.end) for iv in row] for row in a.timeline] == \
               [[(iv.start, iv.end) for iv in row] for row in b.timeline]


# ---- search, legality, memory --------------------------------------------------------------------

def _tiny_request(gpus=8, gpu="H100", **sets):
    base = load_config("recipes/configs/tiny_cpu.toml", [f"{k}={v}" for k, v in sets.items()])
    return Request(base, load_system(gpu), gpus, base.data.seq_len, 32)


def test_enumeration_covers_the_legal_space():
    req = _tiny_request()
    args = model_args(req.base)
    lays = list(layouts(req, args, Space(recompute=("none",), fp8=(False,))))
    assert {(x.pp, x.dp) for x in lays} == {(1, 8), (2, 4), (4, 2)}  # 3 layers + 1 MTP: pp <= 4; 8 impossible
    assert all(x.schedule == "none" for x in lays if x.pp == 1)
    assert all(args.n_routed_experts % x.ep == 0 and x.dp % x.ep == 0 for x in lays)
    assert all(x.dp * x.micro_batch * x.microbatches == 32 for x in lays)


def test_plan_memory_is_the_dry_run_memory():
    req = _tiny_request()
    lay = Layout(pp=2, dp=4, ep=4, schedule="dualpipev", micro_batch=2, microbatches=4, fp8=False)
    ev = evaluate(req, lay)
    assert ev.status == "ok", ev.reason
    cfg = to_config(req, lay)
    dry = estimate(cfg, model_args(cfg), device="H100")
    assert [r.total_bytes for r in ev.ranks] == [r.total_bytes for r in dry]
    assert ev.peak_bytes == dry.peak_bytes
    assert 0 < ev.bubble_fraction < 1 and 0 < ev.mfu < 1 and ev.step_time_s > 0


def test_illegal_layouts_carry_the_trainers_reason():
    req = _tiny_request()
    ev = evaluate(req, Layout(2, 4, 4, "1f1b", 2, 4, fp8=False))  # MTP needs the embedding on the last rank
    assert ev.status == "illegal" and "MTP" in ev.reason
    ev = evaluate(req, Layout(2, 4, 4, "dualpipev", 8, 1, fp8=False))
    assert ev.status == "illegal" and "micro-batches" in ev.reason


def test_search_ranks_fitting_layouts_by_time_and_marks_dominated():
    req = _tiny_request()
    evals = search(req, model_args(req.base), Space(micro_batch=(1, 2), fp8=(False,)))
    ok = [e for e in evals if e.status == "ok"]
    assert ok and [e.step_time_s for e in ok] == sorted(e.step_time_s for e in ok)
    assert any(e.status == "dominated" for e in evals)  # everything fits, so recompute is never worth it
    assert all(e.layout.recompute == "none" for e in ok)


@pytest.mark.slow
def test_nothing_fits_lists_the_nearest_misses(capsys):
    code = plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--gpu", "MTT-S4000", "--gpus", "8",
                      "--global-batch", "32", "--set", "model.overrides.dim=16384", "--set",
                      "model.overrides.inter_dim=65536", "--set",
                      "model.overrides.n_routed_experts=256", "--set", "model.overrides.n_expert_groups=8",
                      "--set", "model.overrides.vocab_size=300000"])
    out, err = capsys.readouterr()
    assert code == 2 and "no layout fits MTT-S4000" in err and "nearest misses" in out and "GiB per rank" in out


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "12", "--gpus-per-node", "8"], "must be a positive multiple of --gpus-per-node 8"),
    (["--gpu", "Z100", "--gpus", "8"], "unknown GPU 'Z100'"),
    (["--gpus", "8", "--fix", "tp=2"], "unknown layout key 'tp'"),
    (["--gpus", "8", "--fix", "pp=two"], "--fix pp: expected a positive integer"),
    (["--gpus", "8", "--fix", "schedule=gpipe"], "--fix schedule: expected one of none, 1f1b, interleaved1f1b, zb1p"),
    (["--gpus", "8", "--fix", "recompute=full"], "--fix recompute: expected one of none, v3, block, got 'full'"),
    (["--gpus", "8", "--fix", "ep=3"], "no layout of 8 GPUs matches: global batch 32 must be dp x micro_batch"),
    (["--gpus", "8", "--global-batch", "7"], "no layout of 8 GPUs matches: global batch 7"),
    (["--gpus", "8", "--expert-imbalance", "0.5"], "--expert-imbalance is the busiest expert's load over the mean"),
    (["--gpus", "8", "--schedules", "1f1b,gpipe"], "argument --schedules: unknown schedule(s) ['gpipe']"),
    (["--gpus", "8", "--micro-batches", "1,x"], "argument --micro-batches: expected comma-separated integers"),
])
def test_cli_bad_input(argv, message, capsys):
    try:
        code = plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--global-batch", "32", *argv])
    except SystemExit as exc:  # argparse's own type errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_fix_write_config_json_trace_and_dry_run(tmp_path, capsys):
    """The written config is accepted unchanged by recipes.train --dry-run, whose memory is the plan's."""
    from recipes import train

    out, js, tr = tmp_path / "best.toml", tmp_path / "all.json", tmp_path / "trace.json"
    assert plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--gpu", "H100", "--set",
                      "model.overrides.n_mtp_layers=0", "--fix", "pp=2,dp=4,ep=4,schedule=1f1b,micro_batch=2,"
                      "microbatches=4,fp8=false,recompute=none,moments=bfloat16", "--write-config", str(out),
                      "--json", str(js), "--trace", str(tr)]) == 0
    printed = capsys.readouterr().out
    assert "pp2 dp4 ep4 1f1b mb2x4" in printed
    rows = json.loads(js.read_text())
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    for key in ("step_time_ms", "tokens_per_s", "mfu", "bubble_fraction", "exposed_comm_ms", "peak_memory_gib"):
        assert rows[0][key] > 0, key
    trace = json.loads(tr.read_text())["traceEvents"]
    assert {e["tid"] for e in trace} == {0, 1} and any(e.get("cat") == "B" for e in trace)
    cfg = load_config(out)
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.schedule) == (2, 4, 4, "1f1b")
    assert train.main(["--config", str(out), "--dry-run", "--device", "H100"]) == 0
    dry = capsys.readouterr().out
    gib = estimate(cfg, model_args(cfg), device="H100").peak_bytes / 1024**3
    assert f"{gib:.2f}" in dry and "FITS" in dry
    assert math.isclose(rows[0]["peak_memory_gib"], gib, rel_tol=1e-12)


# ---- against the real runtime ------------------------------------------------------------------

@pytest.mark.slow
def test_predicted_step_matches_the_runtime_with_sleep_stages():
    """dualpipe.bench runs the real Pipeline/DualPipe over gloo with stages that sleep their F, I, W (and an
    overlapped F&B) durations; the planner's assembly of the same per-stage durations must predict the measured
    step within 15% for every schedule. Calibrated like a system file, on the 1f1b run only: the P2P latency is
    the bench's gloo ping, and the runtime's host time per computation pass, per message posted and per message
    taken (``bench.host_costs``: two hand-shakes per message, header then payload) are measured on 1f1b's
    timelines; the other four schedules are predictions. DualPipe's overlapped F&B moves two messages each way,
    1F1B's actions one: a per-action overhead alone under-predicted DualPipe by 10-18%. Sleep-dominated stages
    keep this robust to load (a sleeping rank needs no CPU), the schedules run round-robin so a change of load
    hits all alike, and the measured step is the fastest repeat (load only adds time). Above a load of twice the
    cores the wake-ups of sleeping ranks are late by whole scheduler slices and the test skips: it would measure
    the OS scheduler, not the runtime."""
    import os

    load, cores = current_load(), os.cpu_count() or 1
    if load > 2 * cores:
        pytest.skip(f"{load:.0f} other processes running on {cores} cores: sleep timings would measure the scheduler")

    from dualpipe import bench

    part = Durations(f=0.010, i=0.014, w=0.010, comm_f=0.004, comm_b=0.004)
    costs = StageCosts([part] * 8, list(range(8)), 0.0, 0.15)
    fb = costs.of(Overlap(Action("F", 0, 1), Action("B", 1, 0)))
    ns = argparse.Namespace(ranks=4, microbatches=8, F=part.f + part.comm_f, B=part.i + part.w + part.comm_b,
                            W=part.w, FB=fb, repeats=3, schedules=["1f1b", "zb1p", "zbv", "dualpipe", "dualpipev"])
    per_rank = bench.launch(ns)
    host = bench.host_costs(per_rank, "1f1b", ns)
    res = per_rank[0]
    errors = {}
    for name in ns.schedules:
        stages = 8 if name in ("zbv", "dualpipev") else 4
        pred = assemble(name, 4, 8, [part] * stages, res["latency"], 0.15, host.overhead, host.send,
                        host.recv).makespan
        measured = min(res["runs"][name]["steps"])  # load only ever adds time: the fastest repeat is the signal
        errors[name] = (measured - pred) / measured
    assert all(abs(e) < 0.15 for e in errors.values()), (errors, host, res["latency"])


def test_simulator_charges_message_host_costs_where_the_runtime_spends_them():
    """Independent count: with zero compute, 1F1B over 2 ranks and 1 micro-batch is F(rank 0) -> send -> flight ->
    take -> F, B(rank 1) -> send -> flight -> take -> B(rank 0); DualPipe's overlapped chunks take two."""
    c = Costs(F=0.0, B=0.0, W=0.0, p2p=1.0, send=10.0, recv=100.0)
    assert simulate(build("1f1b", 2, 1), c).makespan == 2 * (10.0 + 1.0 + 100.0)
    prog = program("dualpipe", 4, 8)
    overlaps = [i for i, (r, k) in enumerate(prog.order) if isinstance(prog.schedule.actions[r][k], Overlap)]
    assert overlaps and any(len(prog.waits[i]) == 2 and prog.sends[i] == 2 for i in overlaps)
    assert max(program("1f1b", 4, 8).sends) == 1


# ---- calibration -------------------------------------------------------------------------------

def test_calibrate_refuses_a_cpu(tmp_path, capsys):
    import accel

    if accel.backend() != "cpu":
        pytest.skip("a GPU is visible: calibrate would measure it")
    assert plan.main(["calibrate", "--out", str(tmp_path / "s.json")]) == 2
    assert "calibrate measures a GPU" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_calibrate_measure_writes_a_loadable_system_file(tmp_path):
    """The measuring code runs on any device; on the CPU with tiny shapes it must produce a valid file."""
    import torch

    from planner.calibrate import measure

    args = ModelArgs.preset("debug_tiny")
    got = measure(load_system("H100"), args, tokens=64, seq_len=32, ep=2, device=torch.device("cpu"),
                  copy_bytes=1 << 20)
    assert got.calibrated and {"gemm", "grouped_gemm", "attention_fwd", "attention_bwd"} <= set(got.shape_efficiency)
    assert all(0 < v <= 1 for table in got.shape_efficiency.values() for per in table.values() for v in per.values())
    assert all(set(per) == {"f", "i", "w"} for per in got.shape_efficiency["gemm"].values())  # each pass measured
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(got.to_json()))
    again = load_system(str(path))
    assert again.shape_efficiency == got.shape_efficiency and again.calibrated


def test_cli_takes_a_hf_config_and_prints_json(tmp_path, capsys):
    """A HF config.json plans the same model as its preset (the written config carries the differing fields)."""
    ModelArgs.preset("debug", n_mtp_layers=0).save_hf_config(tmp_path / "config.json")
    fix = "pp=2,dp=4,ep=4,schedule=zb1p,micro_batch=1,microbatches=8,fp8=false,recompute=none,moments=bfloat16"
    assert plan.main(["--model", str(tmp_path / "config.json"), "--gpu", "H100", "--seq-len", "128", "--fix", fix,
                      "--json", "-", "--write-config", str(tmp_path / "w.toml"), "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "1e+09 training tokens = 244,141 steps" in out  # 1e9 / (32 sequences x 128 tokens per step)
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    assert rows[0]["status"] == "ok" and rows[0]["name"].startswith("pp2 dp4 ep4 zb1p")
    cfg = load_config(tmp_path / "w.toml")
    assert model_args(cfg).dim == ModelArgs.preset("debug").dim and model_args(cfg).n_mtp_layers == 0


@pytest.mark.slow
def test_written_config_trains(tmp_path, capsys):
    """The plan's winner, written with --write-config, is a config recipes.train runs as written (two steps here:
    the step count and the run folder are the only settings given on the command line)."""
    from recipes import train

    out = tmp_path / "best.toml"
    assert plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--gpu", "H100", "--gpus", "1", "--global-batch",
                      "4", "--write-config", str(out)]) == 0
    capsys.readouterr()
    assert train.main(["--config", str(out), "--set", "run.steps=2", "--set", "run.sample_tokens=0", "--set",
                       "logging.eval_batches=0", "--run-dir", str(tmp_path / "run"), "--wandb", "disabled"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def _a2a_worker(rank: int, world: int, port: int, schedules: list[str], microbatches: int, delay_ratio: float,
                repeats: int, out: str) -> None:
    """One rank of the delay-injected all-to-all run (``recipes.bench_a2a_delay``'s layout and serial wire), one
    trainer per schedule, stepped round-robin: a step of each without delay sizes the delay (``delay_ratio`` x
    the dualpipev pipeline's time over its exchanges), then ``repeats`` rounds of an undelayed and a delayed step
    of each. Per step it keeps each pipeline item's span and each exchange's post and completion (the real gloo
    exchange, before the delay's sleep); rank 0 writes them to ``out``."""
    import datetime
    import os
    import tempfile
    import time

    import torch
    import torch.distributed as dist

    from recipes import bench_a2a_delay as a2a
    from training.parallel import init_parallel
    from training.trainer import Trainer, check_static

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DSV3_KERNEL_IMPL="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        torch.set_num_threads(1)
        spans: list[list[float]] = []  # [posted, done] per exchange
        inner = dist.all_to_all_single

        class Done:
            def __init__(self, work, span):
                self.work, self.span = work, span

            def wait(self, *args):
                self.work.wait(*args)
                self.span[1] = self.span[1] or time.perf_counter()
                return True

        def recorded(*args, async_op=False, **kwargs):
            span = [time.perf_counter(), 0.0]
            spans.append(span)
            return Done(inner(*args, async_op=True, **kwargs), span)

        wire = a2a.DelayedAllToAll(recorded)
        dist.all_to_all_single = wire
        trainers = {}
        for name in schedules:
            cfg = load_config("recipes/configs/tiny_cpu.toml", a2a.BASE + [
                f"run.steps={2 * repeats + 4}", f"parallel.schedule={name}", "parallel.overlap=true",
                f"data.global_batch={2 * 2 * microbatches}"])
            trainers[name] = Trainer(cfg, init_parallel(cfg.parallel, cfg.run.timeout_s), tempfile.mkdtemp(),
                                     "disabled", check_static(cfg, world))

        def step(name: str) -> dict:
            dist.barrier()
            n0 = len(spans)
            trainers[name].train_step()
            items = [(str(it), s, e) for it, s, e, _ in trainers[name].pipeline.pipe.last_step_timeline]
            return {"items": items, "exchanges": spans[n0:]}

        first = {name: step(name) for name in schedules for _ in range(2)}  # warm-up, then the sizing step
        ref = first[schedules[0]]
        delay = torch.tensor(delay_ratio * (ref["items"][-1][2] - ref["items"][0][1]) / len(ref["exchanges"]),
                             dtype=torch.float64)
        dist.broadcast(delay, 0)  # every rank sleeps the same
        runs = {name: {"nodelay": [], "delayed": []} for name in schedules}
        for _ in range(repeats):
            for name in schedules:
                for key, d in (("nodelay", 0.0), ("delayed", delay.item())):
                    wire.latency_s = d
                    runs[name][key].append(step(name))
        wire.latency_s = 0.0
        if rank == 0:
            Path(out).write_text(json.dumps({"delay": delay.item(), "runs": runs}))
    finally:
        dist.destroy_process_group()


def _a2a_parts(steps: list[dict], per_exchange: float) -> list[Durations]:
    """Each model stage's Durations from the items that ran alone in undelayed steps: compute = the item's time
    outside its exchanges (post to completion: the transport the delay replaces), head = until its first post,
    tail = after its last completion; comm = its exchanges x ``per_exchange`` (the delay and the host time it
    puts on the critical path). Per step the median over like items,
    then the fastest step (load only adds time)."""
    import statistics

    from dualpipe.ir import parse_item

    best: dict[tuple[str, int], tuple[float, float, float, int]] = {}  # (compute, head, tail, exchanges)
    for run in steps:
        per: dict[tuple[str, int], list] = {}
        for text, start, end in run["items"]:
            item = parse_item(text)
            if isinstance(item, Overlap):
                continue
            inside = sorted((p, d) for p, d in run["exchanges"] if start <= p < end)
            covered, reach = 0.0, start  # time some exchange of the item is in flight (their union)
            for p, d in inside:
                covered += max(0.0, d - max(p, reach))
                reach = max(reach, d)
            compute = (end - start) - covered
            head = inside[0][0] - start if inside else 0.0
            tail = end - max(d for _, d in inside) if inside else 0.0
            per.setdefault((item.kind, item.stage), []).append((compute, head, tail, len(inside)))
        for key, rows in per.items():
            med = tuple(statistics.median(r[j] for r in rows) for j in range(4))
            if key not in best or med[0] < best[key][0]:
                best[key] = med
    parts = []
    for st in range(1 + max(stage for _, stage in best)):
        f, w = best[("F", st)], best.get(("W", st), (0.0, 0.0, 0.0, 0))
        if ("B", st) in best:
            b = best[("B", st)]
            i, scale = b[0] - w[0], 1.0
        else:  # only an I ran alone: the full backward's head and tail in proportion (as StageCosts splits them)
            b = best[("I", st)]
            i, scale = b[0], (b[0] + w[0]) / b[0]
        parts.append(Durations(f=f[0], i=i, w=w[0], comm_f=f[3] * per_exchange, comm_b=b[3] * per_exchange, head_f=f[1],
                               tail_f=f[2], head_b=b[1] * scale, tail_b=b[2] * scale))
    return parts


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DSV3_TIMING") != "1",
                    reason="times real CPU compute, which a loaded CI machine stretches: set DSV3_TIMING=1")
def test_predicted_all_to_all_overlap_matches_the_delay_benchmark(tmp_path):
    """recipes.bench_a2a_delay's layout (tiny_cpu model, EP 2 over 2 ranks, pp 1) with a fixed delay in every
    all-to-all on its serial wire (``--delay-ms``), sized so a step's delays add up to its undelayed pipeline
    time (comm = compute, V3's cross-node ratio). The planner's overlap rule and assembly (``search.assemble`` /
    ``StageCosts``) are fed each stage's compute, head and tail measured on its items that ran alone without
    delay, and per exchange the delay plus one host cost: that cost (waking the waiter, staging the next
    exchange behind a landed one) is fitted on 1F1B, where nothing overlaps, as ``dualpipe.bench``'s
    message overheads are. With it the prediction must match the measured pipeline time of DualPipeV
    (overlapped F&B chunks hiding the exchanges in both directions) within 15% (ZB-V, the V without
    overlap, met it in every run too: -6..+11%; its W placement is checked with the sleep stages above, so it
    is left out here to keep make test short). DualPipeV's exposed all-to-all (delayed time - compute), the overlap
    rule on its own, must be within 25%: it is the step's error over about half the step, so CPU timing
    noise doubles in it (runs here: -5% to +15%); a rule that hid nothing misses it by more than 50%.
    Load only adds time, so the inputs are the fastest step's figures and the measured time is the fastest
    delayed step. It times real CPU compute: above a load of two processes per core the ranks' compute and
    wake-ups stretch by whatever the other processes take, so it skips there. Opt-in (``DSV3_TIMING=1``): a CI run
    at a load of 4 on 2 cores fitted a host cost inflated by the load on 1F1B and missed the exposed share by 26%."""
    import os
    import socket

    import torch.multiprocessing as mp

    load, cores = current_load(), os.cpu_count() or 1
    if load > 2 * cores:
        pytest.skip(f"{load:.0f} other processes running on {cores} cores: the compute timings would measure them")
    schedules, microbatches = ["1f1b", "dualpipev"], 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "a2a.json"
    mp.spawn(_a2a_worker, args=(2, port, schedules, microbatches, 1.0, 5, str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    delay, runs = got["delay"], got["runs"]

    def measured(name: str) -> float:
        return min(r["items"][-1][2] - r["items"][0][1] for r in runs[name]["delayed"])

    def predicted(name: str, per_exchange: float, comm: bool = True) -> float:
        parts = _a2a_parts(runs[name]["nodelay"], per_exchange)
        if not comm:
            parts = [dataclasses.replace(p, comm_f=0.0, comm_b=0.0) for p in parts]
        return assemble(name, 1, microbatches, parts, 0.0, 0.0).makespan

    exchanges = len(runs["1f1b"]["delayed"][0]["exchanges"])  # per step, the same in every schedule
    host = (measured("1f1b") - predicted("1f1b", delay)) / exchanges  # 1F1B exposes every exchange in full
    report = {"delay_ms": delay * 1e3, "host_ms_per_exchange": host * 1e3, "load": os.getloadavg()}
    for name in schedules[1:]:
        got_s, want_s, compute = measured(name), predicted(name, delay + host), predicted(name, 0.0, comm=False)
        report[name] = {"step": (got_s - want_s) / got_s, "exposed": (got_s - want_s) / (got_s - compute),
                        "predicted_s": want_s, "measured_s": got_s, "compute_s": compute}
    print(json.dumps(report, indent=1))
    assert 0 <= host < delay, report  # a host cost, small beside the delay
    assert all(abs(report[name]["step"]) < 0.15 for name in schedules[1:]), report
    assert abs(report["dualpipev"]["exposed"]) < 0.25, report
