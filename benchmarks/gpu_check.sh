#!/usr/bin/env bash
# The one script a GPU session runs, from the repo root:   bash benchmarks/gpu_check.sh [OUTDIR]
#
# Steps, in order, each with its own timeout, each logged, a failure never stops the next one:
#   env        nvidia-smi, python / torch / triton versions, what accel detects (backend, device, spec)
#   warm       python -m recipes.warm_kernels: every deep_gemm / flash_mla kernel compiled at every autotune
#              config on the host's cores, in parallel, into Triton's cache (so no benchmark waits on ptxas)
#   deep_gemm, flash_mla   the kernel benchmarks (benchmarks/gpu_check.d/<area>.sh, header "# timeout: SECONDS");
#              each row is appended to <area>/*.rows.jsonl the moment it is measured
#   model, experts, fused, compile  the other areas with GPU performance targets (compile: eager vs torch.compile
#              and CUDA graphs of a block, recipes.bench_compile)
#   pytest     pytest -m gpu over tests/ (after the benchmarks: a failing test cannot cost a number)
#   verify     python -m recipes.verify_kernels --bench-shapes (strict); an area script of a core step's name
#              (gpu_check.d/verify.sh) replaces it
#   <area>     the other benchmarks/gpu_check.d/*.sh, alphabetically
# then a summary (OUTDIR/summary.txt). Installs nothing: it uses the python that already has torch
# ($PY, else .venv/bin/python, else python3) with the checkout on PYTHONPATH.
#
# OUTDIR defaults to $OUT when set, else ./gpu_results. Files there: summary.txt, gpu_check.log (all
# output), verify_kernels.json, and steps/<step>.log plus steps/<area>/ (each area script gets that
# folder as $GPU_CHECK_OUT). When OUTDIR is $OUT (the device tool brings back at most 8 files),
# steps/ is packed into steps.tar.gz.
#
# Capability: GPU_CHECK_CAPABILITY (90 = sm_90 Hopper, 100 = sm_100 Blackwell; default: the first GPU's, from
# nvidia-smi, else 90) is exported to every step. Area scripts pick their configs by it (deep_gemm.sh: MXFP8 rows
# on sm_100), and a step's timeout may differ per capability: a header "# timeout@100: SECONDS" beside
# "# timeout: SECONDS" (the default) in an area script.
#
# Knobs: GPU_CHECK_BUDGET (total seconds, default 580: one 10-minute device call; a step gets at
# most what is left, and is skipped with under 20 s left), GPU_CHECK_STEPS (space-separated step
# names, run in that order: "verify flash_mla env"; default all), GPU_CHECK_D (the area-script
# folder), GPU_CHECK_PACK (1/0), GPU_CHECK_JOBS (warm-up processes; default: all cores).
#
# Dry mode, on any machine: GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh runs the same orchestration with
# every step stubbed to take its whole timeout on a simulated clock (or the seconds given for it in
# GPU_CHECK_DRY_TIMES="warm=80 model=30"), and fails unless every step gets its full timeout within the
# budget: the budget arithmetic of the real run, checked on a CPU; GPU_CHECK_DRY=1 GPU_CHECK_CAPABILITY=100 checks
# it for a Blackwell machine (the default in dry mode is 90 unless a GPU is visible).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUTDIR="${1:-${OUT:-$REPO/gpu_results}}"
mkdir -p "$OUTDIR/steps"
OUTDIR="$(cd "$OUTDIR" && pwd)"
ALL="$OUTDIR/gpu_check.log"
SUMMARY="$OUTDIR/summary.txt"
: >"$ALL"
: >"$SUMMARY"
BUDGET="${GPU_CHECK_BUDGET:-580}"
AREA_DIR="${GPU_CHECK_D:-$REPO/benchmarks/gpu_check.d}"
ONLY="${GPU_CHECK_STEPS:-}"
START=$SECONDS
FAILED=0
DRY="${GPU_CHECK_DRY:-0}"
DRY_CLOCK=0       # the simulated seconds spent, in dry mode
SHORTED=0         # steps that got less than their timeout (dry mode fails on any)

elapsed() { if [[ $DRY == 1 ]]; then echo "$DRY_CLOCK"; else echo $((SECONDS - START)); fi; }

