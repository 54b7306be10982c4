"""benchmarks/gpu_check.sh runs on any machine: each step under its own timeout, a failure or a hang never
stops the next step, everything is logged and summarised, and the budget skips what does not fit."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(tmp_path, steps, out_env=False, budget=540):
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
    """Without GPU_CHECK_STEPS: env, the areas with GPU performance targets (deep_gemm, flash_mla, model,
    experts; those present), pytest, verify, then the other areas alphabetically, each once."""
    areas = tmp_path / "areas"
    areas.mkdir()
    for name in ("zeta", "model", "alpha", "deep_gemm"):
        (areas / f"{name}.sh").write_text(f"echo {name}\n")
    outdir = tmp_path / "out"
    env = dict(os.environ, PY="false", GPU_CHECK_D=str(areas), GPU_CHECK_BUDGET="540")  # PY=false: core steps fail fast
    for key in ("OUT", "GPU_CHECK_STEPS"):
        env.pop(key, None)
    subprocess.run(["bash", str(SCRIPT), str(outdir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    order = [line.split()[0] for line in (outdir / "summary.txt").read_text().splitlines()]
    assert order == ["env", "deep_gemm", "model", "pytest", "verify", "alpha", "zeta"]
