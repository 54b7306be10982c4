"""Forward+backward of DeepSeek-V3: ours vs transformers' ``DeepseekV3ForCausalLM``, same config, same weights.

    python -m recipes.bench_model                          # CPU-sized preset "bench_cpu", fp32
    python -m recipes.bench_model --preset debug --batch 8 --seq 128
    python -m recipes.bench_model --dtype bf16 --batch 8 --seq 1024     # on a GPU

Both load the same weights (saved once as an HF checkpoint), so both compute the same function; the
table shows both losses on the same batch as a check. Timing: ``--warmup`` then ``--steps`` training
steps (forward, cross-entropy, backward, grads zeroed) with the implementations *alternating* in
one process, so load from other processes on a shared machine hits both alike; median step time,
both wall clock (``step_ms``) and, on a CPU, this process's CPU time (``cpu_ms``: time other jobs
hold the cores does not count, so on a shared machine it is the steadier comparison).
Peak memory comes from a separate subprocess per implementation (peak RSS growth over one step on a
CPU, ``max_memory_allocated`` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import accel
from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_file, nonnegative_int, positive_int
from recipes.benchutil import print_report

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("ours", "transformers", "transformers_eager")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build(impl: str, ckpt: str, dtype: str, device: torch.device):
    """The model ``impl`` loaded from ``ckpt``, and a function computing its LM loss on ``(inputs, labels)``."""
    if impl == "ours":
        from models.deepseek_v3 import load_hf_checkpoint

        model = load_hf_checkpoint(None, ckpt, device=device, dtype=DTYPES[dtype])
        forward = model
    else:
        from transformers import DeepseekV3ForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # "transformers": its default experts kernel (grouped_mm; on a CPU a per-expert mm loop over sorted rows);
        # "transformers_eager": its per-expert Python loop with token gathers (the reference implementation)
        experts = "eager" if impl == "transformers_eager" else None
        model = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=DTYPES[dtype], experts_implementation=experts)
        model = model.to(device)

        def forward(inputs):
            return model(inputs).logits
    model.train()

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss = torch.nn.functional.cross_entropy(forward(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item()

    return step


def batch(bsz: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (bsz, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def peak_memory(impl: str, ckpt: str, bsz: int, seq: int, dtype: str) -> float:
    """Bytes of peak memory growth over a training step from the loaded model (activations, grads, workspace)."""
    device = accel.default_device()
    step = build(impl, ckpt, dtype, device)
    inputs, labels = batch(bsz, seq, device)
    accel.synchronize()
    rss0 = _peak_rss_bytes()
    accel.reset_peak_memory_stats()
    step(inputs, labels)
    accel.synchronize()
    return accel.max_memory_allocated() if device.type != "cpu" else _peak_rss_bytes() - rss0


def timed(steps: dict, inputs: torch.Tensor, labels: torch.Tensor, n: int, warmup: int) -> dict[str, dict]:
    """Alternate the implementations' steps; median wall and process-CPU time, and first loss of each."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu_times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, float] = {}
    for i in range(warmup + n):
        for name, step in steps.items():
            accel.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(inputs, labels)
            accel.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
            losses.setdefault(name, loss)
    return {k: {"step_s": statistics.median(v), "cpu_s": statistics.median(cpu_times[k]), "loss": losses[k]}
            for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.bench_model", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench_cpu", help="ModelArgs preset to train")
    ap.add_argument("--batch", type=positive_int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=positive_int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=positive_int, default=5, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    opts = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.worker:
        print("RESULT " + json.dumps(peak_memory(opts.worker, opts.checkpoint, opts.batch, opts.seq, opts.dtype)))
        return 0

    from models.deepseek_v3 import ModelArgs, Transformer, save_hf_checkpoint

    try:
        if opts.json:
            check_output_file(opts.json, "--json")
        args = ModelArgs.preset(opts.preset, n_mtp_layers=0)  # transformers' forward has no MTP: the same work
        if args.vocab_size < 256:
            raise ValueError(f"--preset {opts.preset}: vocab_size {args.vocab_size} < 256 byte tokens")
        if opts.seq > args.max_seq_len:
            raise ValueError(f"--seq {opts.seq} exceeds preset {opts.preset}'s max_seq_len={args.max_seq_len}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    impls = IMPLS
    device = accel.default_device()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        save_hf_checkpoint(Transformer(args), tmp, dtype=DTYPES[opts.dtype])
        memory = {}
        for impl in impls:
            cmd = [sys.executable, "-m", "recipes.bench_model", "--worker", impl, "--checkpoint", tmp,
                   "--batch", str(opts.batch), "--seq", str(opts.seq), "--dtype", opts.dtype]
            if opts.threads:
                cmd += ["--threads", str(opts.threads)]
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
            if run.returncode:
                raise RuntimeError(f"bench worker {impl} failed:\n{run.stderr[-3000:]}")
            memory[impl] = json.loads(run.stdout.split("RESULT ", 1)[1])
        steps = {impl: build(impl, tmp, opts.dtype, device) for impl in impls}
        inputs, labels = batch(opts.batch, opts.seq, device)
        result = timed(steps, inputs, labels, opts.steps, opts.warmup)
    rows = [{"impl": impl, "step_ms": result[impl]["step_s"] * 1e3, "cpu_ms": result[impl]["cpu_s"] * 1e3,
             "tokens_per_s": opts.batch * opts.seq / result[impl]["step_s"], "peak_mem_MiB": memory[impl] / 2**20,
             "loss": result[impl]["loss"]} for impl in impls]
    for r in rows:
        r["speedup_vs_hf"] = rows[1]["step_ms"] / r["step_ms"]
        r["speedup_vs_hf_eager"] = rows[2]["step_ms"] / r["step_ms"]
        r["cpu_speedup_vs_hf"] = rows[1]["cpu_ms"] / r["cpu_ms"]
    columns = ["impl", "step_ms", "tokens_per_s", "peak_mem_MiB", "speedup_vs_hf", "speedup_vs_hf_eager"]
    if accel.backend() == "cpu":  # on a GPU the host's CPU time says nothing about the step
        columns[2:2] = ["cpu_ms"]
        columns.append("cpu_speedup_vs_hf")
    counts = args.param_counts()
    notes = [f"preset {opts.preset} ({counts['total'] / 1e6:.2f}M params, {args.n_layers} layers, "
             f"{args.n_routed_experts} experts top-{args.n_activated_experts}), batch {opts.batch} x seq {opts.seq}, "
             f"{opts.dtype}, forward+backward, median of {opts.steps} steps after {opts.warmup} warm-up",
             "peak memory: peak RSS growth over the first step (CPU) or max_memory_allocated (GPU), own subprocess",
             "same weights, same batch: first-step losses " + ", ".join(f"{r['loss']:.6f} ({r['impl']})" for r in rows)]
    print_report("DeepSeek-V3 training step: ours vs transformers", rows, columns, json_path=opts.json,
                 notes=notes)
    return OK


if __name__ == "__main__":
    sys.exit(main())
