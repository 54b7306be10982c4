#!/usr/bin/env bash
# torch.compile on one GPU, from the repo root, under 25 s (issue 35 item 5): recipes.bench_compile --device cuda
# --cuda-graph, i.e. host time per layer per micro-batch of the debug_tiny model's training step (forward + loss +
# backward, 3 layers + 1 MTP depth, 2 x 32 tokens), eager vs torch.compile(fullgraph=True) with Inductor, and the
# dense block 0's forward + backward eager / compiled / under CUDA graphs (mode "reduce-overhead"), each checked
# against eager before it is timed (a mode that fails or differs is named in the notes, not timed).
# Record the rows (bench_compile.json) in benchmarks/compile.md with the date, GPU and commit.
# timeout: 25
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0 DSV3_KERNEL_IMPL=auto
"$PY" -m recipes.bench_compile --device cuda --cuda-graph --steps 5 --json "$OUTDIR/bench_compile.json"
