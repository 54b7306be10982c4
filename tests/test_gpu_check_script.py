"""benchmarks/gpu_check.sh runs on any machine: each step under its own timeout, a failure or a hang never
stops the next step, everything is logged and summarised, and the budget skips what does not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(tmp_path, steps, out_env=False, budget=580):
    areas = tmp_path / "areas"
    areas.mkdir(exist_ok=True)
    (areas / "a_ok.sh").write_text('echo "ok from $PY"; echo \'{"x": 1}\' > "$GPU_CHECK_OUT/res.json"\n')
    (areas / "b_fail.sh").write_text("echo failing; exit 3\n")
    (areas / "c_hang.sh").write_text("# timeout: 2\necho hanging; sleep 60; echo never\n")
    (areas / "d_after.sh").write_text("echo still runs\n")
    outdir = tmp_path / "out"
    env = dict(os.environ, PY=sys.executable, GPU_CHECK_D=str(areas), GPU_CHECK_STEPS=steps,
               GPU_CHECK_BUDGET=str(budget))
    env.pop("OUT", None)
    if out_env:
        env["OUT"] = str(outdir)
    args = ["bash", str(SCRIPT)] + ([] if out_env else [str(outdir)])
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return proc, outdir


@pytest.mark.timeout(90)
def test_steps_fail_time_out_and_continue(tmp_path):
    proc, out = _run(tmp_path, "a_ok b_fail c_hang d_after")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["a_ok", "PASS"], ["b_fail", "FAIL"], ["c_hang", "TIMEOUT"],
                                                     ["d_after", "PASS"]]
    assert "exit 3" in summary[1] and "exit 124" in summary[2]
    assert "never" not in (out / "steps" / "c_hang.log").read_text()  # killed at its 2 s timeout
    assert (out / "steps" / "a_ok" / "res.json").exists()  # an area's own output folder
    assert not (out / "steps" / "b_fail").exists()  # empty folders are removed
    log = (out / "gpu_check.log").read_text()
    assert f"ok from {sys.executable}" in log and "still runs" in log and "RESULT: FAILED" in log


@pytest.mark.timeout(60)
def test_passing_run_packs_steps_into_out(tmp_path):
    proc, out = _run(tmp_path, "a_ok d_after", out_env=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: all steps passed" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "steps.tar.gz", "summary.txt"]
    with tarfile.open(out / "steps.tar.gz") as tar:
        assert {"steps/a_ok.log", "steps/d_after.log", "steps/a_ok/res.json"} <= set(tar.getnames())


@pytest.mark.timeout(60)
def test_budget_skips_what_does_not_fit(tmp_path):
    proc, out = _run(tmp_path, "c_hang d_after", budget=21)  # c_hang takes >= 2 s: 19 s left < 20
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 1
    assert "c_hang" in summary and "d_after                  SKIPPED" in summary


@pytest.mark.timeout(60)
def test_steps_run_in_the_order_asked_and_typos_are_reported(tmp_path):
    proc, out = _run(tmp_path, "d_after a_ok no_such_area")
    assert proc.returncode == 1
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["d_after", "PASS"], ["a_ok", "PASS"],
                                                     ["no_such_area", "UNKNOWN"]]


@pytest.mark.timeout(60)
def test_default_order_runs_the_unmeasured_targets_first(tmp_path):
    """Without GPU_CHECK_STEPS: env, the compile warm-up, the areas with GPU performance targets (deep_gemm,
    flash_mla, model, experts; those present), pytest, verify, then the other areas alphabetically, each once."""
    areas = tmp_path / "areas"
    areas.mkdir()
    for name in ("zeta", "model", "alpha", "deep_gemm"):
        (areas / f"{name}.sh").write_text(f"echo {name}\n")
    outdir = tmp_path / "out"
    env = dict(os.environ, PY="false", GPU_CHECK_D=str(areas), GPU_CHECK_BUDGET="580")  # PY=false: core steps fail fast
    for key in ("OUT", "GPU_CHECK_STEPS"):
        env.pop(key, None)
    subprocess.run(["bash", str(SCRIPT), str(outdir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    order = [line.split()[0] for line in (outdir / "summary.txt").read_text().splitlines()]
    assert order == ["env", "warm", "deep_gemm", "model", "pytest", "verify", "alpha", "zeta"]


def _dry(tmp_path, **extra):
    env = dict(os.environ, GPU_CHECK_DRY="1", PY=sys.executable, **extra)
    for key in ("OUT", "GPU_CHECK_STEPS", "GPU_CHECK_D", "GPU_CHECK_BUDGET"):
        if key not in extra:
            env.pop(key, None)
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    summary = [line.split() for line in (tmp_path / "out" / "summary.txt").read_text().splitlines()]
    return proc, summary


@pytest.mark.timeout(90)
def test_dry_run_fits_every_step_of_the_real_check_in_nine_minutes(tmp_path):
    """The real areas, each stubbed to take its whole timeout: all of them fit the 580 s budget, warm-up and
    benchmarks before the tests, and every benchmark area in it."""
    proc, summary = _dry(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    names = [row[0] for row in summary]
    areas = sorted(p.stem for p in (REPO / "benchmarks" / "gpu_check.d").glob("*.sh"))
    assert set(names) == set(areas) | {"env", "warm", "pytest", "verify"}
    assert names.index("warm") < names.index("deep_gemm") < names.index("pytest")
    assert names.index("flash_mla") < names.index("pytest")
    assert all(row[1] == "PASS" for row in summary), summary
    total = sum(int(row[2].rstrip("s")) for row in summary)  # each step's simulated seconds = its timeout
    assert total <= 580
    assert f"need {total}s of the 580s budget; 0 step(s)" in proc.stdout
    assert (tmp_path / "out" / "steps" / "warm" / "dry.rows.jsonl").exists()  # the orchestration really ran


@pytest.mark.timeout(90)
def test_dry_run_fails_when_the_timeouts_do_not_fit(tmp_path):
    proc, summary = _dry(tmp_path, GPU_CHECK_BUDGET="300")
    assert proc.returncode == 1
    assert "RESULT: FAILED" in proc.stdout and "would get less than their timeout" in proc.stdout
    statuses = {row[0]: row[1] for row in summary}
    assert statuses["env"] == "PASS" and statuses["training"] == "SKIPPED"
    assert "TIMEOUT" in statuses.values()  # the step the budget cut short


@pytest.mark.timeout(90)
def test_dry_run_takes_measured_times(tmp_path):
    proc, summary = _dry(tmp_path, GPU_CHECK_DRY_TIMES="warm=30 pytest=10", GPU_CHECK_STEPS="env warm pytest")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert [(row[0], row[2]) for row in summary] == [("env", "15s"), ("warm", "30s"), ("pytest", "10s")]


def test_rows_are_written_as_they_are_measured(tmp_path):
    from recipes.benchutil import row_sink

    sink = row_sink(tmp_path / "bench.json", "decode")
    assert sink({"ms": 1.5}) == {"ms": 1.5}
    sink({"ms": 2.5})
    lines = (tmp_path / "bench.json.rows.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"table": "decode", "ms": 1.5}, {"table": "decode", "ms": 2.5}]
    assert row_sink(None, "x")({"a": 1}) == {"a": 1}


def test_autotune_shards_cover_every_config_once(monkeypatch):
    from accel import autotune

    configs = list(range(5))
    assert autotune.shard(configs) == configs
    picked = []
    for i in range(3):
        monkeypatch.setenv(autotune.SHARD_ENV, f"{i}/3")
        picked += autotune.shard(configs)
    assert sorted(picked) == configs
    monkeypatch.setenv(autotune.SHARD_ENV, "6/7")
    assert autotune.shard(configs) == [1]  # a shard past the list still compiles one config
    monkeypatch.setenv(autotune.SHARD_ENV, "3/2")
    with pytest.raises(ValueError, match="DSV3_AUTOTUNE_SHARD"):
        autotune.shard(configs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("capability", ["90", "100"])
def test_dry_run_fits_the_budget_on_hopper_and_blackwell(tmp_path, capability):
    """GPU_CHECK_CAPABILITY picks the per-capability configs; the whole check fits 580 s on either generation."""
    proc, summary = _dry(tmp_path, GPU_CHECK_CAPABILITY=capability)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert f"capability sm_{capability}," in proc.stdout and f"summary, sm_{capability} " in proc.stdout
    assert sum(int(row[2].rstrip("s")) for row in summary) <= 580


@pytest.mark.timeout(60)
def test_step_timeouts_by_capability(tmp_path):
    areas = tmp_path / "areas"
    areas.mkdir()
    (areas / "bench.sh").write_text("# timeout: 30\n# timeout@100: 40\necho hi\n")
    times = {}
    for capability in ("90", "100"):
        proc, summary = _dry(tmp_path / capability, GPU_CHECK_CAPABILITY=capability, GPU_CHECK_D=str(areas),
                             GPU_CHECK_STEPS="bench")
        times[capability] = summary[0][2]
    assert times == {"90": "30s", "100": "40s"}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "bad")], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, GPU_CHECK_DRY="1", GPU_CHECK_CAPABILITY="sm100"), timeout=30)
    assert proc.returncode == 2 and "GPU_CHECK_CAPABILITY must be" in proc.stderr


@pytest.mark.parametrize("capability, runs", [
    ("90", [["--quick", "--json"]]),
    ("100", [["--quick", "--m", "4096", "--json"], ["--quick", "--m", "4096", "--recipe", "mxfp8", "--no-baseline"]]),
])
def test_deep_gemm_area_picks_rows_by_capability(tmp_path, capability, runs):
    env = dict(os.environ, PY="echo", GPU_CHECK_CAPABILITY=capability, GPU_CHECK_OUT=str(tmp_path))
    env.pop("DEEP_GEMM_BENCH_ARGS", None)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.d" / "deep_gemm.sh")], env=env,
                          capture_output=True, text=True, timeout=30)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == len(runs)
    for line, want in zip(lines, runs):
        assert " ".join(want) in line and line.startswith("-m recipes.bench_kernels deep_gemm")


def test_autotune_lists_by_capability():
    from accel import autotune
    from deep_gemm.kernels import gemm

    lists = {90: ["hopper"], 100: ["blackwell"]}
    assert [autotune.for_capability(lists, c) for c in ((9, 0), 90, (10, 0), (12, 0), (8, 9), None)] == [
        ["hopper"], ["hopper"], ["blackwell"], ["blackwell"], ["hopper"], ["hopper"]]
    assert gemm.tiles_for((10, 0)) == gemm.TILES[100] != gemm.TILES[90] == gemm.tiles_for(None)


def test_tiles_by_operand_kind_and_capability():
    """MXFP8 takes 128-row tiles (Blackwell's block-scaled MMA needs them; Hopper's bf16 emulation spills smaller
    ones); blockwise FP8 with per-row B scales drops 128x128 on Blackwell (it spills there). The autotuner prunes
    per launch by the same rule."""
    import triton

    from deep_gemm.kernels import gemm

    for cap in (90, 100):
        assert {t[0] for t in gemm.tiles_for(cap, mx=True)} == {128}
    assert (128, 128) not in {t[:2] for t in gemm.tiles_for(100, row_scaled_b=True)}
    assert gemm.tiles_for(90, row_scaled_b=True) == gemm.TILES[90]
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": 128, "GROUP_M": 8}) for bm in (128, 64)]
    assert [c.kwargs["BLOCK_M"] for c in gemm._prune(configs, {}, MX=True, FP8=True, SFB_GRAN_N=1)] == [128]
    assert gemm._prune(configs, {}, MX=False, FP8=True, SFB_GRAN_N=1) == configs  # no GPU here: Hopper's rule
