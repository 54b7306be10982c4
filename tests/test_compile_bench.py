"""``python -m recipes.bench_compile``, the benchmark behind ``benchmarks/compile.md`` and ``gpu_check``'s compile
row: bad arguments are refused in one line (exit 2) before any model is built, on any machine; on a CPU the whole
script runs (the eager and compiled whole-model step, the loss check, the JSON report)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from recipes import bench_compile


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--cuda-graph"], "--cuda-graph captures CUDA graphs: it needs --device cuda, got --device cpu"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--backend", "tvm"], "argument --backend: invalid choice: 'tvm'"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: no CUDA device is visible")]))
def test_bad_arguments_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench_compile, "Transformer", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_info:
        bench_compile.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DSV3_FULL_COMPILE") != "1",
                    reason="opt-in (DSV3_FULL_COMPILE=1): compiles the whole model on the CPU, ~0.5 min")
def test_cpu_run_reports_eager_and_compiled(tmp_path, capsys):
    out = tmp_path / "compile.json"
    bench_compile.main(["--backend", "aot_eager", "--steps", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["run"] for r in report["rows"]] == ["eager", "compiled (aot_eager)"]
    assert all(float(r["main-thread CPU ms / layer / mb"].split()[0]) > 0 for r in report["rows"])
    assert "eager / compiled host CPU" in report["notes"][0]
