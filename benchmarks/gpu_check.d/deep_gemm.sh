#!/usr/bin/env bash
# deep_gemm on one GPU (H200): compiled-kernel tests at DeepSeek-V3 shapes (one kernel config, no
# autotuning), then ours vs torch bf16 / torch._scaled_mm, autotuned (--quick rows; DEEP_GEMM_BENCH_ARGS= for all).
# timeout: 100
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
DSV3_KERNEL_IMPL=auto DSV3_DEEP_GEMM_AUTOTUNE=0 timeout 40 "$PY" -m pytest -q tests/test_deep_gemm_gpu.py -x --durations=5
timeout 55 "$PY" -m recipes.bench_kernels deep_gemm ${DEEP_GEMM_BENCH_ARGS---quick} --json "$OUTDIR/deep_gemm_bench.json"
