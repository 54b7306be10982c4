#!/usr/bin/env bash
# planner on one GPU (H200), from the repo root, under 45 s: predicted vs measured for debug_gpu (issue 15).
#  1. python -m recipes.plan calibrate on this GPU: GEMM, grouped-GEMM, attention and copy efficiencies at
#     bench_cpu's shapes, written as a system file (gpu.json);
#  2. debug_gpu trained 12 steps in one process (pp1 dp1 ep1, 8 micro-batches of 2 x 512 tokens), the
#     measured tokens/s = the median over the steps after the fourth (metrics.jsonl);
#  3. the plan's tokens/s for exactly that layout (--fix) with the calibrated file and with the shipped,
#     uncalibrated H200 file, printed beside the measured figure (planner.json): record them in
#     benchmarks/planner.md with the date and commit.
# timeout: 45
set -uo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0 DSV3_KERNEL_IMPL=auto WANDB_MODE=disabled
timeout 15 "$PY" -m recipes.plan calibrate --out "$OUTDIR/gpu.json" --model bench_cpu --tokens 1024 --seq-len 512 \
  --ep 1 || echo "calibrate failed or ran out of time: the shipped H200 file only"
timeout 20 "$PY" -m recipes.train --config recipes/configs/debug_gpu.toml --nproc 1 --set parallel.pp=1 \
  --set parallel.dp=1 --set parallel.ep=1 --set parallel.schedule=none --set run.steps=12 \
  --set data.global_batch=16 --set optim.warmup_steps=5 --set logging.progress=false \
  --set checkpoint.interval=0 --set checkpoint.final=false --set run.sample_tokens=0 --run-dir "$OUTDIR/run" \
  || echo "the training run failed or ran out of time: no measured figure"
PLAN=(--model recipes/configs/debug_gpu.toml --gpus 1 --seq-len 512 --global-batch 16
      --fix pp=1,dp=1,ep=1,schedule=none,micro_batch=2,microbatches=8,fp8=true,recompute=none,moments=param)
[[ -f "$OUTDIR/gpu.json" ]] && timeout 8 "$PY" -m recipes.plan "${PLAN[@]}" --system "$OUTDIR/gpu.json" \
  --json "$OUTDIR/plan_calibrated.json" >/dev/null
timeout 8 "$PY" -m recipes.plan "${PLAN[@]}" --gpu H200 --json "$OUTDIR/plan_shipped.json" >/dev/null
"$PY" - "$OUTDIR" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
metrics = out / "run" / "metrics.jsonl"
rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][4:]
measured = statistics.median(speeds) if speeds else None
result = {"measured_tokens_per_s": measured}
for name in ("calibrated", "shipped"):
    plan = out / f"plan_{name}.json"
    if plan.exists():
        predicted = json.loads(plan.read_text())[0]["tokens_per_s"]
        result[f"predicted_{name}_tokens_per_s"] = predicted
        ratio = f", predicted / measured {predicted / measured:.3f}" if measured else ""
        print(f"planner ({name} system file): predicted {predicted:.4g} tokens/s{ratio}")
print(f"debug_gpu measured: {measured:.4g} tokens/s (median of {len(speeds)} steps)" if measured
      else "debug_gpu measured: none")
(out / "planner.json").write_text(json.dumps(result, indent=1))
sys.exit(0 if measured and len(result) > 1 else 1)
PY
