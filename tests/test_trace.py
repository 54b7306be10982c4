"""``recipes.train --trace FILE``: a Chrome/Perfetto trace with a compute and a communication track per
rank, and in every overlapped F&B chunk the expert all-to-alls of both directions inside the chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel.trace import TraceRecorder, chrome_trace

ROOT = Path(__file__).resolve().parent.parent


def test_chrome_trace_has_a_process_per_rank_and_a_thread_per_track():
    a, b = TraceRecorder(0), TraceRecorder(1)
    a.add("compute", "0F0", 10.0, 10.5)
    b.add("comm", "dispatch", 10.1, 10.2)
    with pytest.raises(ValueError, match="track"):
        a.add("disk", "x", 0.0, 1.0)
    events = chrome_trace([a.state(), b.state()])["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"]) for e in spans] == [(0, 0, "0F0"), (1, 1, "dispatch")]
    assert spans[0]["ts"] == 0.0 and spans[0]["dur"] == pytest.approx(5e5)  # microseconds from the first start
    assert spans[1]["ts"] == pytest.approx(1e5)
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert {(0, None, "rank 0"), (0, 0, "compute"), (0, 1, "comm"), (1, 1, "comm")} <= names


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(480)
def test_overlapped_chunks_hold_their_all_to_alls(tmp_path):
    """The demo layout (PP 2 DualPipeV, EP 2 over DP 2) for one step (4 micro-batches per rank). In each
    rank's overlapped F&B chunks (one micro-batch's forward with another's backward) the forward's
    dispatch/combine and the backward's reverse all-to-alls are posted and land inside the chunk's
    compute interval."""
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "recipes.train", "--config", "recipes/configs/tiny_cpu.toml", "--nproc", "4",
           "--run-dir", str(tmp_path / "run"), "--trace", str(trace)]
    for o in ("run.steps=1", "model.fp8=false", "data.seq_len=32", "checkpoint.final=false", "checkpoint.interval=0",
              "run.sample_tokens=0", "logging.progress=false", "logging.wandb=disabled", "logging.plot=false",
              "logging.eval_batches=1", "run.threads=1"):
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    for rank in range(4):
        compute = [e for e in events if e["pid"] == rank and e["cat"] == "compute"]
        comm = [e for e in events if e["pid"] == rank and e["cat"] == "comm"]
        chunks = [e for e in compute if e["name"].endswith("OVERLAP_F_B")]
        assert chunks and comm, rank
        directions = set()
        for chunk in chunks:
            start, end = chunk["ts"], chunk["ts"] + chunk["dur"]
            posted = [c for c in comm if start <= c["ts"] <= end]
            for c in posted:  # each exchange posted in the chunk has landed before it ends
                assert c["ts"] + c["dur"] <= end + 1.0, (rank, chunk["name"], c)  # 1 us: float rounding
            directions |= {"backward" if c["name"].startswith("backward") else "forward" for c in posted}
        assert directions == {"forward", "backward"}, (rank, directions)


def test_a_run_without_pipeline_records_its_micro_batches_on_the_compute_track(tmp_path):
    """schedule none (one process): each micro-batch's forward and backward is a compute span, in order."""
    from training.config import load_config
    from training.parallel import single_process
    from training.trainer import Trainer

    cfg = load_config("recipes/configs/tiny_cpu.toml", [
        "parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", "run.steps=1", "run.threads=1",
        "model.fp8=false", "model.overrides.n_layers=2", "data.seq_len=16", "data.global_batch=4",
        "data.micro_batch=2", "logging.wandb=disabled", "logging.progress=false", "checkpoint.interval=0"])
    recorder = TraceRecorder(0)
    Trainer(cfg, single_process(cfg.parallel), tmp_path, recorder=recorder).train_step()
    spans = [(name, start, end) for track, name, start, end in recorder.spans if track == "compute"]
    assert [name for name, _, _ in spans] == ["0F0", "0B0", "0F1", "0B1"]
    assert all(start <= end for _, start, end in spans)
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:]))
