"""The two kernel command lines: recipes.verify_kernels (in-process and as a fresh process) and the
recipes.bench_kernels dispatcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from accel import registry
from recipes import bench_kernels, verify_kernels
from tests import toy_kernels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def toys():
    names = toy_kernels.register_toys()
    yield names
    toy_kernels.unregister_toys()


@pytest.mark.timeout(120)
def test_cli_passes_and_writes_json(toys, tmp_path, capsys):
    path = tmp_path / "verify.json"
    assert verify_kernels.main(["--ops", "toy.axpby", "--seeds", "5", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "toy.axpby" in out and "PASS" in out and "FAIL" not in out
    assert "PASSED: 15/15 checks over 1 ops" in out
    doc = json.loads(path.read_text())
    assert doc["passed"] is True and doc["errors"] == [] and doc["complete"] is True
    assert [r["shape"] for r in doc["rows"]] == ["n=37", "n=256", "n=1000"]
    assert all(r["seeds"] == "5/5" and r["kernel_ms"] > 0 for r in doc["rows"])
    assert len(doc["results"]) == 15 and {r["op"] for r in doc["results"]} == {"toy.axpby"}


@pytest.mark.timeout(120)
def test_cli_fails_on_a_broken_kernel_and_replays_seeds(toys, capsys):
    status = verify_kernels.main(["--ops", "toy.mutates_input", "--ops", "toy.axpby_out", "--seed", "7",
                                  "--seed", "8", "--no-bench"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL toy.mutates_input [n=37] seeds=7,8: kernel modified its inputs: x" in out
    assert "FAILED: 6/12 checks over 2 ops" in out  # axpby_out's 6 pass, mutates_input's 6 fail
    assert "[1/2] toy.axpby_out ... PASS 6/6" in out and "[2/2] toy.mutates_input ... FAIL 0/6" in out


def test_cli_nothing_to_verify(toys, monkeypatch, capsys):
    assert verify_kernels.main(["--ops", "no_such_area.*"]) == 2
    assert "no registered op matches no_such_area.*" in capsys.readouterr().err
    monkeypatch.setattr(registry, "_OPS", {})
    monkeypatch.setattr(registry, "import_kernel_packages", lambda *a: {})
    assert verify_kernels.main([]) == 2
    assert "no kernel ops are registered: nothing to verify" in capsys.readouterr().err


def test_cli_lists_ops(toys, monkeypatch, capsys):
    monkeypatch.setattr(registry, "import_kernel_packages", lambda pkgs: {})  # the toys are enough here
    assert verify_kernels.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "toy.axpby" in out and "verify_shapes" in out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        verify_kernels.main(["--seeds", "0"])
    assert info.value.code == 2 and "--seeds 0" in capsys.readouterr().err


def test_package_errors_only_matter_to_matching_globs():
    assert verify_kernels._concerns("deep_gemm", None)
    assert verify_kernels._concerns("deep_gemm", ["*"])
    assert verify_kernels._concerns("deep_gemm", ["deep_gemm.*"])
    assert verify_kernels._concerns("deep_gemm", ["deep*"])
    assert verify_kernels._concerns("deep_gemm", ["deep_gemm.fp8_gemm_nt"])
    assert not verify_kernels._concerns("flash_mla", ["deep_gemm.*"])
    assert not verify_kernels._concerns("deep_gemm", ["toy.*", "flash_mla.*"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_as_a_fresh_process(tmp_path):
    """No TRITON_INTERPRET in the environment: the CLI itself must switch the interpreter on (cpu)."""
    path = tmp_path / "v.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV3_KERNEL_IMPL")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.verify_kernels", "--import", "tests.toy_kernels_plugin",
         "--ops", "toy.axpby", "--ops", "toy.unwritten_output", "--seeds", "5", "--no-bench", "--json", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL toy.unwritten_output [n=37]" in proc.stdout
    assert "timings here" in proc.stdout  # the cpu note
    doc = json.loads(path.read_text())
    assert doc["context"]["triton_interpreted"] is True
    assert {(r["op"], r["result"]) for r in doc["rows"]} == {("toy.axpby", "PASS"), ("toy.unwritten_output", "FAIL")}


@pytest.mark.slow
def test_bench_kernels_dispatches(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("recipes.bench_deep_gemm")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "recipes.bench_deep_gemm", fake)
    monkeypatch.setitem(sys.modules, "recipes.bench_flash_mla", None)  # not in this checkout
    assert bench_kernels.main(["deep_gemm", "--m", "64", "--json", "x.json"]) == 0
    assert seen == [["--m", "64", "--json", "x.json"]]
    assert bench_kernels.main(["flash_mla"]) == 2
    assert "no flash_mla benchmark: module recipes.bench_flash_mla is not in this checkout" in capsys.readouterr().err
    assert bench_kernels.main(["all", "--quick"]) == 2  # deep_gemm ran, flash_mla missing
    assert seen[-1] == ["--quick"]
    with pytest.raises(SystemExit):
        bench_kernels.main(["cutlass"])


def test_cli_reports_a_broken_kernel_package(toys, monkeypatch, capsys):
    monkeypatch.setattr(registry, "KERNEL_PACKAGES", ("fake_gemm", "fake_attention"))
    monkeypatch.setattr(registry, "import_kernel_packages",
                        lambda pkgs: {p: "ImportError: cannot import name 'x'" for p in pkgs})
    assert verify_kernels.main(["--ops", "fake_gemm.*"]) == 1  # nothing verifiable, and the cause is shown
    err = capsys.readouterr().err
    assert "ERROR kernel package fake_gemm failed to import: ImportError: cannot import name 'x'" in err
    assert "fake_attention" not in err  # not selected by the glob, so not imported


def test_cli_skips_bench_shapes_on_cpu(toys, capsys):
    assert verify_kernels.main(["--ops", "toy.axpby", "--bench-shapes", "--no-bench", "--seeds", "1"]) == 0
    assert "--bench-shapes skipped on cpu" in capsys.readouterr().out
