"""Host time per layer per micro-batch, eager vs ``torch.compile(fullgraph=True)``, of the one-process model's
forward + loss + backward on the tiny-dimension model (``debug_tiny``: dim 32, 3 layers + 1 MTP depth, one
micro-batch of 2 x 32 tokens), where Python and dispatch, not arithmetic, set the time.

Both run in this process, alternating step by step, after a warm-up (the compile). Reported: the median (and
min-max) of each step's wall and main-thread CPU time (``time.thread_time``), divided by the layers it runs. The
compiled loss is checked against eager's first (the same model and tokens). Usage:
``python -m recipes.bench_compile [--backend inductor|aot_eager] [--steps 20] [--json out.json]``.
"""

from __future__ import annotations

import statistics
import time

import torch

from accel.cli import ArgumentParser
from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.model import lm_losses_from_hidden
from recipes.benchutil import print_report


def next_token_loss(model: Transformer):
    """``loss(tokens)``: the model's next-token loss (MTP included) on ``tokens``, as training takes it (the fused
    head, no logits kept); what the benchmark times and ``tests/test_compile.py`` compiles."""
    args = model.args

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        inp, labels = tokens[:, :-1], tokens[:, 1:]
        h = model.run_layers(model.embed_tokens(inp))
        return lm_losses_from_hidden(args, model.norm, model.head, model.mtp, model.embed, h, inp, labels)["loss"]

    return loss


def _step(model: Transformer, fn, tokens: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.thread_time()
    loss = fn(tokens)
    loss.backward()
    return time.perf_counter() - wall, time.thread_time() - cpu, loss.detach()


def _summary(name: str, times: list[tuple[float, float]], layers: int) -> dict:
    walls = [1e3 * w / layers for w, _ in times]
    cpus = [1e3 * c / layers for _, c in times]
    return {"run": name, "wall ms / layer / mb": f"{statistics.median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}]",
            "main-thread CPU ms / layer / mb": f"{statistics.median(cpus):.2f} [{min(cpus):.2f}-{max(cpus):.2f}]",
            "median_cpu_ms": statistics.median(cpus)}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (default 20)")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this file")
    opts = parser.parse_args(argv)
    if opts.steps < 1:
        parser.error(f"--steps must be >= 1, got {opts.steps}")
    torch.manual_seed(0)
    model = Transformer(ModelArgs.preset("debug_tiny", n_layers=3, n_dense_layers=1, n_mtp_layers=1)).train()
    layers = model.args.n_layers + model.args.n_mtp_layers
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    eager = next_token_loss(model)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(next_token_loss(model), fullgraph=True, backend=opts.backend)
        start = time.perf_counter()
        _, _, got = _step(model, compiled, tokens)
        compile_s = time.perf_counter() - start
        _, _, want = _step(model, eager, tokens)
        # inductor fuses and reorders fp32 arithmetic: the loss (~ln 256) agrees to a few ulp per op, not bits
        if not torch.allclose(got, want, rtol=1e-5, atol=0):
            raise SystemExit(f"error: compiled loss {got.item()} differs from eager {want.item()}")
        runs = {"eager": eager, f"compiled ({opts.backend})": compiled}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(opts.steps):  # alternate, so the machine's load falls on both alike
            for name, fn in runs.items():
                wall, cpu, _ = _step(model, fn, tokens)
                times[name].append((wall, cpu))
    rows = [_summary(name, t, layers) for name, t in times.items()]
    ratio = rows[0]["median_cpu_ms"] / rows[1]["median_cpu_ms"]
    for row in rows:
        row.pop("median_cpu_ms")
    print_report("host time per layer per micro-batch, eager vs compiled (debug_tiny, 2 x 32 tokens)", rows,
                 json_path=opts.json,
                 notes=[f"layers per step: {layers} (3 + 1 MTP); {opts.steps} steps each; first compiled call "
                        f"(the compile) {compile_s:.1f} s; eager / compiled main-thread CPU: {ratio:.2f}x"])


if __name__ == "__main__":
    main()
