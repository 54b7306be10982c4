"""The public runs as data, leave-one-out over them, and the error band ``recipes.plan`` prints (issue 39).

Independent references: the run records' own figures (a record's measured step against the number its source
publishes), hand-built step parts whose leave-one-out answer is known in closed form, and the band recomputed
from ``benchmarks/planner_runs/loo.json`` by hand against what ``recipes.plan`` prints.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.band import MIN_NEAREST, band_for, load_residuals, widened_range
from planner.loo import STEP_OVERHEAD_GRID, TERMS, Parts, fit, fit_scales, loo_errors, select
from planner.runs import RUNS_DIR, Run, load_run, load_runs, run_from_toml
from planner.search import DEFAULT_TERMS, TIME_TERMS
from recipes import plan, plan_loo

ROOT = Path(__file__).resolve().parent.parent
GOOD = RUNS_DIR / "megatron-bridge-moonlight-16xh100-pretrain.toml"


def _doc() -> dict:
    import tomllib
    return tomllib.loads(GOOD.read_text())


# ---- the records --------------------------------------------------------------------------------

def test_shipped_records_cover_the_issue_bar():
    runs = load_runs()
    assert len(runs) >= 20
    fit = [r for r in runs if not r.excluded]
    assert {r.gpu for r in runs} >= {"H100", "H800", "B200", "B300", "GB200", "GB300"}
    assert len({r.family for r in runs}) >= 3 and len({r.model for r in runs}) >= 4
    assert len({r.model for r in fit}) >= 3 and len({r.family for r in fit}) >= 2
    for r in runs:  # every record names where its figure was read
        assert r.source["repository"] and r.source["file"] and r.source["reads"]
        assert ("commit" in r.source) or ("date" in r.source)
    # a record's step is the figure its source prints, converted only where the source gives tokens/s/GPU
    moon = next(r for r in runs if r.name == GOOD.stem)
    assert moon.measured_step_s == 11.63635 and "11636.35" in moon.source["reads"]
    mb = next(r for r in runs if r.name == "megatron-bridge-perf-25.11-v3-256xgb300-bf16")
    assert math.isclose(mb.measured_step_s, 4096 * 4096 / (3848 * 256), rel_tol=1e-12)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["layout"].pop("ep"), r"missing key layout\.ep$"),
    (lambda d: d["layout"].__setitem__("pp", "2"), r"layout\.pp must be int, got '2'"),
    (lambda d: d["layout"].__setitem__("pp", 0), r"layout\.pp must be a positive integer, got 0"),
    (lambda d: d["layout"].__setitem__("dp", 8), r"tp x pp x cp x dp = 8 != system\.gpus 16"),
    (lambda d: d["layout"].__setitem__("tp", 2) or d["layout"].__setitem__("dp", 8),
     r"uses TP, CP, FSDP or another recompute.*run\.excluded must say so"),
    (lambda d: d["layout"].__setitem__("vpp", 2), r"layout\.vpp 2 with layout\.schedule 'none': virtual pipeline"),
    (lambda d: d["layout"].__setitem__("precision", "fp4"), r"layout\.precision must be one of bf16, fp8-blockwise"),
    (lambda d: d["layout"].__setitem__("global_batch", 1000), r"global_batch 1000 is not a multiple of dp x"),
    (lambda d: d["system"].__setitem__("gpu", "H300"), r"system\.gpu must be one of .*got 'H300'"),
    (lambda d: d["run"].__setitem__("routing", "random"), r"run\.routing must be one of balanced, natural"),
    (lambda d: d["run"].__setitem__("value", -1.0), r"run\.value must be > 0"),
    (lambda d: d["run"].__setitem__("speed", 3), r"unknown key run\.speed"),
    (lambda d: d.__setitem__("extra", {}), r"unknown section \[extra\]"),
    (lambda d: d["source"].pop("commit"), r"source needs a commit or a date"),
    (lambda d: d["model"].pop("preset"), r"model\.preset is needed unless run\.excluded"),
    (lambda d: d["model"].__setitem__("sets", ["n_layers"]), r"model\.sets must be a list of 'key=value'"),
])
def test_bad_records_are_refused_in_one_line_naming_file_and_key(mutate, message):
    doc = _doc()
    mutate(doc)
    with pytest.raises(ValueError, match=message) as info:
        run_from_toml(doc, "x", "runs/x.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("runs/x.toml: ")


@pytest.mark.slow
def test_bad_toml_and_the_cli_refuse_in_one_line_and_write_nothing(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[source\nrepository = 1\n")
    with pytest.raises(ValueError, match=r"broken\.toml: not valid TOML"):
        load_run(bad)
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, "-m", "recipes.plan_loo", "--runs", str(tmp_path), "--residuals", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "broken.toml" in proc.stderr and not out.exists()


# ---- leave-one-out on hand-built parts -----------------------------------------------------------

def _parts(name: str, gpu: str, measured: float, pipeline: float, group: str = "") -> Parts:
    """A run whose step parts are known: pipeline ``pipeline`` s, 1 s of DP communication, 0.5 s optimizer
    (0.25 s of it the gradient passes), no straggler stretch, exposed pipeline comm 0."""
    layout = {"global_batch": 1, "seq_len": 1, "ep_overlap": False}
    run = Run(name, {}, gpu, 8, "m", "p", (), layout, "natural", "step_time_ms", measured * 1e3, "", group or name, "")
    q = {"pipeline": pipeline, "exposed_pipeline_comm": 0.0, "microbatches": 1, "straggler": 1.0, "dp_comm": 1.0,
         "optimizer": 0.25, "optimizer_with_passes": 0.5}
    timer = [frozenset(), frozenset({"memory_latency"}), frozenset({"a2a_latency"}),
             frozenset({"memory_latency", "a2a_latency"})]
    return Parts(run, dict.fromkeys(timer, q), 1.0)


def test_loo_fits_the_compute_scale_without_the_held_out_run_or_its_group():
    # Hopper runs measured at 0.8 x pipeline + 1.5 s: every held-out one is predicted exactly from the others
    hop = [_parts(f"h{i}", "H100", 0.8 * p + 1.5, p) for i, p in enumerate((10.0, 20.0, 40.0))]
    terms = frozenset(TERMS) - {"ep_overlap"}
    assert all(abs(e) < 1e-12 for e in loo_errors(hop, terms).values())
    assert all(math.isclose(fit_scales(hop, terms)[k], 0.8, rel_tol=1e-12) for k in ("H100", "Hopper", "*"))
    # without the scale: (p + 1.5) / (0.8 p + 1.5) - 1
    for (name, e), p in zip(sorted(loo_errors(hop, terms - {"compute_scale"}).items()), (10.0, 20.0, 40.0)):
        assert math.isclose(e, (p + 1.5) / (0.8 * p + 1.5) - 1, rel_tol=1e-12), name
    # a twin in the same group is left out with its run: its 0.5x scale must not reach the held-out prediction
    twin = [_parts("a", "B200", 0.5 * 10 + 1.5, 10.0, "g"), _parts("b", "B200", 0.5 * 10 + 1.5, 10.0, "g"),
            _parts("c", "B200", 0.9 * 10 + 1.5, 10.0)]
    err = loo_errors(twin, terms)
    assert math.isclose(err["a"], (0.9 * 10 + 1.5) / (0.5 * 10 + 1.5) - 1, rel_tol=1e-12)


def test_the_scale_is_the_systems_where_the_fit_has_one_else_the_familys_else_every_runs():
    terms = frozenset(TERMS) - {"ep_overlap"}
    runs = [*(_parts(f"b{i}", "B200", 0.5 * p + 1.5, p) for i, p in enumerate((4.0, 6.0, 9.0))),
            _parts("g1", "GB200", 0.8 * 20 + 1.5, 20.0), _parts("g2", "GB200", 0.8 * 30 + 1.5, 30.0),
            _parts("u1", "GB300", 0.7 * 10 + 1.5, 10.0), _parts("u2", "B300", 0.6 * 10 + 1.5, 10.0),
            _parts("h", "H100", 0.9 * 10 + 1.5, 10.0)]
    err = loo_errors(runs, terms)
    # GB200: the other GB200 run's 0.8, not the Blackwell family's median (0.5, the three B200 runs)
    assert abs(err["g1"]) < 1e-12 and abs(err["g2"]) < 1e-12
    # no other GB300 / B300 run: the Blackwell Ultra family's, i.e. the other system's
    assert math.isclose(err["u1"], (0.6 * 10 + 1.5) / (0.7 * 10 + 1.5) - 1, rel_tol=1e-12)
    assert math.isclose(err["u2"], (0.7 * 10 + 1.5) / (0.6 * 10 + 1.5) - 1, rel_tol=1e-12)
    # no Hopper run at all: the median of every other run (0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.8) = 0.6
    assert math.isclose(err["h"], (0.6 * 10 + 1.5) / (0.9 * 10 + 1.5) - 1, rel_tol=1e-12)


def test_the_per_step_overhead_is_found_on_its_grid_with_the_scales_refitted():
    # measured = 0.8 x pipeline + the 1.5 s per-step part + 50 ms: the grid point 50 ms and the scale 0.8 fit exactly
    runs = [_parts(f"r{i}", "B200", 0.8 * p + 1.5 + 0.05, p) for i, p in enumerate((0.5, 1.0, 2.0, 4.0))]
    terms = frozenset(TERMS) - {"ep_overlap"}
    f = fit(runs, terms)
    assert 0.05 in [pytest.approx(c) for c in STEP_OVERHEAD_GRID]
    assert f.step_overhead_s == pytest.approx(0.05, abs=1e-12)
    assert all(v == pytest.approx(0.8, rel=1e-12) for v in f.scales.values())
    assert all(abs(e) < 1e-9 for e in loo_errors(runs, terms).values())
    # without it the scale absorbs 50 ms, which weighs differently on each pipeline: held-out errors appear
    assert max(abs(e) for e in loo_errors(runs, terms - {"step_overhead"}).values()) > 5e-3
    assert fit(runs, terms - {"step_overhead"}).step_overhead_s == 0.0


def test_widened_range_is_the_log_range_widened_by_n_plus_1_over_n_minus_1():
    lo, hi = widened_range([0.9, 1.0, 1.1, 1.2])  # log range [log 0.9, log 1.2], widened 5/3 about its middle
    mid, half = (math.log(0.9) + math.log(1.2)) / 2, (math.log(1.2) - math.log(0.9)) / 2 * 5 / 3
    assert math.isclose(lo, math.exp(mid - half), rel_tol=1e-12)
    assert math.isclose(hi, math.exp(mid + half), rel_tol=1e-12)
    assert lo < 0.9 and hi > 1.2
    assert widened_range([1.07]) == pytest.approx((1.07, 1.07), rel=1e-12)  # one run: no spread to widen


def test_selection_drops_a_term_that_does_not_lower_the_loo_error():
    # measured = pipeline + the optimizer without the gradient passes: gradient_passes and dp_comm only hurt
    runs = [_parts(f"r{i}", "B200", p + 0.25, p) for i, p in enumerate((3.0, 5.0, 8.0, 13.0))]
    kept, steps = select(runs, frozenset({"gradient_passes", "dp_comm"}))
    assert kept == frozenset() and {t for t, _, _ in steps} == {"gradient_passes", "dp_comm"}
    assert all(after <= before for _, before, after in steps)


# ---- reproducibility: the table and the residuals regenerate byte for byte ----------------------

@pytest.mark.slow
def test_loo_table_and_residuals_regenerate_identically(tmp_path):
    text, res = plan_loo.build(RUNS_DIR)
    doc = (ROOT / "benchmarks" / "planner.md").read_text()
    section = doc.split(plan_loo.BEGIN)[1].split(plan_loo.END)[0]
    assert section == f"\n{text}\n", "benchmarks/planner.md is stale: run python -m recipes.plan_loo --write " \
                                     "benchmarks/planner.md"
    assert json.dumps(res, indent=1, sort_keys=True) + "\n" == (RUNS_DIR / "loo.json").read_text()
    # the planner ships the time terms leave-one-out kept
    assert DEFAULT_TERMS == frozenset(res["terms"]) & frozenset(TIME_TERMS)
    # the issue's target per family and system with >= 3 runs, nested; where it is missed the table names the runs
    assert re.search(r"\| Blackwell \| 14 \|.*\| yes \|", text)
    assert re.search(r"\| B200 \(Blackwell\) \| 12 \|.*\| yes \|", text)
    assert re.search(r"\| Hopper \| 4 \|.*\| no: median \S+% \|", text)  # every Hopper run within 20%, nested
    assert re.search(r"\| all \| 20 \|.*\| yes \|", text)
    copy = tmp_path / "planner.md"
    shutil.copy(ROOT / "benchmarks" / "planner.md", copy)
    copy.write_text(plan_loo.splice(copy.read_text(), text, "x"))
    assert copy.read_text() == doc


# ---- the band recipes.plan prints ------------------------------------------------------------------

def _plan(capsys, *argv: str) -> str:
    assert plan.main(list(argv)) == 0
    return capsys.readouterr().out


def _band_rows(out: str) -> list[tuple[float, float, float, float, float, float]]:
    pat = r"step (\S+) s \(band (\S+) to (\S+)\)\s+tokens/s/GPU (\S+) \(band (\S+) to (\S+)\)"
    return [tuple(float(x) for x in m) for m in re.findall(pat, out)]


def test_plan_prints_each_answer_with_the_band_of_the_nearest_runs(capsys):
    out = _plan(capsys, "--model", "deepseek_v2_lite", "--set", "model.overrides.vocab_size=163842", "--gpu", "H100",
                "--gpus", "16", "--seq-len", "4096", "--global-batch", "1024",
                "--fix", "pp=1,ep=8,micro_batch=2,fp8=false,moments=bfloat16", "--top", "2")
    rows = _band_rows(out)
    assert rows and "warning" not in out
    res = load_residuals()
    assert f"compute scale {res['scales']['H100']:.3f} of H100, {1e3 * res['step_overhead_s']:.0f} ms per step" in out
    near = [r for r in res["runs"] if r["name"].startswith("megatron-bridge-moonlight")]
    assert len(near) == 3 and len(near) < MIN_NEAREST  # few: the band also spans every run's ratio
    logs = [math.log(r["ratio"]) for r in res["runs"]]  # every run (the three near among them), range widened
    n, mid, half = len(logs), (max(logs) + min(logs)) / 2, (max(logs) - min(logs)) / 2
    band_lo, band_hi = math.exp(mid - half * (n + 1) / (n - 1)), math.exp(mid + half * (n + 1) / (n - 1))
    table_ms = float(re.search(r"^\s+1 pp1 dp16 ep8 none mb2x32 rc=none bf16\s+(\S+)", out, re.M).group(1))
    step, lo, hi, tok, tok_lo, tok_hi = rows[0]
    assert step < table_ms / 1e3  # the Hopper compute scale (< 1) shortens the model's step
    assert math.isclose(lo, step * band_lo, rel_tol=2e-3) and math.isclose(hi, step * band_hi, rel_tol=2e-3)
    assert math.isclose(tok, 1024 * 4096 / 16 / step, rel_tol=2e-3)
    assert tok_lo < tok < tok_hi


def test_plan_warns_when_the_question_lies_outside_every_run(capsys):
    out = _plan(capsys, "--model", "deepseek_v2_lite", "--gpu", "A100", "--gpus", "16", "--seq-len", "4096",
                "--global-batch", "256", "--fix", "pp=1,ep=8,micro_batch=1,fp8=false,moments=bfloat16", "--top", "1")
    assert "warning: this question lies outside every public run the planner has seen: no public run on a " \
           "Ampere GPU" in out
    assert "of every run, " in out  # no Ampere run: the scale over every run
    assert _band_rows(out)
    res = load_residuals()
    big = band_for(res, "B200", 8, 1e15)  # far beyond any run's size: the nearest three, and the warning
    assert "GFLOP per token) is beyond 3x" in big.outside and len(big.nearest) == 3
    ok = band_for(res, "B200", 8, next(r["flops_per_token"] for r in res["runs"] if r["gpu"] == "B200"))
    assert ok.outside == "" and not ok.widened and ok.low < 1 < ok.high


def test_residuals_file_errors_name_the_file(tmp_path):
    good = json.loads((RUNS_DIR / "loo.json").read_text())
    for broken in ({k: v for k, v in good.items() if k != "step_overhead_s"}, {**good, "step_overhead_s": -0.1},
                   {**good, "runs": []}):
        path = tmp_path / "res.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=r"res\.json': not a residuals file of recipes\.plan_loo"):
            load_residuals(path)
    with pytest.raises(ValueError, match=r"nope\.json': no leave-one-out residuals; run python -m recipes\.plan_loo"):
        load_residuals(tmp_path / "nope.json")
