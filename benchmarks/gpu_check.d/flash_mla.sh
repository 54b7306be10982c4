#!/usr/bin/env bash
# flash_mla on one GPU (H200): the decode benchmark (--quick: the memory-bound rows s_q 1, h_q 16 and 128 over
# 16K-token caches, bf16 and FP8, plus MTP s_q 2) and training attention fwd+bwd vs torch SDPA
# (FLASH_MLA_BENCH_ARGS= runs the full sweep: several minutes), and DSA sparse prefill (--quick: forward at s 8K
# and 64K, forward+backward at 8K beside dense mla_attention; h_q 128, top-k 2048). Kernels come compiled from the warm step; each
# row lands in flash_mla_bench_*.json.rows.jsonl as soon as it is measured. The GPU correctness tests
# (tests/test_flash_mla_gpu.py) run in the pytest step, after every benchmark.
# timeout: 60
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
"$PY" -m recipes.bench_kernels flash_mla ${FLASH_MLA_BENCH_ARGS---quick} --json "$OUTDIR/flash_mla_bench.json"
