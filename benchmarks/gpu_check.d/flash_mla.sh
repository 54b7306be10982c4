#!/usr/bin/env bash
# flash_mla on one GPU (H200): compiled-kernel tests at realistic shapes, the harness, then the benchmark.
# Run from the repo root; about 2 minutes (FLASH_MLA_BENCH_ARGS= runs the full sweep: several minutes). Results go to benchmarks/results/flash_mla_*.
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p benchmarks/results
flash_mla_check() {
    TRITON_INTERPRET=0 DSV3_KERNEL_IMPL=auto timeout 600 "$PY" -m pytest -q tests/test_flash_mla_gpu.py -x --durations=10
    TRITON_INTERPRET=0 timeout 300 "$PY" -m recipes.verify_kernels --ops 'flash_mla.*' --seeds 2 --bench-shapes \
        --json benchmarks/results/flash_mla_verify.json
    TRITON_INTERPRET=0 timeout 600 "$PY" -m recipes.bench_kernels flash_mla ${FLASH_MLA_BENCH_ARGS---quick} \
        --json benchmarks/results/flash_mla_bench.json
}
flash_mla_check "$@"
