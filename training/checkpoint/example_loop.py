"""A small, complete training loop wired to ``CheckpointManager`` and ``FaultTolerance``.

It is the integration example for trainer authors and what the kill -9, fault-injection and
``torchrun --max-restarts`` tests drive as a subprocess: a two-layer MLP with dropout (so RNG state
matters), AdamW (ZeRO-1 sharded over data-parallel ranks under torchrun), a warm-up LR schedule, and a
deterministic sampler whose position is part of the checkpoint. Losses print as ``STEP <n> <float.hex>``
so a test can compare runs bit for bit; checkpoint events print as ``EVENT <name> <step> <detail>``.

    python -m training.checkpoint.example_loop --root /tmp/ckpt --steps 40 --interval 5
    torchrun --nproc-per-node 2 --max-restarts 2 -m training.checkpoint.example_loop --root /tmp/ckpt ...

Test-only knobs: ``--write-delay`` writes each shard in two halves with a pause between (a kill can land
mid-file), ``--poison-batch`` makes a data batch produce NaN, ``--crash-after-step`` exits abruptly on
the first attempt on the last rank (to exercise torchrun restarts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.cli import ArgumentParser
from training.checkpoint import format as fmt
from training.checkpoint.manager import CheckpointManager, read_checkpoint
from training.checkpoint.resume import (
    gather_named_optimizer_state,
    load_named_optimizer_state,
    local_param_names,
    named_optimizer_state,
    restart_count,
)
from training.checkpoint.rng import restore_rng_state
from training.checkpoint.writer import paused_writer
from training.fault import FaultPolicy, FaultTolerance, FaultToleranceExhausted
from training.runlock import take as take_run_lock

IN_DIM, CLASSES = 16, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint folder")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5, help="save every N steps")
    p.add_argument("--sync", action="store_true", help="synchronous saves (default: async)")
    p.add_argument("--resume", default="auto", help="auto | none | a checkpoint folder")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--keep-every", type=int, default=0)
    p.add_argument("--fault", action="store_true", help="enable NaN/spike rollback")
    p.add_argument("--stable-after", type=int, default=3)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--spike-sigma", type=float, default=6.0)
    p.add_argument("--write-delay", type=float, default=0.0, help="test only: pause mid-shard for this many seconds")
    p.add_argument("--poison-batch", type=int, action="append", default=[], help="test only: NaN in this batch")
    p.add_argument("--crash-after-step", type=int, default=-1, help="test only: exit(13) after this step, attempt 0")
    p.add_argument("--losses-out", default=None, help="write {step: loss.hex()} JSON here at the end")
    return p.parse_args(argv)


class TinyMLP(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_DIM, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch_at(seed: int, position: int, global_batch: int, rank: int, world: int,
             poison: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The data batch at sampler ``position``: a pure function of (seed, position), this rank's rows."""
    g = torch.Generator().manual_seed(seed * 100_003 + position)
    x = torch.randn(global_batch, IN_DIM, generator=g)
    y = torch.randint(0, CLASSES, (global_batch,), generator=g)
    if position in poison:
        x[0, 0] = float("nan")
    return x[rank::world], y[rank::world]


_EMIT_LOCK = threading.Lock()


