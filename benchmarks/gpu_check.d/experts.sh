#!/usr/bin/env bash
# experts on one GPU (H200) host, from the repo root, under 40 s:
#  1. the MoE with an expert-parallel group of size 1 over NCCL/MCCL (the device path of dispatch/combine,
#     FP8 dispatch with the compiled per-token cast) equals the MoE without EP, outputs and gradients;
#  2. the all-to-all overlap benchmark on the host's idle CPU cores (gloo, 2 ranks x 4 threads) - a
#     CPU figure, but one not starved of cores as on the shared dev box; NCCL needs >= 2 GPUs for EP > 1;
#  3. the expert-balancing recipe on the GPU, short (2 strategies x 15 steps).
# timeout: 40
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${GPU_CHECK_OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
export TRITON_INTERPRET=0
experts_ep_device_check() {
    DSV3_KERNEL_IMPL=auto timeout 18 "$PY" - <<'PY'
import sys
sys.path.insert(0, "benchmarks/gpu_check.d")
import torch, torch.distributed as dist
from one_rank_group import init_one_rank_group
from models.deepseek_v3.args import PRESETS, ModelArgs
from models.deepseek_v3.moe import MoE
dev = init_one_rank_group()
args = ModelArgs(**{**PRESETS["debug"], "dim": 256, "n_routed_experts": 16, "n_activated_experts": 4})
for fp8 in (False, True):
    torch.manual_seed(0)
    ref = MoE(args).to(dev)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ep = MoE(args, ep_group=dist.group.WORLD, fp8_dispatch=fp8).to(dev)
    ep.load_state_dict(ref.state_dict())
    x = torch.randn(4, 64, args.dim, device=dev)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ye = ref(xr), ep(xe)
    g = torch.randn_like(yr)
    (yr * g).sum().backward(); (ye * g).sum().backward()
    # no fp8: same fp32 GEMMs in another grouping (1e-5); fp8: e4m3 round trip of the expert inputs (5e-2)
    tol = 5e-2 if fp8 else 1e-5
    for name, a, b in [("y", ye, yr), ("x.grad", xe.grad, xr.grad),
                       ("w13.grad", ep.experts.w13.grad, ref.experts.w13.grad)]:
        err = ((a - b).norm() / b.norm()).item()
        print(f"fp8_dispatch={fp8} {name}: rel err {err:.2e} (tol {tol})")
        assert err < tol, name
dist.destroy_process_group()
print("experts EP device check: OK")
PY
    timeout 10 "$PY" -m recipes.bench_ep_overlap --nproc 2 --threads 4 --reps 2 --json "$OUTDIR/ep_overlap_cpu.json"
    timeout 10 "$PY" -m recipes.expert_balance --steps 15 --strategies none,aux_free+seq_aux \
        --set data.global_batch=32 --set data.micro_batch=32 --out "$OUTDIR/expert_balance"
    if (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )); then  # EP and EPLB over NCCL need two devices
        timeout 20 "$PY" -m torch.distributed.run --nproc-per-node 2 -m recipes.expert_balance \
            --config recipes/configs/debug_gpu.toml --strategies aux_free --eplb 2 --steps 20 \
            --set parallel.dp=2 --set parallel.ep=2 --out "$OUTDIR/expert_balance_eplb_nccl"
    else
        echo "EP / EPLB over NCCL: needs >= 2 GPUs, skipped on this host"
    fi
}
experts_ep_device_check "$@"