# dry_seconds NAME LIMIT: how long a stubbed step takes (GPU_CHECK_DRY_TIMES, else its whole limit)
dry_seconds() {
    local pair
    for pair in ${GPU_CHECK_DRY_TIMES:-}; do
        [[ ${pair%%=*} == "$1" ]] && { echo "${pair#*=}"; return; }
    done
    echo "$2"
}

if [[ -z "${PY:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]] && "$REPO/.venv/bin/python" -c "import torch" 2>/dev/null; then
        PY="$REPO/.venv/bin/python"
    else
        PY=python3
    fi
fi
# The compute capability as major*10+minor: 90 (H100/H200/H800), 100 (B200/GB200), from the first GPU.
detect_capability() {
    local cap
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
    [[ $cap =~ ^[0-9]+$ ]] && echo "$cap" || echo 90
}
CAPABILITY="${GPU_CHECK_CAPABILITY:-$(detect_capability)}"
if ! [[ $CAPABILITY =~ ^[0-9]+$ ]]; then
    echo "gpu_check: GPU_CHECK_CAPABILITY must be a compute capability as an integer (90, 100), got '$CAPABILITY'" >&2
    exit 2
fi
export GPU_CHECK_CAPABILITY="$CAPABILITY"
export PY REPO OUTDIR
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Real kernels on the GPU: tests/conftest.py defaults TRITON_INTERPRET to 1 only when it is unset.
export TRITON_INTERPRET=0

say() { echo "$*" | tee -a "$ALL"; }

# run_step NAME TIMEOUT COMMAND...: run with the smaller of TIMEOUT and the budget left, log, record.
run_step() {
    local name="$1" limit="$2" want="$2"
    shift 2
    local left=$((BUDGET - $(elapsed)))
    if ((left < 20)); then
        SHORTED=$((SHORTED + 1))
        printf '%-24s %-8s %6s  %s\n' "$name" SKIPPED - "budget of ${BUDGET}s spent" >>"$SUMMARY"
        say "== $name: skipped, budget of ${BUDGET}s spent"
        FAILED=1
        return 0
    fi
    if ((limit > left)); then
        SHORTED=$((SHORTED + 1))
        say "== $name: only ${left}s of its ${limit}s timeout left in the budget"
        limit=$left
    fi
    local log="$OUTDIR/steps/$name.log" t0=$SECONDS rc took
    export GPU_CHECK_OUT="$OUTDIR/steps/$name"
    mkdir -p "$GPU_CHECK_OUT"
    say "== $name (timeout ${limit}s): $*"
    : >"$log"
    if [[ $DRY == 1 ]]; then  # stub: no command runs; the step takes its simulated seconds (capped by its timeout)
        took=$(dry_seconds "$name" "$limit")
        ((took > limit)) && took=$limit
        echo "dry run: would run $* (simulated ${took}s)" | tee -a "$ALL" "$log"
        echo "{\"step\": \"$name\", \"dry_seconds\": $took}" >"$GPU_CHECK_OUT/dry.rows.jsonl"
        DRY_CLOCK=$((DRY_CLOCK + took))
        rc=0
        ((took >= limit && limit < want)) && rc=124
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$ALL" "$log"
        rc=${PIPESTATUS[0]}
        took=$((SECONDS - t0))
    fi
    rmdir "$GPU_CHECK_OUT" 2>/dev/null  # keep only folders a step wrote into
    local status=PASS
    case $rc in
        0) ;;
        124 | 137) status=TIMEOUT ;;
        5) [[ "$name" == pytest ]] && status=NO-TESTS || status=FAIL ;;
        *) status=FAIL ;;
    esac
    [[ $status == PASS || $status == NO-TESTS ]] || FAILED=1
    printf '%-24s %-8s %5ss  exit %s, log steps/%s.log\n' "$name" "$status" "$took" "$rc" "$name" \
        >>"$SUMMARY"
    say "== $name: $status (exit $rc, ${took}s)"
}

env_report() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
        nvidia-smi
    else
        echo "nvidia-smi: not found (no NVIDIA driver here)"
    fi
    command -v mthreads-gmi >/dev/null && mthreads-gmi
    "$PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
import accel
spec = accel.lookup(accel.device_name())
print("accel: backend", accel.backend(), "| device", accel.default_device(), accel.device_name(),
      "| capability", accel.device_capability(), "| fp8 native", accel.fp8_native(), "| dist", accel.dist_backend())
print("accel: spec", spec, "| triton", accel.triton_available(), accel.triton_unavailable_reason() or "")
EOF
}

