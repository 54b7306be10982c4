"""``python -m recipes.plan calibrate --out system.json``: measure a system file on the local GPU.

Starts from the shipped file of the local device (``accel.specs`` name, or ``--base``) and replaces its
efficiencies with measured ones at the model's shapes: BF16 GEMMs through torch (what the BF16
Linear runs; its forward, input- and weight-gradient layouts each), FP8 GEMMs and grouped GEMMs through
``deep_gemm`` (what ``model.fp8`` runs; forward kernels, standing for all three passes), the attention
core forward and backward through ``flash_mla.mla_attention``, and memory-bound bandwidth from a device
copy. Each shape's efficiency is achieved FLOP/s (or bytes/s) over the peak; the class efficiency is the
median of the forward figures over shapes. Under torchrun with more than one process it also times the
collectives over the local ranks (all-to-all, all-gather ring, P2P) and writes the intra-node link.

On a CPU it refuses: the figures would describe the CPU, not a GPU, and the planner plans GPUs.
``measure`` itself runs anywhere (tests call it on the CPU with tiny shapes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import accel
import deep_gemm
from accel import specs
from accel.cli import ArgumentParser, check_output_file, positive_int
from accel.timing import do_bench
from flash_mla import mla_attention
from models.deepseek_v3 import ModelArgs
from planner.costs import Op, attention_core, attention_ops, ffn_ops, gemm
from planner.system import PASSES, System, load_system


def model_shapes(args: ModelArgs, tokens: int, seq_len: int, ep: int) -> list[Op]:
    """The GEMMs and the attention core of one dense and one MoE block at ``tokens`` tokens per micro-batch."""
    ops = attention_ops(args, tokens, False) + [attention_core(args, tokens, seq_len),
                                                gemm("wo", tokens, args.dim, args.n_heads * args.v_head_dim)]
    ops += ffn_ops(args, 0, tokens, ep, False, 1.0) + ffn_ops(args, args.n_layers - 1, tokens, ep, False, 1.0)
    seen, out = set(), []
    for op in ops:
        if op.flops > 0 and (op.kind, op.shape) not in seen:
            seen.add((op.kind, op.shape))
            out.append(op)
    return out


def _gemm_seconds(m: int, n: int, k: int, groups: int, fp8: bool, device: torch.device) -> float:
    """Seconds of ``groups`` GEMMs of ``[m, k] x [k, n]`` (grouped ones padded to 128-row blocks, as the
    contiguous layout needs; ``measure`` counts the padded FLOPs)."""
    if not fp8 and groups == 1:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        return do_bench(lambda: a @ b) * 1e-3
    rows = m * groups
    a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16)
    d = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    if groups == 1:
        a8, b8 = deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b[0])
        return do_bench(lambda: deep_gemm.fp8_gemm_nt(a8, b8, d)) * 1e-3
    idx = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m)
    if not fp8:
        return do_bench(lambda: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, idx)) * 1e-3
    a8, b8 = deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b)
    return do_bench(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a8, b8, d, idx)) * 1e-3


def _dense_bf16_passes(m: int, n: int, k: int, device: torch.device) -> tuple[float, float, float]:
    """Seconds of a BF16 Linear's three GEMMs, as its backward runs them: forward ``x[m,k] @ w[k,n]``, input
    gradient ``g[m,n] @ w^T``, weight gradient ``x^T @ g`` (the reduction over the ``m`` tokens)."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return tuple(do_bench(fn) * 1e-3 for fn in (lambda: x @ w, lambda: g @ w.t(), lambda: x.t() @ g))


def _attention_seconds(args: ModelArgs, seq_len: int, batch: int, device: torch.device) -> tuple[float, float]:
    h = args.n_heads
    q = torch.randn(batch, seq_len, h, args.qk_head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn(batch, seq_len, h, args.v_head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    fwd = do_bench(lambda: mla_attention(q, k, v, causal=True)) * 1e-3
    out = mla_attention(q, k, v, causal=True)
    grad = torch.randn_like(out)
    bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)) * 1e-3
    return fwd, bwd


def _copy_gbps(device: torch.device, nbytes: int) -> float:
    x = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * nbytes / (do_bench(lambda: y.copy_(x), flush_l2=False) * 1e-3) / 1e9


