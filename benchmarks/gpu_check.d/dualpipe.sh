#!/usr/bin/env bash
# dualpipe on one GPU (run from the repo root; < 20 s). One GPU allows only a 1-rank process group
# (NCCL refuses two ranks on one device), so this checks the device path of the runtime (stage modules,
# inputs, losses and deferred weight gradients on the accelerator, NCCL/MCCL group) for every schedule
# against a single-process run. Multi-rank P2P over NCCL needs >= 2 GPUs (see docs/dualpipe.md).
# timeout: 20
set -euo pipefail
PY=${PY:-python3}
"$PY" - <<'PY'
import sys
sys.path.insert(0, "benchmarks/gpu_check.d")
import copy, torch, torch.distributed as dist, torch.nn.functional as F
from one_rank_group import init_one_rank_group
from dualpipe import DualPipeV, Pipeline, LinearWithDeferredWGrad, calc_diff
dev = init_one_rank_group()
torch.manual_seed(0)
def stage():
    return torch.nn.Sequential(LinearWithDeferredWGrad(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(dev, torch.float64)
for name in ("1f1b", "zb1p", "zbv", "dualpipev"):
    n = 2 if name in ("zbv", "dualpipev") else 1
    mods = [stage() for _ in range(n)]
    ref = copy.deepcopy(mods)
    x, y = torch.randn(24, 64, device=dev, dtype=torch.float64), torch.randn(24, 64, device=dev, dtype=torch.float64)
    pipe = DualPipeV(tuple(mods)) if name == "dualpipev" else Pipeline(mods, name)
    loss, _ = pipe.step(x, num_chunks=6, criterion=F.mse_loss, labels=(y,))
    ref_losses = []
    for xm, ym in zip(x.tensor_split(6), y.tensor_split(6)):
        h = xm
        for m in ref:
            h = m(h)
        l = F.mse_loss(h, ym); l.backward(); ref_losses.append(l.detach())
    assert torch.equal(loss, torch.stack(ref_losses)), name
    diff = max(calc_diff(p.grad, q.grad) for m, r in zip(mods, ref) for p, q in zip(m.parameters(), r.parameters()))
    assert diff < 1e-13, (name, diff)
    print(f"dualpipe gpu check {name}: losses equal, grad calc_diff {diff:.2e}, store left {pipe.store.pending()}")
dist.destroy_process_group()
PY
"$PY" -m dualpipe.simulate --schedule dualpipe --ranks 16 --microbatches 40 --png /tmp/dualpipe_16.png > /tmp/dualpipe_16.txt && head -3 /tmp/dualpipe_16.txt
