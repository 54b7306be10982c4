"""Checkpoint cost to the training loop, ours vs ``torch.distributed.checkpoint`` (DCP), same run, ranks, disk.

    python -m recipes.bench_checkpoint                       # 600 MB of state over 2 ranks (gloo; default device)
    python -m recipes.bench_checkpoint --ranks 4 --size-mb 2048 --root /scratch/ckpt --json out.json

Every rank holds ``size_mb / ranks`` of distinct state (fp32 weights, two fp32 Adam moments, a bf16
tensor per layer; keys carry the rank, so DCP does not deduplicate them as replicas). Rows (median
of ``--repeats``; each time the slowest rank's):
- ``ours sync``: ``CheckpointManager.save(sync=True)``: snapshot, write, fsync, sha256, commit, ``latest``.
- ``ours async``: the same in the background; ``stall`` is what the loop waits (the snapshot copy).
- ``dcp.save``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(sync_files=True)``.
- ``dcp.async_save``: the same, staged to CPU and written by DCP's background thread.
- ``torch.save``: a plain ``torch.save`` per rank (no fsync, no checksums, not atomic), for scale.
``total`` is until the bytes are durable: each file fsynced (DCP's ``sync_files``; ours always) and the
folder fsynced (added for DCP, which does not fsync directories). While an async save runs, the loop
keeps computing (a matmul chain); ``step_slowdown`` is its median step time then / idle.
Targets: ours async stall <= DCP's async stall, and <= 10% of a sync save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import accel
from accel.cli import (
    BAD_INPUT,
    OK,
    ArgumentParser,
    check_output_dir,
    check_output_file,
    positive_float,
    positive_int,
)
from recipes.benchutil import print_report
from training.checkpoint import CheckpointManager
from training.checkpoint import format as fmt

MODES = ("ours sync", "ours async", "dcp.save", "dcp.async_save", "torch.save")


def make_state(size_mb: float, device: torch.device, prefix: str = "") -> dict:
    """A model + AdamW-moments shaped state of about ``size_mb`` MB (fp32 weights, fp32 moments, bf16 copy)."""
    per_tensor = 16 << 20  # 16 MiB tensors, like large weight matrices
    n = max(1, int(size_mb * (1 << 20) / per_tensor / 3.5))
    g = torch.Generator(device="cpu").manual_seed(0)
    cols = 1024
    rows = per_tensor // 4 // cols

    def t(dtype=torch.float32):
        return torch.randn(rows, cols, generator=g).to(device=device, dtype=dtype)

    return {"model": {f"{prefix}layers.{i}.weight": t() for i in range(n)},
            "optimizer": {"state": {f"{prefix}layers.{i}.weight": {"exp_avg": t(), "exp_avg_sq": t()}
                                    for i in range(n)},
                          "param_groups": [{"lr": 2.2e-4, "betas": (0.9, 0.95)}]},
            "expert_bias": {f"{prefix}layers.{i}.bias": t(torch.bfloat16) for i in range(n)}}


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


def _compute_until(wait, device: torch.device) -> list[float]:
    """Run the stand-in loop until ``wait()`` (the background save) returns; the loop's step times."""
    done = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            wait()
        except BaseException as exc:  # re-raised below, in the loop's thread
            errors.append(exc)
        finally:
            done.set()

    th = threading.Thread(target=waiter)
    th.start()
    busy = compute_steps(600.0, device, stop=done)
    th.join()
    if errors:
        raise errors[0]
    return busy