def _emit(*parts: Any) -> None:
    """One whole line per call, even with the writer thread printing too."""
    with _EMIT_LOCK:
        sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> dict[int, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # bit-reproducible CPU math across runs
    world = int(os.environ.get("WORLD_SIZE", "1"))
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank() if world > 1 else 0

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = TinyMLP(args.hidden, args.dropout).to(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if world > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # slow import: only when sharding

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        opt = zero
    else:
        opt = torch.optim.AdamW(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    config = {"seed": args.seed, "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "dropout": args.dropout,
              "dtype": args.dtype}
    data = {"position": 0}
    poison = set(args.poison_batch)

    def metrics(record: dict[str, Any]) -> None:
        _emit("METRIC", json.dumps(record, default=str))

    slow = paused_writer(args.write_delay, lambda path: _emit("EVENT", "mid_write", -1, path.name))
    lock = take_run_lock(args.root) if rank == 0 else None  # one job per folder: the start-up sweep runs under it
    mgr = CheckpointManager(args.root, async_save=not args.sync, keep_last=args.keep_last, keep_every=args.keep_every,
                            on_event=lambda name, step, detail: _emit("EVENT", name, step, detail), metrics=metrics,
                            save_tensors=slow if args.write_delay > 0 else None, sweep=True)
    ft = None
    if args.fault:
        ft = FaultTolerance(FaultPolicy(spike_sigma=args.spike_sigma, window=20, min_history=5,
                                        stable_after=args.stable_after, max_retries=args.max_retries), mgr, metrics)

    def state() -> dict[str, Any]:
        s = {"optimizer": named_optimizer_state(opt, names), "scheduler": sched.state_dict(), "data": dict(data)}
        if rank == 0:
            s["model"] = model.state_dict()
        return s

    def save(step: int) -> None:
        mgr.save(step, state(), {"config": config, "tokens_seen": step * args.batch, "layout": {"dp": world}})
        if ft is not None:
            ft.on_checkpoint(step)

    def restore(folder: Path) -> int:
        own = read_checkpoint(folder, rank, expect_config=config) if rank < _saved_world(folder) else None
        model.load_state_dict(read_checkpoint(folder, 0, sections=["model"]).state["model"])
        if own is not None and _saved_world(folder) == world:
            load_named_optimizer_state(opt, names, own.state["optimizer"])
        else:  # another data-parallel size: pick this rank's parameters from every saved shard
            wanted = local_param_names(opt, names)
            load_named_optimizer_state(opt, names, gather_named_optimizer_state(folder, "optimizer", wanted))
        ref = own or read_checkpoint(folder, 0, sections=["scheduler", "data"])
        sched.load_state_dict(ref.state["scheduler"])
        data.update(ref.state["data"])
        if own is not None:
            restore_rng_state(own.rng)
        return ref.step

    step = 0
    folder = None if args.resume == "none" else mgr.resolve(args.resume)
    if folder is not None:
        step = restore(folder)
        metrics({"event": "restart" if restart_count() else "resume", "step": step, "checkpoint": folder.name,
                 "restart_count": restart_count()})
        if ft is not None:
            ft.on_resume(step)
    else:
        save(0)  # a first checkpoint, so that an early fault has somewhere to go back to
    losses: dict[int, float] = {}
    try:
        while step < args.steps:
            mgr.poll()
            step += 1
            model.train()
            x, y = batch_at(args.seed, data["position"], args.batch, rank, world, poison)
            x = x.to(dtype)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if ft is not None:
                verdict = ft.check(step, loss.detach(), grad_norm)
                if not verdict.ok:
                    step = restore(mgr.root / fmt.step_dirname(verdict.rollback_step))
                    data["position"] += verdict.skip_batches
                    ft.rolled_back(verdict)
                    continue
            opt.step()
            sched.step()
            data["position"] += 1
            if world > 1:  # report the global-batch loss, as a single process would see it
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= world
            losses[step] = loss.item()
            if rank == 0:
                _emit("STEP", step, loss.item().hex())
            if args.interval and step % args.interval == 0:
                save(step)
            if step == args.crash_after_step and restart_count() == 0 and rank == world - 1:
                mgr.wait()
                _emit("CRASH", step)
                os._exit(13)
        mgr.wait()
    except FaultToleranceExhausted as exc:
        _emit("GAVE_UP", json.dumps(exc.report, default=str))
        mgr.close()
        sys.exit(3)
    mgr.close()
    _emit("DONE", step)
    if args.losses_out and rank == 0:
        Path(args.losses_out).write_text(json.dumps({str(k): v.hex() for k, v in sorted(losses.items())}))
    if own_group:
        dist.destroy_process_group()
    if lock is not None:
        lock.release()
    return losses


def _saved_world(folder: Path) -> int:
    return int(json.loads((folder / fmt.METADATA_FILE).read_text())["world_size"])


if __name__ == "__main__":
    main()
