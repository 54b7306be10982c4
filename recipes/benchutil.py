"""What recipes share: a side-by-side terminal table, a JSON dump, the run's context; a config file given as
a recipe's own option; training and export runs through the real CLI (``recipes.train``, ``recipes.export_hf``).

The table formatter and the context live in ``verifier.report`` (the verification harness prints
through them too); they are re-exported here so recipes keep importing ``recipes.benchutil``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from accel.cli import BAD_INPUT, ArgumentParser, check_output_file
from training.config import TrainConfig, load_config
from verifier.report import CPU_TIMING_NOTE, context, format_table

__all__ = ["context", "format_table", "kernel_bench_parser", "print_report", "row_sink", "spawn_gloo"]


def spawn_gloo(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0) -> Any:
    """Run ``fn(rank, world, *args)`` in ``nproc`` fresh gloo processes on this machine (a free local port) and
    return what rank 0's call returned (JSON-able). ``fn`` must be a module-level function (it is pickled)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_gloo_rank, args=(nproc, port, timeout_s, fn, args, out), nprocs=nproc, join=True)
        return json.loads(Path(out).read_text())


def _gloo_rank(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple,
               out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def row_sink(json_path: str | Path | None, table: str):
    """A function that appends each row, the moment it is measured, to ``<json_path>.rows.jsonl`` (one JSON
    object per line, tagged with ``table``) and returns it; a run killed at its timeout keeps every row it
    measured. A no-op without ``json_path``."""
    path = Path(f"{json_path}.rows.jsonl") if json_path else None

    def sink(row: dict) -> dict:
        if path is not None:
            with path.open("a") as f:
                f.write(json.dumps({"table": table, **row}, default=str) + "\n")
        return row

    return sink


def print_report(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 json_path: str | Path | None = None, notes: Sequence[str] = ()) -> None:
    """Print the context, the table and the notes; write them all as JSON when ``json_path`` is given."""
    ctx = context()
    print(f"== {title} ==")
    print(", ".join(f"{k}={v}" for k, v in ctx.items()))
    if ctx["backend"] == "cpu":
        print(f"note: {CPU_TIMING_NOTE}")
    print(format_table(rows, columns))
    for n in notes:
        print(f"note: {n}")
    if json_path:
        Path(json_path).write_text(json.dumps({"title": title, "context": ctx, "rows": list(rows),
                                               "notes": list(notes)}, indent=2, default=str))


def kernel_bench_parser(area: str, doc: str, json_help: str, baseline_help: str) -> argparse.ArgumentParser:
    """The options every ``python -m recipes.bench_kernels <area>`` benchmark takes: --quick, --json, --no-baseline."""
    p = ArgumentParser(prog=f"python -m recipes.bench_kernels {area}", description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few rows per table (GPU smoke check, < 1 minute)")
    p.add_argument("--json", metavar="PATH", type=_json_path, help=json_help)
    p.add_argument("--no-baseline", action="store_true", help=baseline_help)
    return p


def _json_path(text: str) -> str:
    """argparse type of ``--json``: a file path this process can write (checked before anything is measured)."""
    try:
        check_output_file(text, "--json")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--json ")) from None
    return text


def load_option(option: str, path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """``load_config`` of a config file a recipe takes as ``option``: its errors name that option, not
    ``--config``."""
    try:
        return load_config(path, list(overrides))
    except ValueError as exc:
        text = str(exc)
        raise ValueError(option + text[len("--config"):] if text.startswith("--config") else text) from None


class TrainingRefused(SystemExit):
    """``recipes.train`` refused a run (status 2): ``line`` is its ``error:`` line without the prefix. A recipe
    that catches it reports the line as its own bad input; uncaught, it ends the recipe as a failed run does."""

    def __init__(self, run: str, line: str):
        super().__init__(f"training run {run} refused: {line}")
        self.line = line


def run_training(config: str, nproc: int, overrides: list[str], run_dir: Path) -> list[dict]:
    """Run ``recipes.train`` in a subprocess with ``--set`` overrides; return its metrics.jsonl records.

    Comparisons (overlap on/off, FP8 vs BF16) train each variant in a fresh process so that one run's
    state cannot leak into the other. A refusal (status 2) raises ``TrainingRefused``; another failure exits
    naming the run, with its output's tail.
    """
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "recipes.train", "--config", config, "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True,
                          text=True)
    if proc.returncode == BAD_INPUT:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        raise TrainingRefused(Path(run_dir).name, lines[-1][len("error: "):] if lines else proc.stderr.strip()[-300:])
    if proc.returncode:
        raise SystemExit(f"training run {Path(run_dir).name} failed (status {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def export_hf(run_dir: Path, out: Path) -> Path:
    """``recipes.export_hf`` of the run's newest checkpoint into ``out``."""
    cmd = [sys.executable, "-m", "recipes.export_hf", str(run_dir / "checkpoints"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"export of {run_dir.name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out
