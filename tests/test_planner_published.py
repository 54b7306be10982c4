"""The shipped system files, their validation, and the terms the time model gained (per-pass shape efficiencies,
permute / cross-entropy classes, all-to-all fixed cost, stragglers, MXFP8). The public runs themselves are held
out one at a time in tests/test_planner_loo.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from models.deepseek_v3 import ModelArgs
from planner import load_system
from planner.costs import FP8_SCALE_BYTES, OpTimer, Workload, block_durations, gemm, memory_op
from planner.memory import FP8_VALUE_BYTES, estimate
from planner.runs import load_runs
from planner.search import Layout, Request, expected_max_normal, straggler_factor, to_config
from planner.system import KERNEL_CLASSES, SYSTEMS_DIR, known_systems, system_from_json
from recipes.plan import base_config

V3 = ModelArgs()


def test_deepseek_figure_is_the_reports_gpu_hours():
    # 180K GPU-hours per 1e12 tokens on 2048 GPUs, 15360 x 4096 tokens per step (the record stores tokens/s/GPU)
    (v3,) = [r for r in load_runs() if r.name == "deepseek-v3-report-2048xh800"]
    assert math.isclose(v3.measured_step_s, 15360 * 4096 * 180e3 * 3600 / 1e12 / 2048, rel_tol=1e-12)
    assert 19.8 < v3.measured_step_s < 20.0


# ---- system files ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", known_systems())
def test_every_efficiency_of_a_shipped_file_names_its_source(name):
    doc = json.loads((SYSTEMS_DIR / f"{name}.json").read_text())
    src = doc["sources"]
    for k, v in doc["efficiency"].items():
        assert v == 0 or src.get(f"efficiency.{k}", "").strip(), (name, k)
    for k, table in doc["shape_efficiency"].items():
        assert table and src.get(f"shape_efficiency.{k}", "").strip(), (name, k)
    for k in ("peaks", "links", "all_to_all_latency_us", "jitter_cv", "collective_efficiency"):
        assert src.get(k, "").strip(), (name, k)
    if name.startswith("MTT"):  # Moore Threads figures are the vendor's, and the file says so
        assert "VENDOR CLAIM" in src["peaks"] and all("ASSUMED" in src[k] for k in src if k.startswith("efficiency"))
    system = load_system(name)
    assert set(system.efficiency) == set(KERNEL_CLASSES)


def test_bad_system_files_give_one_line_errors_naming_file_and_key():
    doc = json.loads((SYSTEMS_DIR / "B200.json").read_text())
    cases = [
        (lambda d: d["sources"].pop("efficiency.permute"), r"f\.json: sources\.efficiency\.permute missing"),
        (lambda d: d["sources"].pop("shape_efficiency.grouped_gemm"), r"sources\.shape_efficiency\.grouped_gemm"),
        (lambda d: d["sources"].pop("memory_latency_us"), r"sources\.memory_latency_us missing"),
        (lambda d: d["efficiency"].pop("cross_entropy"), r"\[efficiency\]: missing key 'cross_entropy'"),
        (lambda d: d["shape_efficiency"]["gemm"].__setitem__("4096x1536x7168", {"f": 0.5, "i": 0.5}),
         r"shape_efficiency\.gemm\.4096x1536x7168 must be a number or"),
        (lambda d: d["shape_efficiency"]["gemm"].__setitem__("4096x1536x7168", 1.4),
         r"shape_efficiency\.gemm\.4096x1536x7168\.f must be in \(0, 1.0\]"),
        (lambda d: d.__setitem__("all_to_all_latency_us", {"1": 3.0}), r"'all_to_all_latency_us' must map group"),
        (lambda d: d.__setitem__("jitter_cv", -0.1), r"jitter_cv must be a number >= 0"),
    ]
    for mutate, message in cases:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(ValueError, match=message) as info:
            system_from_json(bad, "f.json")
        assert "\n" not in str(info.value) and "f.json" in str(info.value)


# ---- the time model's new terms ----------------------------------------------------------------

def test_expected_max_of_normals_matches_closed_forms():
    # E[max of 2] = 1/sqrt(pi), E[max of 3] = 3/(2 sqrt(pi)) (order statistics of the normal); the midpoint rule
    # with step 1e-3 on a smooth integrand is accurate to ~1e-7
    assert math.isclose(expected_max_normal(2), 1 / math.sqrt(math.pi), abs_tol=1e-6)
    assert math.isclose(expected_max_normal(3), 1.5 / math.sqrt(math.pi), abs_tol=1e-6)
    assert expected_max_normal(1) == 0.0 and straggler_factor(0.08, 1) == 1.0
    assert 1.0 < straggler_factor(0.08, 2) < straggler_factor(0.08, 16)


def test_per_pass_shape_efficiency_and_memory_bound_classes():
    b200 = load_system("B200")
    timer = OpTimer(b200)
    op = gemm("wq_a", 4096, 1536, 7168)
    table = b200.shape_efficiency["gemm"]["4096x1536x7168"]
    f, i, w = timer.op(op)
    for seconds, p in ((f, "f"), (i, "i"), (w, "w")):  # FLOP-bound: FLOPs / (peak x that pass's efficiency)
        assert math.isclose(seconds, op.flops / (b200.bf16_tflops * 1e12 * table[p]), rel_tol=1e-12)
    unknown = gemm("x", 4096, 1000, 3000)  # not in the table: the class figure
    assert math.isclose(timer.op(unknown)[0], unknown.flops / (b200.bf16_tflops * 1e12 * b200.efficiency["gemm"]),
                        rel_tol=1e-12)
    fixed = b200.memory_latency_us * 1e-6  # one kernel's fixed cost in each pass
    assert fixed > 0
    for kind in ("permute", "cross_entropy", "memory"):
        f, i, w = timer.op(memory_op("m", 1e9, kind=kind))
        assert math.isclose(f, 1e9 / (b200.memory_gbps * 1e9 * b200.efficiency[kind]) + fixed, rel_tol=1e-12)
        assert math.isclose(i, 2e9 / (b200.memory_gbps * 1e9 * b200.efficiency[kind]) + fixed, rel_tol=1e-12)
        assert w == 0.0


def test_all_to_all_fixed_cost_grows_the_exchanges():
    b200 = load_system("B200")
    work = Workload(1, 4096, ep=4, fp8=False, recompute=())
    with_fixed = block_durations(OpTimer(b200), V3, 5, work)
    none = block_durations(OpTimer(dataclasses.replace(b200, all_to_all_latency_us={})), V3, 5, work)
    # dispatch + combine forward, their reverses backward, each one call at the 4-rank figure
    assert math.isclose(with_fixed.comm_f - none.comm_f, 2 * b200.all_to_all_latency(4), rel_tol=1e-9)
    assert math.isclose(with_fixed.comm_b - none.comm_b, 2 * b200.all_to_all_latency(4), rel_tol=1e-9)
    assert b200.all_to_all_latency(6) == b200.all_to_all_latency_us[4] * 1e-6  # largest size not above 6
    assert b200.all_to_all_latency(64) == b200.all_to_all_latency_us[8] * 1e-6


def test_mxfp8_recipe_in_planner_and_memory_model():
    # scale storage per value: one UE8M0 byte per 32 (MXFP8) equals one fp32 per 128 (V3's 1x128 tiles)
    assert FP8_SCALE_BYTES["mxfp8"] == 1 / 32 and FP8_SCALE_BYTES["blockwise"] == 4 / 128
    assert FP8_VALUE_BYTES == {k: 1 + v for k, v in FP8_SCALE_BYTES.items()}
    with pytest.raises(ValueError, match=r"fp8_recipe 'mxfp8': H800 has no MXFP8 tensor-core path"):
        OpTimer(load_system("H800"), "mxfp8")
    with pytest.raises(ValueError, match=r"fp8_recipe: expected one of \['blockwise', 'mxfp8'\], got 'nvfp4'"):
        OpTimer(load_system("B200"), "nvfp4")
    b200 = load_system("B200")
    slower = dataclasses.replace(b200, efficiency={**b200.efficiency, "mxfp8_grouped_gemm": 0.05},
                                 shape_efficiency={k: v for k, v in b200.shape_efficiency.items()
                                                   if k != "mxfp8_grouped_gemm"})
    work = Workload(1, 4096, ep=8, fp8=True, recompute=())
    block = block_durations(OpTimer(slower, "blockwise"), V3, 5, work)
    mx = block_durations(OpTimer(slower, "mxfp8"), V3, 5, work)
    assert mx.f > block.f  # the MXFP8 grouped GEMMs take the mxfp8 class's efficiency
    assert mx.comm_f == block.comm_f  # same dispatch bytes per value
    base = base_config("deepseek_v3_671b", ["model.overrides.n_layers=4", "model.overrides.n_dense_layers=1",
                                            "model.overrides.n_mtp_layers=0"])
    req = Request(base, b200, 8, 4096, 32, fp8_recipe="mxfp8")
    cfg = to_config(req, Layout(1, 8, 8, "none", 1, 4, "none", fp8=True))
    a, b = (estimate(cfg, device="B200", fp8_recipe=r).peak_bytes for r in ("blockwise", "mxfp8"))
    assert a == b
    with pytest.raises(ValueError, match=r"model.fp8_recipe: expected one of"):
        estimate(cfg, device="B200", fp8_recipe="int8")
