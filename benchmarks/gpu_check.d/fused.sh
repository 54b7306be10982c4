#!/usr/bin/env bash
# fused_ops on one GPU (H200): the three rows with targets (RMSNorm+residual, SwiGLU+quant, permute+quant at
# V3's shapes) against the unfused PyTorch sequence and the HBM peak, same run (FUSED_BENCH_ARGS= runs every
# fused op). Runs after the verify step, which compiles these kernels at the same shapes (Triton's cache) and
# checks them strictly; each row lands in fused_bench.json.rows.jsonl as soon as it is measured.
# timeout: 5
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
"$PY" -m recipes.bench_kernels fused ${FUSED_BENCH_ARGS---quick} --json "$OUTDIR/fused_bench.json"
