"""Host time per layer per micro-batch, eager vs ``torch.compile(fullgraph=True)``, of the one-process model's
forward + loss + backward on the tiny-dimension model (``debug_tiny``: dim 32, 3 layers + 1 MTP depth, one
micro-batch of 2 x 32 tokens), where Python and dispatch, not arithmetic, set the time.

Both run in this process, alternating step by step, after a warm-up (the compile). Reported: the median (and
min-max) of each step's wall and main-thread CPU time (``time.thread_time``), divided by the layers it runs; on a
GPU (``--device cuda``) the wall time ends at a device synchronisation and the host time is read before it. The
compiled loss is checked against eager's first (the same model and tokens).

``--cuda-graph`` (with ``--device cuda``) adds one block, the dense layer 0 (static shapes; an MoE layer's grouped
row count depends on the routing, which a CUDA graph cannot replay), forward + backward: eager, compiled, and
compiled with ``mode="reduce-overhead"`` (Inductor's CUDA-graph trees), each checked against eager's output, input
gradient and weight gradients before it is timed; a mode that fails or differs is reported as not working, not
timed. Usage: ``python -m recipes.bench_compile [--device cpu|cuda] [--backend inductor|aot_eager] [--cuda-graph]
[--steps 20] [--json out.json]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from accel.cli import ArgumentParser
from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.model import lm_losses_from_hidden
from models.deepseek_v3.rope import rope_cos_sin
from recipes.benchutil import print_report

# fp32 on both sides: a compiled graph reorders sums of at most 2 x 32 tokens x 64 channels, a few ulp each
RTOL = 1e-4


def next_token_loss(model: Transformer):
    """``loss(tokens)``: the model's next-token loss (MTP included) on ``tokens``, as training takes it (the fused
    head, no logits kept); what the benchmark times and ``tests/test_compile.py`` compiles."""
    args = model.args

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        inp, labels = tokens[:, :-1], tokens[:, 1:]
        h = model.run_layers(model.embed_tokens(inp))
        return lm_losses_from_hidden(args, model.norm, model.head, model.mtp, model.embed, h, inp, labels)["loss"]

    return loss


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(wall s, host CPU s, result) of ``fn()``; on a GPU the wall time waits for the device, the CPU time not."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    cpu = time.thread_time() - cpu
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, cpu, out


def _summary(name: str, times: list[tuple[float, float]], layers: int) -> dict:
    walls = [1e3 * w / layers for w, _ in times]
    cpus = [1e3 * c / layers for _, c in times]
    return {"run": name, "wall ms / layer / mb": f"{statistics.median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}]",
            "main-thread CPU ms / layer / mb": f"{statistics.median(cpus):.2f} [{min(cpus):.2f}-{max(cpus):.2f}]",
            "median_cpu_ms": statistics.median(cpus)}


def _alternate(runs: dict[str, Callable[[], torch.Tensor]], steps: int, device: torch.device
               ) -> dict[str, list[tuple[float, float]]]:
    """Each run ``steps`` times, alternating, so the machine's load falls on all alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, fn in runs.items():
            wall, cpu, _ = _timed(fn, device)
            times[name].append((wall, cpu))
    return times


def _model_rows(model: Transformer, backend: str, steps: int, device: torch.device) -> tuple[list[dict], list[str]]:
    """The whole model's step, eager vs compiled; (rows, notes). SystemExit when the compiled loss differs."""
    layers = model.args.n_layers + model.args.n_mtp_layers
    tokens = torch.randint(0, model.args.vocab_size, (2, 33), device=device)

    def step(fn) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = fn(tokens)
            loss.backward()
            return loss.detach()
        return run

    eager = step(next_token_loss(model))
    compiled = step(torch.compile(next_token_loss(model), fullgraph=True, backend=backend))
    _, _, want = _timed(eager, device)
    compile_s, _, got = _timed(compiled, device)
    if not torch.allclose(got, want, rtol=RTOL, atol=0):
        raise SystemExit(f"error: compiled loss {got.item()} differs from eager {want.item()}")
    times = _alternate({"eager": eager, f"compiled ({backend})": compiled}, steps, device)
    rows = [_summary(name, t, layers) for name, t in times.items()]
    ratio = rows[0]["median_cpu_ms"] / rows[1]["median_cpu_ms"]
    return rows, [f"whole model: layers per step {layers} (3 + 1 MTP); first compiled call (the compile) "
                  f"{compile_s:.1f} s; eager / compiled host CPU: {ratio:.2f}x"]


def _block_rows(model: Transformer, steps: int, device: torch.device) -> tuple[list[dict], list[str]]:
    """Layer 0 (dense) forward + backward: eager, compiled, and CUDA graphs (``reduce-overhead``)."""
    block = model.layers[0]
    x = torch.randn(2, 32, model.args.dim, device=device)
    dy = torch.randn_like(x)
    cos, sin = rope_cos_sin(model.args, torch.arange(32, device=device))
    params = [p for p in block.parameters() if p.requires_grad]

    def step(fn) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the graphs' outputs may be overwritten
            for p in params:  # in place (set_to_none would leave a replayed graph writing into a freed .grad)
                p.grad.zero_()
            xi = x.detach().requires_grad_()
            y = fn(xi, cos, sin)
            y.backward(dy)
            return torch.cat([y.detach().flatten(), xi.grad.flatten(), *(p.grad.flatten() for p in params)])
        return run

    for p in params:
        p.grad = torch.zeros_like(p)
    modes = {"eager": block,
             "compiled (inductor)": torch.compile(block, fullgraph=True),
             "CUDA graph (reduce-overhead)": torch.compile(block, fullgraph=True, mode="reduce-overhead")}
    runs, notes = {}, []
    want = step(block)()
    for name, fn in modes.items():
        run = step(fn)
        try:
            for _ in range(3):  # reduce-overhead records on the second call and replays from the third
                got = run()
            diff = float((got - want).abs().max() / want.abs().max())
        except Exception as exc:  # noqa: BLE001 - a mode that does not work is reported, the others still timed
            notes.append(f"block: {name} does not work here: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        if diff > RTOL:
            notes.append(f"block: {name} does not work here: output / gradients differ from eager by {diff:.2e} "
                         "of their largest element")
            continue
        runs[name] = run
    rows = [_summary(f"block 0: {name}", t, 1) for name, t in _alternate(runs, steps, device).items()]
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time one block under CUDA graphs (mode reduce-overhead); needs --device cuda")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (default 20)")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this file")
    opts = parser.parse_args(argv)
    if opts.steps < 1:
        parser.error(f"--steps must be >= 1, got {opts.steps}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch here")
    if opts.cuda_graph and opts.device != "cuda":
        parser.error(f"--cuda-graph captures CUDA graphs: it needs --device cuda, got --device {opts.device}")
    device = torch.device(opts.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelArgs.preset("debug_tiny", n_layers=3, n_dense_layers=1, n_mtp_layers=1)).train()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        rows, notes = _model_rows(model, opts.backend, opts.steps, device)
        if opts.cuda_graph:
            block_rows, block_notes = _block_rows(model, opts.steps, device)
            rows, notes = rows + block_rows, notes + block_notes
    for row in rows:
        row.pop("median_cpu_ms")
    print_report(f"host time per layer per micro-batch, eager vs compiled (debug_tiny, 2 x 32 tokens, {opts.device})",
                 rows, json_path=opts.json, notes=[*notes, f"{opts.steps} timed steps of each"])


if __name__ == "__main__":
    main()
