#!/usr/bin/env bash
# fused_ops on one GPU (H200): the three rows with targets (RMSNorm+residual, SwiGLU+quant, permute+quant at
# V3's shapes) against the unfused PyTorch sequence and the HBM peak, same run (FUSED_BENCH_ARGS= runs every
# fused op). Runs among the first steps (no GPU figure yet), so it compiles its own kernels (a few seconds);
# each row lands in fused_bench.json.rows.jsonl as soon as it is measured.
# timeout: 25
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
"$PY" -m recipes.bench_kernels fused ${FUSED_BENCH_ARGS---quick} --json "$OUTDIR/fused_bench.json"
