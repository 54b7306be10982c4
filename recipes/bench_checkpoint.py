"""Checkpoint cost to the training loop: async stall vs a full sync save of the same state, in the same run.

    python -m recipes.bench_checkpoint                      # 600 MB state on the default device
    python -m recipes.bench_checkpoint --size-mb 2048 --root /scratch/ckpt --json out.json

Rows (median of ``--repeats``):
- ``sync``: ``CheckpointManager.save(sync=True)``: snapshot, write, fsync, sha256, commit; the loop waits it all.
- ``async``: the same save in the background; ``stall`` is what the loop waits (the snapshot copy),
  ``total`` is until the commit; ``step slowdown`` is how much a compute loop slows while the write runs.
- ``torch.save``: a plain ``torch.save`` of the same tensors (no fsync, no checksums, not atomic) for scale.
Target: async stall <= 10% of the sync save time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import accel
from recipes.benchutil import print_report
from training.checkpoint import CheckpointManager


def make_state(size_mb: float, device: torch.device) -> dict:
    """A model + AdamW-moments shaped state of about ``size_mb`` MB (fp32 weights, fp32 moments, bf16 copy)."""
    per_tensor = 16 << 20  # 16 MiB tensors, like large weight matrices
    n = max(1, int(size_mb * (1 << 20) / per_tensor / 3.5))
    g = torch.Generator(device="cpu").manual_seed(0)
    cols = 1024
    rows = per_tensor // 4 // cols

    def t(dtype=torch.float32):
        return torch.randn(rows, cols, generator=g).to(device=device, dtype=dtype)

    return {"model": {f"layers.{i}.weight": t() for i in range(n)},
            "optimizer": {"state": {f"layers.{i}.weight": {"exp_avg": t(), "exp_avg_sq": t()} for i in range(n)},
                          "param_groups": [{"lr": 2.2e-4, "betas": (0.9, 0.95)}]},
            "expert_bias": {f"layers.{i}.bias": t(torch.bfloat16) for i in range(n)}}


def state_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v) for v in tree)
    return 0


def compute_steps(seconds: float, device: torch.device, stop: threading.Event | None = None) -> list[float]:
    """Time a stand-in training step (a matmul chain) repeatedly, for ``seconds`` or until ``stop``."""
    a = torch.randn(384, 384, device=device)
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end and not (stop is not None and stop.is_set()):
        t0 = time.perf_counter()
        x = a
        for _ in range(8):
            x = torch.tanh(x @ a)
        accel.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _wait_then_set(manager: CheckpointManager, done: threading.Event) -> None:
    try:
        manager.wait()
    finally:
        done.set()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=600.0, help="state size (>= 500 for the target)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default=None, help="folder to write into (default: a temporary folder)")
    ap.add_argument("--device", default="auto", help="'auto' (accel.default_device()) or 'cpu'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.size_mb <= 0 or args.repeats < 1:
        raise ValueError(f"--size-mb must be > 0 and --repeats >= 1, got {args.size_mb}, {args.repeats}")
    device = accel.default_device() if args.device == "auto" else torch.device(args.device)
    state = make_state(args.size_mb, device)
    nbytes = state_bytes(state)
    mb = nbytes / 1e6
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        sync_mgr = CheckpointManager(root / "sync", async_save=False, keep_last=1)
        async_mgr = CheckpointManager(root / "async", async_save=True, keep_last=1)
        sync_mgr.save(0, state)  # warm-up: allocates the snapshot buffers, warms the page cache
        async_mgr.save(0, state)
        async_mgr.wait()
        idle_step = statistics.median(compute_steps(1.0, device))
        sync_s, stall_s, total_s, slow, torch_s = [], [], [], [], []
        for r in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            sync_mgr.save(r, state)
            sync_s.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            stall_s.append(async_mgr.save(r, state))
            done = threading.Event()
            waiter = threading.Thread(target=_wait_then_set, args=(async_mgr, done))
            waiter.start()
            busy = compute_steps(600.0, device, stop=done)  # the loop keeps training while the write runs
            waiter.join()
            total_s.append(time.perf_counter() - t0)
            if busy:
                slow.append(statistics.median(busy) / idle_step)

            cpu = {k: v.detach().cpu() for sec in ("model", "expert_bias") for k, v in state[sec].items()}
            cpu.update({f"{k}.{m}": v.detach().cpu() for k, s in state["optimizer"]["state"].items()
                        for m, v in s.items()})
            t0 = time.perf_counter()
            torch.save(cpu, root / f"plain{r}.pt")
            torch_s.append(time.perf_counter() - t0)
            (root / f"plain{r}.pt").unlink()
        sync_mgr.close()
        async_mgr.close()
    med = statistics.median
    rows = [
        {"mode": "sync (ours)", "stall_s": med(sync_s), "total_s": med(sync_s), "MB/s": mb / med(sync_s),
         "stall_%_of_sync": 100.0, "step_slowdown": None},
        {"mode": "async (ours)", "stall_s": med(stall_s), "total_s": med(total_s), "MB/s": mb / med(total_s),
         "stall_%_of_sync": 100.0 * med(stall_s) / med(sync_s), "step_slowdown": med(slow) if slow else None},
        {"mode": "torch.save (sync, no fsync/sha256)", "stall_s": med(torch_s), "total_s": med(torch_s),
         "MB/s": mb / med(torch_s), "stall_%_of_sync": 100.0 * med(torch_s) / med(sync_s), "step_slowdown": None},
    ]
    ratio = med(stall_s) / med(sync_s)
    notes = [f"state {mb:.0f} MB on {device}, {args.repeats} repeats (median); files fsynced, sha256 per shard",
             f"target async stall <= 10% of sync: {100 * ratio:.1f}% -> {'PASS' if ratio <= 0.10 else 'MISS'}",
             "step_slowdown: median stand-in step time while the background write runs / idle step time"]
    print_report("checkpoint save: async stall vs sync", rows, json_path=args.json, notes=notes)
    return rows


if __name__ == "__main__":
    main()
