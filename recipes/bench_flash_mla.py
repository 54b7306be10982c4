"""FlashMLA benchmark: paged MLA decode (GB/s, TFLOP/s) and training attention fwd+bwd vs torch SDPA, one run.

    python -m recipes.bench_kernels flash_mla              # full sweep on a GPU
    python -m recipes.bench_kernels flash_mla --quick      # a few rows of each table (GPU smoke check)
    python -m recipes.bench_kernels flash_mla --json out.json

Decode sweep as FlashMLA's: b=128, mean s_k in {4096, 8192, 16384}, h_q in {16, 32, 64, 128},
s_q in {1, 2} (causal), lengths equal or varied (normal around the mean, sd mean/2), bf16 cache,
plus FP8-cache rows. Baseline: torch SDPA on the same KV laid out densely (no paging; equal lengths
only). Training: ``mla_attention`` forward+backward (q/k 192, v 128, causal, bf16) vs SDPA at seq
2048-8192. DSA: ``flash_mla_sparse_fwd`` forward and ``sparse_mla_attention`` forward+backward at s 8K-64K,
h_q 128, top-k 2048, with dense ``mla_attention`` forward+backward at the same s beside them. On a cpu
there is no GPU to measure: a tiny correctness pass runs in the Triton interpreter instead, clearly
labelled, and its timings mean nothing.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence

import torch

import accel
from recipes.benchutil import kernel_bench_parser, print_report, row_sink

D_QK, D_V = 576, 512


def _decode_inputs(b, s_q, h_q, mean_sk, varlen, fp8, device, seed=0):
    import flash_mla

    rng = random.Random(seed)
    lens = [max(s_q, int(rng.normalvariate(mean_sk, mean_sk / 2))) if varlen else mean_sk for _ in range(b)]
    max_blocks = -(-max(lens) // 64)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s_q, h_q, D_QK, device=device, dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(b * max_blocks, 64, 1, D_QK, device=device, dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(b * max_blocks, device=device, generator=gen).to(torch.int32).view(b, max_blocks)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    dense = None if varlen else cache[table.long()].reshape(b, max_blocks * 64, D_QK)[:, :mean_sk]
    if fp8:
        cache = flash_mla.quantize_kv_fp8(cache)
    meta, splits = flash_mla.get_mla_metadata(seqlens, s_q * h_q, 1)
    return (q, cache, table, seqlens, D_V, meta, splits), lens, dense


def _sdpa_decode(q, dense):
    """Baseline: SDPA over the unpaged KV, heads sharing the one KV head (non-causal: same bytes moved)."""
    k = dense.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, k[..., :D_V], enable_gqa=True)


def decode_rows(quick: bool, baseline: bool, device, sink) -> list[dict]:
    import flash_mla

    spec = accel.lookup(accel.device_name())
    sweep = [(sk, h, sq, vl, False) for sk in (4096, 8192, 16384) for h in (16, 32, 64, 128) for sq in (1, 2)
             for vl in (False, True)]
    sweep += [(8192, h, sq, vl, True) for h in (64, 128) for sq in (1, 2) for vl in (False, True)]
    if quick:  # the memory-bound rows (s_q 1, h_q 16 and 128, long caches: the 3000 GB/s target), MTP, FP8
        sweep = [(16384, 16, 1, False, False), (16384, 128, 1, False, False), (16384, 16, 1, False, True),
                 (16384, 128, 1, False, True), (8192, 64, 2, True, False)]
    rows = []
    for mean_sk, h_q, s_q, varlen, fp8 in sweep:
        args, lens, dense = _decode_inputs(128, s_q, h_q, mean_sk, varlen, fp8, device)
        run = functools.partial(flash_mla.flash_mla_with_kvcache, *args, causal=s_q > 1, is_fp8_kvcache=fp8)
        run()  # autotune + compile outside the timing
        ms = accel.do_bench(run)
        tokens = sum(lens)
        kv_bytes = tokens * (656 if fp8 else 2 * D_QK)
        io_bytes = 128 * s_q * h_q * 2 * (D_QK + D_V)
        flops = 2.0 * tokens * s_q * h_q * (D_QK + D_V)
        row = dict(cache="fp8" if fp8 else "bf16", s_k=mean_sk, h_q=h_q, s_q=s_q, varlen=varlen, ms=ms,
                   GBps=(kv_bytes + io_bytes) / ms / 1e6, TFLOPs=flops / ms / 1e9)
        if spec:
            row["hbm_%"] = 100 * row["GBps"] / spec.memory_gbps
        if baseline and dense is not None and not fp8:
            sdpa_ms = accel.do_bench(functools.partial(_sdpa_decode, args[0], dense))
            row.update(sdpa_ms=sdpa_ms, speedup=sdpa_ms / ms)
        rows.append(sink(row))
        args = dense = None  # free this row's cache before the next is built
        accel.empty_cache()
    return rows


def training_rows(quick: bool, baseline: bool, device, sink) -> list[dict]:
    import flash_mla
    from accel import registry

    shapes = [(2, 4096, 32), (1, 8192, 32), (4, 2048, 32), (1, 4096, 128)]
    if quick:
        shapes = [(2, 4096, 32)]
    rows = []
    for b, s, h in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k = (torch.randn(b, s, h, 192, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        v, dout = (torch.randn(b, s, h, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        for t in (q, k, v):
            t.requires_grad_()
        # model FLOPs (causal half): forward QK^T + PV, backward twice that; the recompute is not counted
        flops = 3 * 2.0 * b * h * (s * s / 2) * (192 + 128)

        def ours():
            with registry.force("triton"):
                out = flash_mla.mla_attention(q, k, v, causal=True)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), dout)  # noqa: B023

        def sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))  # noqa: B023

        ours()
        ms = accel.do_bench(ours, warmup=3, rep=10)
        row = dict(b=b, seq=s, heads=h, dqk=192, dv=128, ms=ms, TFLOPs=flops / ms / 1e9)
        if baseline:
            sdpa_ms = accel.do_bench(sdpa, warmup=3, rep=10)
            row.update(sdpa_ms=sdpa_ms, sdpa_TFLOPs=flops / sdpa_ms / 1e9, speedup=sdpa_ms / ms)
        rows.append(sink(row))
    return rows


def _causal_topk(s: int, topk: int, device) -> torch.Tensor:
    """int32 [s, topk]: query t's top-k drawn uniformly from keys 0..t (repeats where t < topk, as a row with few
    candidates has; every slot valid, so every slot is work)."""
    t = torch.arange(s, device=device, dtype=torch.float32)[:, None]
    return (torch.rand(s, topk, device=device) * (t + 1)).to(torch.int32)


def sparse_rows(quick: bool, baseline: bool, device, sink) -> list[dict]:
    """DSA prefill at DeepSeek-V3.2's shape (h_q 128, d_qk 576, d_v 512, top-k 2048, one query per token):
    ``flash_mla_sparse_fwd`` forward, ``sparse_mla_attention`` forward+backward, and dense ``mla_attention``
    forward+backward (V3's 192/128 heads, causal) on the same sequence length beside them."""
    import flash_mla
    from accel import registry

    h, topk = 128, 2048
    sweep = [("fwd", s) for s in (8192, 16384, 32768, 65536)] + [("fwd+bwd", s) for s in (8192, 16384, 32768)]
    if quick:
        sweep = [("fwd", 8192), ("fwd", 65536), ("fwd+bwd", 8192)]
    rows = []
    for kind, s in sweep:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(s, h, D_QK, device=device, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(s, D_QK, device=device, dtype=torch.bfloat16, generator=gen)
        idx = _causal_topk(s, topk, device)
        fwd_flops = 2.0 * s * h * topk * (D_QK + D_V)
        if kind == "fwd":
            run = functools.partial(flash_mla.flash_mla_sparse_fwd, q, kv[:, None], idx[:, None], D_QK ** -0.5)
            flops = fwd_flops
        else:
            q.requires_grad_()
            kv.requires_grad_()
            dout = torch.randn(s, h, D_V, device=device, dtype=torch.bfloat16, generator=gen)

            def run():
                with registry.force("triton"):
                    out = flash_mla.sparse_mla_attention(q, kv, idx, D_QK ** -0.5)  # noqa: B023
                torch.autograd.grad(out, (q, kv), dout)  # noqa: B023
            flops = 3 * fwd_flops  # model FLOPs: backward = 2x forward, its recompute not counted
        run()
        ms = accel.do_bench(run, warmup=2, rep=5)
        row = dict(op=f"sparse {kind}", seq=s, h_q=h, topk=topk, ms=ms, TFLOPs=flops / ms / 1e9)
        if baseline and kind == "fwd+bwd":
            row.update(_dense_beside(s, h, device))
        rows.append(sink(row))
        q = kv = idx = run = None
        accel.empty_cache()
    return rows


def _dense_beside(s: int, h: int, device) -> dict:
    """Dense causal ``mla_attention`` forward+backward at the same length and heads (V3's 192 / 128 head dims)."""
    import flash_mla
    from accel import registry

    gen = torch.Generator(device=device).manual_seed(1)
    q, k = (torch.randn(s, h, 192, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    v = torch.randn(s, h, 128, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(s, h, 128, device=device, dtype=torch.bfloat16, generator=gen)

    def run():
        with registry.force("triton"):
            out = flash_mla.mla_attention(q[None], k[None], v[None], causal=True)
        torch.autograd.grad(out, (q, k, v), dout[None])

    run()
    ms = accel.do_bench(run, warmup=2, rep=5)
    return dict(dense_ms=ms, dense_TFLOPs=3 * 2.0 * h * (s * s / 2) * (192 + 128) / ms / 1e9)


def cpu_correctness_rows() -> list[dict]:
    """Tiny shapes through the Triton interpreter, checked against the references (no performance meaning)."""
    import flash_mla
    from accel import registry
    from flash_mla.attention import mla_attention_reference
    from flash_mla.decode import compare_decode, flash_mla_with_kvcache_reference, make_paged_case
    from flash_mla.sparse import flash_mla_sparse_fwd_reference
    from verifier.verify import calc_diff

    rows = []
    for seqlens, s_q, h_q, fp8 in (([0, 150], 1, 16, False), ([130, 70], 2, 8, False), ([90, 40], 1, 16, True)):
        g = torch.Generator().manual_seed(1)
        q, cache, table, lens = make_paged_case(2, s_q, h_q, 1, seqlens, fp8, g, "cpu")
        meta, splits = flash_mla.get_mla_metadata(lens, s_q * h_q, 1)
        args = (q, cache, table, lens, D_V, meta, splits)
        kw = dict(causal=s_q > 1, is_fp8_kvcache=fp8)
        with registry.force("triton"):
            got = flash_mla.flash_mla_with_kvcache(*args, **kw)
        errs = compare_decode(got, flash_mla_with_kvcache_reference(*args, **kw))
        rows.append(dict(op="decode", shape=f"seqlens={seqlens},s_q={s_q},h_q={h_q},{'fp8' if fp8 else 'bf16'}",
                         out_err=errs["out"][0], lse_err=errs["lse"][0],
                         ok=all(e < t for e, t in errs.values())))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 16, D_QK, generator=g).bfloat16()
    kv = torch.randn(90, D_QK, generator=g).bfloat16()
    idx = _causal_topk(6, 32, "cpu") + 60
    with registry.force("triton"):
        got = flash_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], D_QK ** -0.5)
    errs = compare_decode((got[0], got[2]), (flash_mla_sparse_fwd_reference(q, kv[:, None], idx[:, None],
                                                                            D_QK ** -0.5)[0::2]))
    rows.append(dict(op="sparse fwd", shape="s_q=6,s_kv=90,h_q=16,topk=32,576/512,bf16", out_err=errs["out"][0],
                     lse_err=errs["lse"][0], ok=all(e < t for e, t in errs.values())))
    q, k = torch.randn(1, 40, 2, 192).bfloat16(), torch.randn(1, 40, 2, 192).bfloat16()
    v = torch.randn(1, 40, 2, 128).bfloat16()
    with registry.force("triton"):
        got = flash_mla.mla_attention(q, k, v)
    err = calc_diff(got, mla_attention_reference(q, k, v))
    rows.append(dict(op="mla_attention fwd", shape="b=1,s=40,h=2,192/128,bf16", out_err=err, ok=err < 1e-5))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = kernel_bench_parser("flash_mla", __doc__, "also write the decode and training tables as JSON (two files)",
                               "skip the torch SDPA columns").parse_args(argv)

    if accel.backend() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any flash_mla kernel module is imported
        rows = cpu_correctness_rows()
        print_report("flash_mla: CPU interpreter correctness pass (NOT a benchmark; needs a GPU)", rows,
                     json_path=args.json, notes=["the decode and training benchmarks need a CUDA or MUSA GPU; "
                                                 "this pass only checks the Triton kernels against the references"])
        return 0 if all(r["ok"] for r in rows) else 1
    device = accel.default_device()
    json_base = args.json[:-5] if args.json and args.json.endswith(".json") else args.json
    dec = decode_rows(args.quick, not args.no_baseline, device, row_sink(args.json, "decode"))
    print_report("flash_mla decode (b=128, paged 64-token blocks, h_kv=1)", dec,
                 json_path=f"{json_base}_decode.json" if json_base else None,
                 notes=["GBps counts the KV bytes of every token read once plus q and out; FlashMLA's H800 figure: "
                        "3000 GB/s memory-bound, 660 TFLOP/s compute-bound",
                        "sdpa: torch SDPA over a dense (unpaged) copy of the same KV, equal lengths only"])
    train = training_rows(args.quick, not args.no_baseline, device, row_sink(args.json, "training"))
    print_report("flash_mla.mla_attention forward+backward (causal, bf16)", train,
                 json_path=f"{json_base}_training.json" if json_base else None,
                 notes=["TFLOPs: model FLOPs 3 x 2 x b x h x s^2/2 x (192+128); backward recompute not counted"])
    sparse = sparse_rows(args.quick, not args.no_baseline, device, row_sink(args.json, "sparse"))
    print_report("flash_mla DSA sparse prefill (h_q 128, 576/512, top-k 2048) beside dense mla_attention", sparse,
                 json_path=f"{json_base}_sparse.json" if json_base else None,
                 notes=["TFLOPs: forward 2 x s x h x topk x (576+512); fwd+bwd 3x that (backward recompute not "
                        "counted); FlashMLA's sparse forward: 640 TFLOP/s on H800",
                        "dense_*: mla_attention forward+backward, causal, 192/128 heads, same s and h; model FLOPs "
                        "3 x 2 x h x s^2/2 x (192+128)"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