def dcp_state(state: dict) -> dict:
    """The same tensors as a flat DCP state dict (DCP takes nested dicts too; flat keeps keys readable)."""
    out = {k: v for k, v in state["model"].items()}
    out.update({f"optim.{k}.{m}": v for k, s in state["optimizer"]["state"].items() for m, v in s.items()})
    out.update({f"bias.{k}": v for k, v in state["expert_bias"].items()})
    return out


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (cheap when the files are already synced)."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fmt.fsync_file(p)
    for d in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fmt.fsync_dir(d)


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _folder(mode: str) -> str:
    return mode.replace(" ", "_").replace(".", "_")


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device(args.device)
    if device.type != "cpu":  # one device per rank where there are enough (the device-to-host copy is the stall)
        device = torch.device(device.type, rank % torch.get_device_module(device.type).device_count())
    state = make_state(args.size_mb / world, device, prefix=f"rank{rank}.")
    flat = dcp_state(state)
    root = Path(root)
    ours_sync, ours_async = (CheckpointManager(root / _folder(m), rank=rank, world_size=world, async_save=a,
                                               keep_last=1)
                             for m, a in (("ours sync", False), ("ours async", True)))
    pg = dist.new_group(backend="gloo")  # DCP's async save runs its collectives on a group of its own

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def run(mode: str, r: int) -> tuple[float, float, list[float]]:
        dist.barrier()
        folder = root / _folder(mode) / f"step{r}"
        t0 = time.perf_counter()
        busy: list[float] = []
        if mode == "ours sync":
            ours_sync.save(r, state)
            stall = total = time.perf_counter() - t0
        elif mode == "ours async":
            stall = ours_async.save(r, state)
            busy = _compute_until(ours_async.wait, device)
            total = time.perf_counter() - t0
        elif mode == "dcp.save":
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))
            fsync_tree(folder)
            stall = total = time.perf_counter() - t0
        elif mode == "dcp.async_save":
            future = dcp.async_save(flat, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True),
                                    process_group=pg)
            stall = time.perf_counter() - t0
            busy = _compute_until(lambda: (future.result(), fsync_tree(folder)), device)
            total = time.perf_counter() - t0
        else:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(flat, folder / f"rank{rank}.pt")
            stall = total = time.perf_counter() - t0
        return slowest(stall), slowest(total), busy

    for mode in MODES:  # warm-up: buffers, page cache, DCP's planner caches
        run(mode, 0)
    dist.barrier()
    sizes = {mode: du(root / _folder(mode)) for mode in MODES} if rank == 0 else {}
    idle = statistics.median(compute_steps(1.0, device))
    results = {m: {"stall": [], "total": [], "slow": []} for m in MODES}
    for r in range(1, args.repeats + 1):
        for mode in MODES:
            stall, total, busy = run(mode, r)
            results[mode]["stall"].append(stall)
            results[mode]["total"].append(total)
            if busy:
                results[mode]["slow"].append(statistics.median(busy) / idle)
            if mode.startswith(("dcp", "torch")) and rank == 0:  # one copy on disk, as keep_last=1 keeps for ours
                shutil.rmtree(root / _folder(mode) / f"step{r}", ignore_errors=True)
    ours_sync.close()
    ours_async.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"results": results, "sizes": sizes, "bytes": state_bytes(state) * world}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_inputs(args: argparse.Namespace) -> None:
    """--device, --root and --json before any process starts (ValueError naming the option)."""
    devices = list(dict.fromkeys(("auto", "cpu", accel.default_device().type)))
    if args.device not in devices:
        raise ValueError(f"--device {args.device!r}: expected one of {', '.join(devices)}")
    if args.root is not None:
        if not Path(args.root).is_dir():
            raise ValueError(f"--root {args.root!r}: no such folder")
        check_output_dir(args.root, "--root")
    if args.json:
        check_output_file(args.json, "--json")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.bench_checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=positive_float, default=600.0,
                    help="total state over all ranks (>= 500 for the target)")
    ap.add_argument("--ranks", type=positive_int, default=2, help="processes (gloo on CPU), 2-4 for the comparison")
    ap.add_argument("--repeats", type=positive_int, default=3, help="saves per mode (the median is reported)")
    ap.add_argument("--root", default=None, help="folder to write into (default: a temporary folder)")
    ap.add_argument("--device", default="auto", help="'auto' (accel.default_device()) or 'cpu'")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    try:
        check_inputs(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    args.device = accel.default_device().type if args.device == "auto" else args.device
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        out = Path(tmp) / "results.json"
        mp.spawn(_rank_main, args=(args.ranks, _free_port(), args, str(Path(tmp) / "ck"), str(out)),
                 nprocs=args.ranks, join=True)
        data = json.loads(out.read_text())
    med = statistics.median
    res = data["results"]
    mb = data["bytes"] / 1e6
    sync_ours = med(res["ours sync"]["total"])
    rows = [{"mode": m, "stall_s": med(res[m]["stall"]), "total_s": med(res[m]["total"]),
             "MB/s": mb / med(res[m]["total"]), "stall_%_of_ours_sync": 100.0 * med(res[m]["stall"]) / sync_ours,
             "disk_MB": data["sizes"][m] / 1e6,
             "step_slowdown": med(res[m]["slow"]) if res[m]["slow"] else None} for m in MODES]
    ours, theirs = med(res["ours async"]["stall"]), med(res["dcp.async_save"]["stall"])
    notes = [f"state {mb:.0f} MB over {args.ranks} ranks (gloo, {args.device}), {args.repeats} repeats (median of "
             f"the slowest rank); load average {os.getloadavg()[0]:.1f}",
             f"ours async stall {ours:.3f} s vs dcp.async_save stall {theirs:.3f} s -> "
             f"{'PASS' if ours <= theirs else 'MISS'}; vs our sync save {100 * ours / sync_ours:.1f}% -> "
             f"{'PASS' if ours <= 0.1 * sync_ours else 'MISS'} (target <= 10%)",
             "disk_MB: one checkpoint's bytes on disk (ours: safetensors + metadata.json; DCP: .distcp + .metadata)"]
    print_report("checkpoint save: ours vs torch.distributed.checkpoint", rows, json_path=args.json, notes=notes)
    return OK


if __name__ == "__main__":
    sys.exit(main())
