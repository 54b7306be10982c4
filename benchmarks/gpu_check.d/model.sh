#!/usr/bin/env bash
# models/deepseek_v3 on one GPU (H200), from the repo root, under 45 s:
#  1. bench_model: a training step (forward+backward, bf16) of the 3-layer "bench_gpu" preset
#     (dim 2048, 64 experts top-6, V3 head dims), ours (deep_gemm / flash_mla Triton kernels) vs
#     transformers' DeepseekV3ForCausalLM (grouped_mm and eager experts), same weights, same run;
#  2. the same with the FP8 switch is not comparable to transformers (no FP8 there): the pytest step
#     (tests/test_model_gpu.py, -m gpu) covers FP8 training and absorbed decode on the GPU.
#  3. generation throughput from a saved bench_gpu checkpoint (random weights; tokens/s only).
# timeout: 45
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0 DSV3_KERNEL_IMPL=auto
timeout 30 "$PY" -m recipes.bench_model --preset bench_gpu --dtype bf16 --batch 4 --seq 2048 --steps 3 \
    --warmup 1 --json "$OUTDIR/bench_model.json"
CKPT=$(mktemp -d)
"$PY" - "$CKPT" <<'PY'
import sys, torch
from models.deepseek_v3 import ModelArgs, Transformer, save_hf_checkpoint
torch.manual_seed(0)
save_hf_checkpoint(Transformer(ModelArgs.preset("bench_gpu", vocab_size=256)), sys.argv[1], dtype=torch.bfloat16)
PY
timeout 12 "$PY" -m recipes.generate --checkpoint "$CKPT" --dtype bf16 --prompt "def main():" --max-new-tokens 64 \
    2>&1 | tail -3
rm -rf "$CKPT"
