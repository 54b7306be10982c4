#!/usr/bin/env bash
# deep_gemm on one GPU (H200): ours vs torch bf16 / torch._scaled_mm, autotuned, and the DSA indexer logits
# (fp8_mqa_logits at s 8K and 32K) (--quick rows: M 128 and 4096 at
# N, K = 7168, 16384 and 4096, 7168, one grouped shape; DEEP_GEMM_BENCH_ARGS= for all). Kernels come compiled from
# the warm step; each row lands in deep_gemm_bench.json.rows.jsonl as soon as it is measured. The GPU
# correctness tests (tests/test_deep_gemm_gpu.py) run in the pytest step, after every benchmark.
# timeout: 45
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
"$PY" -m recipes.bench_kernels deep_gemm ${DEEP_GEMM_BENCH_ARGS---quick} --json "$OUTDIR/deep_gemm_bench.json"
