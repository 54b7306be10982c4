#!/usr/bin/env bash
# The public kernel-verification suite (tests/verify_suite/) on a GPU: each problem's Triton candidate through
# the four gates (compiles, correct, no_fallback, faster: device-event medians with L2 flushed vs the
# reference and the vendor path), one subprocess per candidate.   bash benchmarks/verify_suite_gpu.sh [OUTDIR]
# Writes OUTDIR/verify_suite.json (per-gate verdicts, speed-ups, fast_p) and prints the table.
# Not yet a gpu_check.sh area: that script's 540 s budget has 10 s left (see benchmarks/verify.md).
# timeout: 150
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY=${PY:-python3}
OUTDIR=${1:-${GPU_CHECK_OUT:-benchmarks/results}}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0 DSV3_DEEP_GEMM_AUTOTUNE=0 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m recipes.verify_kernels --suite tests/verify_suite --timeout 60 --json "$OUTDIR/verify_suite.json"
