"""fused_ops benchmark: each fused memory-bound op against the unfused PyTorch sequence it replaces, one run.

    python -m recipes.bench_kernels fused              # every row, on a GPU
    python -m recipes.bench_kernels fused --quick      # only the three rows with targets (GPU smoke check)
    python -m recipes.bench_kernels fused --json out.json

GB/s counts the bytes the fused kernel must move (each input read once, each output written once) over its
time (the fused side called as the model calls it, through its ``torch.ops.dsv3`` custom op); ``hbm_%`` is that
against the device's peak bandwidth (``accel.specs``); ``unfused`` is the torch
sequence of the op's registered reference (the ops the model ran before: add, norm, cast... one kernel
each), timed in the same run, and ``speedup`` the ratio. Targets (issue 30): >= 70% of peak and >= 1.5x the
unfused sequence for RMSNorm+residual, SwiGLU+quant and permute+quant. V3's shapes: 4096 tokens of 7168,
experts 2048 wide, top-8 of 256, 128 attention heads with 64 rotary dims, the indexer's 64 heads.
On a cpu there is no GPU to measure: a tiny correctness pass runs in the Triton interpreter instead, clearly
labelled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import accel
from recipes.benchutil import kernel_bench_parser, print_report, row_sink

TOKENS, DIM, INTER, TOPK, EXPERTS = 4096, 7168, 2048, 8, 256
TARGETS = ("rmsnorm+residual", "swiglu+quant", "permute+quant")


@dataclass
class Row:
    name: str
    shape: str
    fused: Callable[[], object]
    unfused: Callable[[], object]
    bytes: float


def _bf16(*shape: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)


def rows(device, quick: bool) -> list[Row]:
    import fused_ops
    from fused_ops import ops

    x, r = _bf16(TOKENS, DIM, device=device, seed=0), _bf16(TOKENS, DIM, device=device, seed=1)
    w = torch.ones(DIM, device=device, dtype=torch.bfloat16)
    rstd = torch.rand(TOKENS, device=device) + 0.5
    dy = _bf16(TOKENS, DIM, device=device, seed=2)
    rows_e = TOKENS * TOPK
    gu = _bf16(rows_e, 2 * INTER, device=device, seed=3)
    rw = torch.rand(rows_e, device=device)
    g_out = _bf16(rows_e, INTER, device=device, seed=4)
    indices = torch.rand(TOKENS, EXPERTS, device=device).topk(TOPK, dim=-1).indices
    layout = fused_ops.grouping(indices, EXPERTS, 128)
    m = layout.assign.numel()
    y_grouped = _bf16(m, DIM, device=device, seed=5)
    route_w = torch.rand(TOKENS, TOPK, device=device)
    q = _bf16(1, TOKENS, 128, 192, device=device, seed=6)
    qi = _bf16(1, TOKENS, 64, 128, device=device, seed=7)
    angles = torch.rand(TOKENS, 32, device=device) * 100
    cos, sin = angles.cos(), angles.sin()
    logits = torch.randn(TOKENS, EXPERTS, device=device)
    bias = torch.randn(EXPERTS, device=device) * 0.1
    route_idx = indices.contiguous()
    columns = _bf16(rows_e, 2, device=device, seed=8)  # a routing weight as two bf16 columns (the EP send)
    landed = fused_ops.grouping(torch.randint(0, 32, (rows_e, 1), device=device), 32, 128)  # 32 local experts
    landed_q = (_bf16(rows_e, DIM, device=device, seed=9).float() * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    landed_sf = torch.rand(rows_e, DIM // 128, device=device) / 448 + 1e-6
    e = 2  # bf16 bytes
    tile = 4 / 128  # one fp32 scale per 128 values
    out = [
        Row("rmsnorm+residual", f"{TOKENS}x{DIM}", lambda: torch.ops.dsv3.rmsnorm(x, w, r),
            lambda: ops.rmsnorm_reference(x, w, r), TOKENS * DIM * 4 * e),
        Row("swiglu+quant", f"{rows_e}x{INTER} weighted", lambda: torch.ops.dsv3.swiglu_fp8(gu, rw),
            lambda: ops.swiglu_fp8_reference(gu, rw), rows_e * INTER * (2 * e + 1 + tile)),
        Row("permute+quant", f"{TOKENS}x{DIM} top-{TOPK}/{EXPERTS}",
            lambda: torch.ops.dsv3.permute_gather_fp8(x, layout.assign, TOPK, route_w.view(-1)),
            lambda: ops.permute_gather_fp8_reference(x, layout.assign, TOPK, route_w.view(-1)),
            TOKENS * DIM * e + m * DIM * (1 + tile)),
    ]
    if quick:
        return out
    return out + [
        Row("rope interleaved (MLA q)", f"{TOKENS}x128x64 of 192",
            lambda: fused_ops.rope_(q[..., 128:], cos, sin),
            lambda: ops.rope_reference(q[..., 128:], cos, sin, q[..., 128:]), TOKENS * 128 * 64 * 2 * e),
        Row("rmsnorm+residual+quant", f"{TOKENS}x{DIM}", lambda: torch.ops.dsv3.rmsnorm_fp8(x, w, r),
            lambda: ops.rmsnorm_fp8_reference(x, w, r), TOKENS * DIM * (4 * e + 1 + tile)),
        Row("rmsnorm backward (+residual grad)", f"{TOKENS}x{DIM}",
            lambda: torch.ops.dsv3.rmsnorm_backward(x, w, rstd, dy, r),
            lambda: ops.rmsnorm_backward_reference(x, w, rstd, dy, r), TOKENS * DIM * 4 * e),
        Row("swiglu", f"{rows_e}x{INTER} weighted", lambda: torch.ops.dsv3.swiglu(gu, rw),
            lambda: ops.swiglu_reference(gu, rw), rows_e * INTER * 3 * e),
        Row("swiglu backward", f"{rows_e}x{INTER} weighted", lambda: torch.ops.dsv3.swiglu_backward(gu, rw, g_out),
            lambda: ops.swiglu_backward_reference(gu, rw, g_out), rows_e * INTER * 5 * e),
        Row("permute", f"{TOKENS}x{DIM} top-{TOPK}/{EXPERTS}",
            lambda: torch.ops.dsv3.permute_gather(x, layout.assign, TOPK, None, route_w.view(-1)),
            lambda: ops.permute_gather_reference(x, layout.assign, TOPK, None, route_w.view(-1)),
            TOKENS * DIM * e + m * DIM * e),
        Row("unpermute (weighted sum)", f"{TOKENS}x{DIM} top-{TOPK}/{EXPERTS}",
            lambda: torch.ops.dsv3.unpermute_sum(y_grouped, layout.rows, TOPK, route_w.view(-1)),
            lambda: ops.unpermute_sum_reference(y_grouped, layout.rows, TOPK, route_w.view(-1)),
            TOKENS * DIM * e * (TOPK + 1)),
        Row("unpermute backward", f"{TOKENS}x{DIM} top-{TOPK}/{EXPERTS}",
            lambda: torch.ops.dsv3.unpermute_spread(x, y_grouped, layout.assign, TOPK, route_w.view(-1)),
            lambda: ops.unpermute_spread_reference(x, y_grouped, layout.assign, TOPK, route_w.view(-1)),
            TOKENS * DIM * e + 2 * m * DIM * e),
        Row("rope half-split (indexer q)", f"{TOKENS}x64x64 of 128",
            lambda: fused_ops.rope_(qi[..., :64], cos, sin, interleaved=False),
            lambda: ops.rope_reference(qi[..., :64], cos, sin, qi[..., :64], interleaved=False),
            TOKENS * 64 * 64 * 2 * e),
        Row("route (sigmoid+bias+group top-k)", f"{TOKENS}x{EXPERTS}",
            lambda: torch.ops.dsv3.route(logits, bias, TOPK, 8, 4, 2.5),
            lambda: ops.route_reference(logits, bias, TOPK, 8, 4, 2.5), TOKENS * EXPERTS * 8),
        Row("route node-limited (4 of 8 nodes)", f"{TOKENS}x{EXPERTS}",
            lambda: torch.ops.dsv3.route(logits, bias, TOPK, 8, 4, 2.5, True, 8, 4),
            lambda: ops.route_reference(logits, bias, TOPK, 8, 4, 2.5, True, 8, 4), TOKENS * EXPERTS * 8),
        Row("route softmax (V2: 160 experts, top-6)", f"{TOKENS}x160",
            lambda: torch.ops.dsv3.route_softmax(logits[:, :160], 6, 8, 3, 16.0),
            lambda: ops.route_softmax_reference(logits[:, :160], 6, 8, 3, 16.0), TOKENS * 160 * 8),
        Row("EP send gather (+weight columns)", f"{TOKENS}x{DIM} top-{TOPK}",
            lambda: torch.ops.dsv3.gather_rows(x, layout.assign, TOPK, columns),
            lambda: ops.gather_rows_reference(x, layout.assign, TOPK, columns), TOKENS * DIM * e + m * (DIM + 2) * e),
        Row("EP FP8 landing (dequant+regroup+quant)", f"{rows_e}x{DIM} to 32 experts",
            lambda: torch.ops.dsv3.gather_dequant_fp8(landed_q, landed_sf, landed.assign, torch.bfloat16),
            lambda: ops.gather_dequant_fp8_reference(landed_q, landed_sf, landed.assign, torch.bfloat16),
            rows_e * DIM * (1 + tile) + landed.assign.numel() * DIM * (e + 1 + tile)),
        Row("route backward", f"{TOKENS}x{EXPERTS}",
            lambda: torch.ops.dsv3.route_backward(logits, route_idx, route_w, logits, 2.5),
            lambda: ops.route_backward_reference(logits, route_idx, route_w, logits, 2.5), TOKENS * EXPERTS * 12),
    ]


def measure(row: Row, baseline: bool, peak_gbps: float | None) -> dict:
    from accel import registry

    with registry.force("triton"):
        row.fused()  # compile outside the timing
        ms = accel.do_bench(row.fused)
    result = dict(op=row.name, shape=row.shape, ms=ms, GBps=row.bytes / ms / 1e6)
    if peak_gbps:
        result["hbm_%"] = 100 * result["GBps"] / peak_gbps
    if baseline:
        unfused_ms = accel.do_bench(row.unfused)
        result.update(unfused_ms=unfused_ms, unfused_GBps=row.bytes / unfused_ms / 1e6, speedup=unfused_ms / ms)
    if row.name in TARGETS and peak_gbps and baseline:
        result["target"] = "met" if result["hbm_%"] >= 70 and result["speedup"] >= 1.5 else "MISSED"
    return result


def cpu_correctness_rows() -> list[dict]:
    """Each fused op through the Triton interpreter at one tiny verify shape, against its reference."""
    from accel import registry
    from verifier import verify

    registry.load_all()
    out = []
    for name in verify.select_ops(["fused_ops.*"]):
        spec = registry.get(name).verify
        [res] = verify.verify_op(name, shapes=spec.shapes[:1], seeds=[1], bench=False)
        out.append(dict(op=name, shape=str(spec.shapes[0]), ok=res.passed, reason=res.reason or ""))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = kernel_bench_parser("fused", __doc__, "also write the table as JSON",
                               "skip the unfused PyTorch columns").parse_args(argv)
    if accel.backend() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any fused_ops kernel module is imported
        table = cpu_correctness_rows()
        print_report("fused_ops: CPU interpreter correctness pass (NOT a benchmark; needs a GPU)", table,
                     json_path=args.json, notes=["GB/s against the unfused sequence needs a CUDA or MUSA GPU; this "
                                                 "pass only checks the Triton kernels against the references"])
        return 0 if all(r["ok"] for r in table) else 1
    spec = accel.lookup(accel.device_name())
    sink = row_sink(args.json, "fused")
    table = [sink(measure(r, not args.no_baseline, spec.memory_gbps if spec else None))
             for r in rows(accel.default_device(), args.quick)]
    print_report("fused_ops: fused kernel vs the unfused PyTorch sequence (bf16, V3 shapes)", table,
                 json_path=args.json,
                 notes=["GBps: the bytes the fused op must move (inputs once, outputs once) over its time; hbm_%: of "
                        f"the device's peak ({spec.memory_gbps:.0f} GB/s)" if spec else "GBps: bytes moved / time",
                        "targets (rmsnorm+residual, swiglu+quant, permute+quant): >= 70% of peak and >= 1.5x unfused"])
    return 0 if all(r.get("target") != "MISSED" for r in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