say "gpu_check: $(date -u '+%Y-%m-%d %H:%M UTC'), repo $REPO at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null), python $PY, outdir $OUTDIR, capability sm_$CAPABILITY, budget ${BUDGET}s$([[ $DRY == 1 ]] && echo ', DRY RUN (nothing runs; simulated clock)')"

export -f env_report  # `timeout` runs programs, not shell functions

# run_named NAME: one step by name: an area script benchmarks/gpu_check.d/NAME.sh, else a core step.
run_named() {
    local name="$1" script="$AREA_DIR/$1.sh" limit
    if [[ -f "$script" ]]; then  # "# timeout@<capability>: S" wins over "# timeout: S"
        limit="$(sed -n "s/^# *timeout@$CAPABILITY: *\([0-9][0-9]*\).*/\1/p" "$script" | head -n1)"
        [[ -n $limit ]] || limit="$(sed -n 's/^# *timeout: *\([0-9][0-9]*\).*/\1/p' "$script" | head -n1)"
        run_step "$name" "${limit:-60}" bash "$script"
        return 0
    fi
    case "$name" in
        env) run_step env 15 bash -c env_report ;;
        warm) run_step warm 100 "$PY" -m recipes.warm_kernels --jobs "${GPU_CHECK_JOBS:-$(nproc)}" --timeout 90 ;;
        # --continue-on-collection-errors: a module needing a package this machine lacks must not hide the rest.
        pytest) run_step pytest 55 env DSV3_DEEP_GEMM_AUTOTUNE=0 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
            --continue-on-collection-errors --timeout 45 tests ;;
        verify) run_step verify 40 env DSV3_STRICT_KERNELS=1 DSV3_DEEP_GEMM_AUTOTUNE=0 "$PY" -m recipes.verify_kernels --bench-shapes --seeds 2 \
            --json "$OUTDIR/verify_kernels.json" ;;
        *)
            printf '%-24s %-8s %6s  %s\n' "$name" UNKNOWN - "no such step (env, warm, pytest, verify, or $AREA_DIR/*.sh)" \
                >>"$SUMMARY"
            say "== $name: unknown step"
            FAILED=1
            ;;
    esac
}

# Default order: env, the kernel warm-up, the areas whose performance targets have no GPU figure yet
# (benchmarks first), pytest, verify, then the other areas alphabetically. GPU_CHECK_STEPS picks and orders.
CORE=(env warm pytest verify)
FIRST=(env warm deep_gemm flash_mla model experts fused compile pytest verify)
if [[ -n "$ONLY" ]]; then
    read -r -a ORDER <<<"$ONLY"
else
    ORDER=()
    for name in "${FIRST[@]}"; do
        [[ " ${CORE[*]} " =~ " $name " || -f "$AREA_DIR/$name.sh" ]] && ORDER+=("$name")
    done
    for script in "$AREA_DIR"/*.sh; do
        name="$(basename "$script" .sh)"
        [[ -f "$script" && ! " ${FIRST[*]} " =~ " $name " ]] && ORDER+=("$name")
    done
fi
for name in "${ORDER[@]}"; do
    run_named "$name"
done

pack="${GPU_CHECK_PACK:-}"
if [[ -z "$pack" ]]; then
    [[ -n "${OUT:-}" && "$(cd "$OUT" 2>/dev/null && pwd)" == "$OUTDIR" ]] && pack=1 || pack=0
fi
if [[ "$pack" == 1 ]]; then
    tar -C "$OUTDIR" -czf "$OUTDIR/steps.tar.gz" steps && rm -rf "$OUTDIR/steps"
fi

if [[ $DRY == 1 ]]; then
    ((SHORTED)) && FAILED=1
    BUDGET_LINE="dry run: the steps' timeouts need ${DRY_CLOCK}s of the ${BUDGET}s budget; $SHORTED step(s) would get less than their timeout"
fi
{
    echo "== gpu_check summary, sm_$CAPABILITY ($(elapsed)s of ${BUDGET}s budget$([[ $DRY == 1 ]] && echo ', simulated')) =="
    cat "$SUMMARY"
    [[ -n "${BUDGET_LINE:-}" ]] && echo "$BUDGET_LINE"
    ((FAILED)) && echo "RESULT: FAILED" || echo "RESULT: all steps passed"
} | tee -a "$ALL"
exit $FAILED
