#!/usr/bin/env bash
# flash_mla on one GPU (H200): compiled-kernel tests at realistic shapes, the harness, then the benchmark
# (--quick rows; FLASH_MLA_BENCH_ARGS= runs the full sweep: several minutes). Run from the repo root.
# timeout: 100
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
DSV3_KERNEL_IMPL=auto timeout 40 "$PY" -m pytest -q tests/test_flash_mla_gpu.py -x --durations=10
timeout 25 "$PY" -m recipes.verify_kernels --ops 'flash_mla.*' --seeds 2 --bench-shapes \
    --json "$OUTDIR/flash_mla_verify.json"
timeout 35 "$PY" -m recipes.bench_kernels flash_mla ${FLASH_MLA_BENCH_ARGS---quick} --json "$OUTDIR/flash_mla_bench.json"
