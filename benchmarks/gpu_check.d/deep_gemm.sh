#!/usr/bin/env bash
# deep_gemm on one GPU: ours vs torch bf16 / torch._scaled_mm, autotuned, and the DSA indexer logits
# (fp8_mqa_logits at s 8K and 32K). Rows by capability (GPU_CHECK_CAPABILITY): sm_90 (H200), --quick: M 128 and
# 4096 at N, K = 7168, 16384 and 4096, 7168, one grouped shape, DeepSeek-V3's blockwise recipe; sm_100 (B200 /
# GB200): the same shapes at M = 4096 in both recipes, blockwise with the torch baselines and the logits, MXFP8
# (native block-scaled tcgen05 MMA there) ours only, about as many timed kernels as on sm_90.
# DEEP_GEMM_BENCH_ARGS= for all rows of one recipe. Kernels come compiled from the warm step; each row lands in
# deep_gemm_bench.json.rows.jsonl as soon as it is measured. The GPU correctness tests
# (tests/test_deep_gemm_gpu.py) run in the pytest step, after every benchmark.
# timeout: 45
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
if [[ -n "${DEEP_GEMM_BENCH_ARGS+set}" || ${GPU_CHECK_CAPABILITY:-90} -lt 100 ]]; then
    exec "$PY" -m recipes.bench_kernels deep_gemm ${DEEP_GEMM_BENCH_ARGS---quick} --json "$OUTDIR/deep_gemm_bench.json"
fi
"$PY" -m recipes.bench_kernels deep_gemm --quick --m 4096 --json "$OUTDIR/deep_gemm_bench.json"
rc=$?
"$PY" -m recipes.bench_kernels deep_gemm --quick --m 4096 --recipe mxfp8 --no-baseline \
    --json "$OUTDIR/deep_gemm_mxfp8_bench.json" || rc=$?
exit $rc