def measure(base: System, args: ModelArgs, tokens: int, seq_len: int, ep: int, device: torch.device,
            copy_bytes: int = 1 << 30) -> System:
    """``base`` with efficiencies measured on ``device`` at ``args``' shapes (``calibrated: true``)."""
    shape_eff: dict[str, dict[str, dict[str, float]]] = {}  # class: shape: pass (f, i, w)
    fp8 = base.fp8_tflops > 0 and accel.fp8_native()
    for op in model_shapes(args, tokens, seq_len, ep):
        if op.kind == "attention":
            fwd, bwd = _attention_seconds(args, seq_len, max(1, tokens // seq_len), device)
            peak = base.bf16_tflops * 1e12
            shape_eff.setdefault("attention_fwd", {})[op.shape] = dict.fromkeys(PASSES, op.flops / fwd / peak)
            shape_eff.setdefault("attention_bwd", {})[op.shape] = dict.fromkeys(PASSES, 2.5 * op.flops / bwd / peak)
            continue
        m, n, k = (int(x) for x in op.shape.split("x"))
        groups = max(1, round(op.flops / (2.0 * m * n * k)))
        if groups > 1:
            m = -(-m // 128) * 128
        for low in (False, True) if fp8 else (False,):
            kind = ("fp8_" if low else "") + op.kind
            peak = (base.fp8_tflops if low else base.bf16_tflops) * 1e12
            if kind == "gemm":  # each pass measured: dgrad and wgrad run other layouts and reduction lengths
                passes = _dense_bf16_passes(m, n, k, device)
            else:  # DeepGEMM's forward kernels; their figure stands for all three passes
                passes = (_gemm_seconds(m, n, k, groups, low, device),) * 3
            shape_eff.setdefault(kind, {})[op.shape] = {p: 2.0 * m * n * k * groups / t / peak
                                                        for p, t in zip(PASSES, passes)}
    eff = dict(base.efficiency)
    for kind, table in shape_eff.items():
        eff[kind] = min(1.0, statistics.median(per["f"] for per in table.values()))
    eff["memory"] = min(1.0, _copy_gbps(device, copy_bytes) / base.memory_gbps)
    where = (f"measured by recipes.plan calibrate on {accel.device_name()} at {args.dim}-dim shapes, {tokens} tokens "
             "per micro-batch")
    sources = {**base.sources, "efficiency.memory": f"{where} (device copy)",
               **{f"efficiency.{k}": f"{where} (median over shapes)" for k in shape_eff},
               **{f"shape_efficiency.{k}": f"{where} ({'each pass' if k == 'gemm' else 'forward, for all passes'})"
                  for k in shape_eff}}
    tables = {k: {shape: {p: min(1.0, e) for p, e in per.items()} for shape, per in t.items()}
              for k, t in shape_eff.items()}
    return dataclasses.replace(base, calibrated=True, efficiency=eff, shape_efficiency=tables, sources=sources)


def measure_collectives(system: System, nbytes: int = 64 << 20) -> System:
    """Intra-node bandwidth and latency from all-gather and P2P over the local ranks (torchrun)."""
    dist.init_process_group(accel.dist_backend())
    try:
        world, device = dist.get_world_size(), accel.default_device()
        x = torch.empty(nbytes // world, dtype=torch.uint8, device=device)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ag = do_bench(lambda: dist.all_gather_into_tensor(out, x), flush_l2=False) * 1e-3
        small = torch.empty(8, device=device)
        lat = do_bench(lambda: dist.all_reduce(small), flush_l2=False) * 1e-3
        a2a_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
        a2a_out = torch.empty_like(a2a_in)
        a2a = do_bench(lambda: dist.all_to_all_single(a2a_out, a2a_in), flush_l2=False) * 1e-3
    finally:
        dist.destroy_process_group()
    bw = (world - 1) / world * nbytes / ag / 1e9
    intra = dataclasses.replace(system.intra_node, bandwidth_gb_s=bw, latency_us=lat * 1e6)
    coll = {**system.collective_efficiency, "ring": 1.0,
            "all_to_all": min(2.0, (world - 1) / world * nbytes / a2a / 1e9 / bw)}
    return dataclasses.replace(system, intra_node=intra, collective_efficiency=coll)


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="python -m recipes.plan calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="system file to write (JSON)")
    ap.add_argument("--base", default=None, help="shipped system to start from (default: the local device's)")
    ap.add_argument("--model", default="deepseek_v3_671b", help="preset whose shapes are measured")
    ap.add_argument("--tokens", type=positive_int, default=4096, help="tokens per micro-batch")
    ap.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (attention shapes)")
    ap.add_argument("--ep", type=positive_int, default=8, help="expert-parallel size (experts per grouped GEMM)")
    ns = ap.parse_args(argv)
    check_output_file(ns.out, "--out")
    ModelArgs.preset(ns.model)  # an unknown preset: ValueError naming the presets
    if ns.base is not None:
        load_system(ns.base)
    if accel.backend() == "cpu":
        raise ValueError("calibrate measures a GPU (CUDA or MUSA) and none is visible here; plan with a shipped "
                         "system file (--gpu H800 ...) or run calibrate on the GPU machine")
    name = ns.base or accel.device_name()
    spec = specs.lookup(name)
    if spec is None and ns.base is None:
        raise ValueError(f"calibrate: local device {name!r} has no shipped system file; pass --base (e.g. H100)")
    base = load_system(ns.base or spec.name.replace(" ", "-"))
    system = measure(base, ModelArgs.preset(ns.model), ns.tokens, ns.seq_len, ns.ep, accel.default_device())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        system = measure_collectives(system)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(ns.out).write_text(json.dumps(system.to_json(), indent=2) + "\n")
        print(f"wrote {ns.out}: " + ", ".join(f"{k} {v:.2f}" for k, v in system.efficiency.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
