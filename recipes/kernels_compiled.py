"""The compile table: every deep_gemm / flash_mla / fused_ops Triton kernel at every autotune config, built on a
CPU for sm_90a (Hopper) or sm_100a (Blackwell).

    python -m recipes.kernels_compiled                                  # every case for sm_90a, table on stdout
    python -m recipes.kernels_compiled --capability 100 --json out.json # sm_100a, rows as JSON
    python -m recipes.kernels_compiled --write benchmarks/kernels_compiled.md --jobs 2
    python -m recipes.kernels_compiled --subset default --json out.json # what tests/test_kernel_compile.py runs

Each case is one kernel specialised as the JIT specialises it at the benchmark shapes (16-divisible
pointers, strides and sizes marked; unit strides and constants folded), compiled with the Triton in
this environment (``accel.aot``), then read back: registers, spill (stack) bytes, shared memory,
whether the SASS uses the architecture's tensor-core MMA (``tensor_core_mma``: Hopper's wgmma, Blackwell's
tcgen05) and TMA, and the size of the main loop. The deep_gemm GEMMs and flash_mla's decode and attention
kernels use that architecture's autotune lists (``deep_gemm.kernels.gemm.tiles_for``,
``flash_mla.kernels.decode.decode_configs``, ``accel.autotune.for_capability``). The gates
(``gate_failures``): no spills, shared memory within a block of that architecture, and the tensor-core MMA in
every MMA kernel whose tile allows it (M tile a multiple of 64 rows per warp group).
Runs without the interpreter: ``main`` clears ``TRITON_INTERPRET`` before any kernel module is imported.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from accel import aot, autotune
from accel.cli import BAD_INPUT, ArgumentParser, check_output_file, positive_int


@dataclass
class Case:
    kernel: str  # module.kernel[variant]
    config: str  # the autotune config, as in the kernel's config list
    fn: object
    pointers: dict
    constexprs: dict
    divisible: tuple = ()
    num_warps: int = 4
    num_stages: int = 2
    mma_rows: int = 0  # rows of the MMA tile (0: no MMA): wgmma / tcgen05 need >= 64 per warp group
    default: bool = False  # part of the quick subset the test suite runs
    vector_loads: bool = False  # a memory-bound pass: its row loads must be 128-bit (LDG.E.128)
    extra: dict = field(default_factory=dict)


def _cfg_label(kwargs: dict, warps: int, stages: int) -> str:
    return " ".join(f"{k}={v}" for k, v in kwargs.items()) + f" w{warps} s{stages}"


def gemm_cases(capability: int = 90) -> list[Case]:
    from deep_gemm.kernels import gemm

    dense, k_grouped = {"ACCUMULATE": False, "SPLIT_K": 1}, {"ACCUMULATE": True, "PACKED": False}
    mx = {"MX": True, "SFB_GRAN_N": 1}
    # (label, kernel, fp8, constexprs, unit strides), as the wrappers launch them on a GPU: FP8 operands K-major
    # (copied if needed), bf16 k-grouped ones MN-major. SPLIT_K > 1 is one binary per value: 4 stands for all.
    variants = [
        ("fp8 dense", gemm._dense_kernel, True, dense, ("s_ak", "s_bk")),
        ("fp8 dense split-k", gemm._dense_kernel, True, {**dense, "SPLIT_K": 4}, ("s_ak", "s_bk")),
        ("fp8 dense wgrad", gemm._dense_kernel, True, {**dense, "SFB_GRAN_N": 1}, ("s_ak", "s_bk")),  # 1x128 B
        ("fp8 m-grouped contiguous", gemm._contiguous_kernel, True, {}, ("s_bk",)),
        ("fp8 masked", gemm._masked_kernel, True, {}, ()),
        ("fp8 k-grouped", gemm._k_grouped_kernel, True, k_grouped, ("s_ak", "s_bk")),
        ("fp8 k-grouped flat", gemm._k_grouped_kernel, True, {**k_grouped, "PACKED": True}, ("s_ak", "s_bk")),
        ("mxfp8 dense", gemm._dense_kernel, True, {**dense, **mx}, ("s_ak", "s_bk")),
        ("mxfp8 m-grouped contiguous", gemm._contiguous_kernel, True, mx, ("s_bk",)),
        ("mxfp8 k-grouped", gemm._k_grouped_kernel, True, {**k_grouped, **mx}, ("s_ak", "s_bk")),
        ("bf16 dense", gemm._dense_kernel, False, dense, ("s_ak", "s_bk")),
        ("bf16 k-grouped", gemm._k_grouped_kernel, False, k_grouped, ("s_am", "s_bn")),
    ]
    cases = []
    for label, kernel, fp8, consts, unit in variants:
        grouped_k = kernel is gemm._k_grouped_kernel
        elem = "*fp8e4nv" if fp8 else "*bf16"
        fp32_out = grouped_k or consts.get("SPLIT_K", 1) > 1
        names = kernel.fn.arg_names
        scale = "*i32" if consts.get("MX") else "*fp32"  # MXFP8: packed UE8M0 scales
        pointers = {n: elem for n in ("a_ptr", "b_ptr")} | {"d_ptr": "*fp32" if fp32_out else "*bf16"} | {
            n: "*i32" if n in ("m_indices_ptr", "masked_m_ptr", "k_offsets_ptr") else scale
            for n in names if n.endswith("_ptr") and n not in ("a_ptr", "b_ptr", "d_ptr")}
        gran = consts.get("SFB_GRAN_N", 1 if grouped_k else 128)
        tiles = gemm.tiles_for(capability, mx=bool(consts.get("MX")), row_scaled_b=fp8 and gran == 1)
        for i, (bm, bn, warps, stages) in enumerate(tiles):
            tile = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": gemm.block_k(fp8), "GROUP_M": 8}
            full = {"FP8": fp8, "MX": False, "SFB_GRAN_N": gran, "INTERPRETED": False, **consts, **tile,
                    **{n: 1 for n in unit}}
            divisible = tuple(n for n in names if n not in full and (n in pointers or n.startswith("s_")
                                                                     or n in ("N", "K")))
            cases.append(Case(f"deep_gemm.gemm[{label}]", _cfg_label(tile, warps, stages), kernel,
                              pointers, full, divisible, warps, stages,
                              mma_rows=bm // max(1, warps // 4), default=(i == 0)))
    from deep_gemm.kernels import fp8_fp4

    # FP8 x MXFP4 (tl.dot_scaled e4m3 x e2m1): tcgen05's block-scaled MMA on sm_100a, an upcast + wgmma on sm_90a
    # (the rows' scales as MXFP8's bytes per 1x32, or blockwise fp32 per 1x128 applied after each step's MMA)
    for label, a_fp32 in (("", False), (", 1x128 fp32 rows", True)):
        for i, (bn, warps, stages) in enumerate(fp8_fp4.tiles_for(capability, a_fp32)):
            tile = {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": fp8_fp4.BLOCK_K}
            pointers = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32" if a_fp32 else "*u8", "b_ptr": "*u8", "sb_ptr": "*u8",
                        "d_ptr": "*bf16", "m_indices_ptr": "*i32"}
            cases.append(Case(f"deep_gemm.gemm[fp8 x mxfp4 m-grouped contiguous{label}]",
                              _cfg_label(tile, warps, stages), fp8_fp4.fp8_fp4_contiguous_kernel, pointers,
                              {"INTERPRETED": False, "A_FP32": a_fp32,
                               "A_UNSCALED": fp8_fp4.lhs_unscaled(capability, a_fp32), **tile},
                              tuple(pointers) + ("N", "K"), warps, stages, mma_rows=64, default=(i == 0)))
    from deep_gemm.kernels import cast

    for tile in ((1, 128), (128, 1), (128, 128)):
        consts = {"TILE_R": tile[0], "TILE_C": tile[1], "BLOCK_R": 32 if tile[0] == 1 else tile[0],
                  "BLOCK_C": 64 if tile[1] == 1 else tile[1], "AMAX_FLOOR": 1e-4, "UE8M0": False, "s_xc": 1,
                  "s_qc": 1}
        warps = cast.cast_warps(*tile)
        cases.append(Case(f"deep_gemm.cast[{tile[0]}x{tile[1]}]", f"w{warps}", cast._cast_kernel,
                          {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "sf_ptr": "*fp32"}, consts,
                          ("x_ptr", "q_ptr", "sf_ptr"), warps, 3, default=True))
    return cases


def decode_cases(capability: int = 90) -> list[Case]:
    from flash_mla.kernels import decode

    cases = []
    for fp8 in (False, True):
        kv = "*fp8e4nv" if fp8 else "*bf16"
        pointers = {"Q": "*bf16", "KN": kv, "KR": "*bf16", "KS": "*fp32" if fp8 else "*bf16", "BT": "*i32",
                    "META": "*i32", "OUT": "*bf16", "LSE": "*fp32", "OACC": "*fp32", "LACC": "*fp32"}
        # bench shapes: bf16 rows are 576 elements (16-divisible); FP8 rows 656 bytes (16-divisible), their
        # fp32-scale and bf16-rope views are not
        kv_strides = ("stride_kn_blk", "stride_kn_tok", "stride_kn_h") + (
            () if fp8 else ("stride_kr_blk", "stride_kr_tok", "stride_kr_h"))
        divisible = tuple(pointers) + kv_strides + ("stride_qb", "stride_qs", "stride_qh", "stride_ob", "stride_os",
                                                    "stride_oh", "stride_pa_slot", "stride_pa_h", "stride_pa_row")
        for causal, s_q in ((False, 1), (True, 2)):
            for i, cfg in enumerate(decode.decode_configs(fp8, capability)):
                meta = decode.config_kwargs(cfg)
                consts = {"CAUSAL": causal, "FP8": fp8, "D_NOPE": 512, "D_ROPE": 64, "PAGE": 64,
                          "PAGE_IDS": decode.PAGE_IDS, "UPCAST": False, **meta}
                if s_q == 1:
                    consts["s_q"] = 1
                cases.append(Case(f"flash_mla.decode[{'fp8' if fp8 else 'bf16'}{' causal' if causal else ''}]",
                                  _cfg_label(meta, cfg[-2], cfg[-1]), decode._decode_kernel, pointers, consts,
                                  divisible, cfg[-2], cfg[-1], mma_rows=meta["BLOCK_H"] // max(1, cfg[-2] // 4),
                                  default=(i == 0)))
    cases.append(Case("flash_mla.combine", "BLOCK_R=8 w4", decode._combine_kernel,
                      {"NSPLITS": "*i32", "OACC": "*fp32", "LACC": "*fp32", "OUT": "*bf16", "LSE": "*fp32"},
                      {"D_NOPE": 512, "BLOCK_R": 8, "INTERPRETED": False}, ("NSPLITS", "OACC", "LACC", "OUT", "LSE"),
                      4, 2, default=True))
    return cases


def attention_cases(capability: int = 90) -> list[Case]:
    from flash_mla.kernels import attention

    cases = []
    fwd_ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "CU": "*i32"}
    bwd_ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32",
                "CU": "*i32"}
    kernels = [("fwd", attention._fwd_kernel, attention.FWD_CONFIGS, {**fwd_ptrs}),
               ("bwd_dkdv", attention._bwd_dkdv_kernel, attention.DKDV_CONFIGS, {**bwd_ptrs, "DK": "*bf16",
                                                                                   "DV_": "*bf16"}),
               ("bwd_dq", attention._bwd_dq_kernel, attention.DQ_CONFIGS, {**bwd_ptrs, "DQ": "*bf16"})]
    for name, fn, lists, pointers in kernels:
        divisible = tuple(pointers) + tuple(n for n in fn.arg_names if n.startswith("stride_")) + ("H",)
        for causal in (True, False):
            for i, (bm, bn, w, s) in enumerate(autotune.for_capability(lists, capability)):
                consts = {**attention.static_args(192, 128, causal), "UPCAST": False, "BLOCK_M": bm, "BLOCK_N": bn}
                rows = bn if name == "bwd_dkdv" else bm
                cases.append(Case(f"flash_mla.attention.{name}[192/128{' causal' if causal else ''}]",
                                  f"BLOCK_M={bm} BLOCK_N={bn} w{w} s{s}", fn, pointers, consts, divisible, w, s,
                                  mma_rows=rows // max(1, w // 4), default=(i == 0 and causal)))
    # a power-of-two head dim has no second tile (DB = 0): that branch must compile away
    bm, bn, w, s = autotune.for_capability(attention.FWD_CONFIGS, capability)[0]
    cases.append(Case("flash_mla.attention.fwd[128/128 causal]", f"BLOCK_M={bm} BLOCK_N={bn} w{w} s{s}",
                      attention._fwd_kernel, fwd_ptrs,
                      {**attention.static_args(128, 128, True), "UPCAST": False, "BLOCK_M": bm, "BLOCK_N": bn},
                      tuple(fwd_ptrs) + tuple(n for n in attention._fwd_kernel.arg_names if n.startswith("stride_"))
                      + ("H",), w, s, mma_rows=bm // max(1, w // 4), default=True))
    cases.append(Case("flash_mla.attention.delta", "BLOCK_T=64 w4", attention._delta_kernel,
                      {"O": "*bf16", "DO": "*bf16", "DELTA": "*fp32"},
                      {"DV": 128, "BLOCK_DV": 128, "BLOCK_T": 64}, ("O", "DO", "DELTA", "stride_ot", "stride_dot"),
                      4, 2, default=True))
    return cases


def dsa_cases() -> list[Case]:
    """DeepSeek-V3.2 sparse attention (d_qk 576, d_v 512, top-k 2048, h_q 128) and the indexer logits (64 heads of
    128), specialised as the benchmarks launch them."""
    from deep_gemm.kernels import mqa_logits
    from flash_mla.kernels import sparse

    cases = []
    tiles = {**sparse.tile_args(576, 512), "UPCAST": False}
    fwd_ptrs = {"Q": "*bf16", "KV": "*bf16", "IDX": "*i32", "SINK": "*fp32", "OUT": "*bf16", "MAXL": "*fp32",
                "LSE": "*fp32"}
    fp8_ptrs = {"Q": "*bf16", "KN": "*fp8e4nv", "KS": "*fp32", "KR": "*bf16", "IDX": "*i32", "OUT": "*bf16",
                "MAXL": "*fp32", "LSE": "*fp32"}
    bwd_ptrs = {"Q": "*bf16", "KV": "*bf16", "IDX": "*i32", "SINK": "*fp32", "O": "*bf16", "DO": "*bf16",
                "LSE": "*fp32", "DQ": "*bf16", "DKV": "*fp32", "DSINK": "*fp32"}
    # DeepSeek-V4: one 512-wide K = V head (no RoPE columns apart), a sink logit per head
    v4 = {**sparse.tile_args(512, 512), "UPCAST": False, "HAS_SINK": True}
    tiles["HAS_SINK"] = False
    kernels = [("fwd[576/512]", sparse._sparse_fwd_kernel, sparse.FWD_CONFIGS, fwd_ptrs, tiles),
               ("decode[fp8]", sparse._sparse_decode_fp8_kernel, sparse.DECODE_FP8_CONFIGS, fp8_ptrs,
                {"UPCAST": False}),
               ("bwd[576/512]", sparse._sparse_bwd_kernel, sparse.BWD_CONFIGS, bwd_ptrs, tiles),
               ("fwd[512/512 sink]", sparse._sparse_fwd_kernel, sparse.FWD_CONFIGS, fwd_ptrs, v4),
               ("bwd[512/512 sink]", sparse._sparse_bwd_kernel, sparse.BWD_CONFIGS, bwd_ptrs, v4)]
    for name, fn, configs, pointers, consts in kernels:
        strides = [n for n in fn.arg_names if n.startswith("stride_")]
        unit = {"stride_sh": 1}  # lse / max_logits [s_q, h_q]: heads contiguous
        # 16-divisible as at the bench shapes, except the FP8 cache's fp32-scale and bf16-rope row strides (164, 328)
        divisible = tuple(pointers) + tuple(n for n in strides if n not in unit and n not in ("stride_ks", "stride_kr"))
        for i, (bh, bk, w, st) in enumerate(configs):
            meta = {"BLOCK_H": bh, "BLOCK_K": bk}
            cases.append(Case(f"flash_mla.sparse.{name}", _cfg_label(meta, w, st), fn, pointers,
                              {**consts, **unit, **meta}, divisible, w, st, mma_rows=bh // max(1, w // 4),
                              default=(i == 0)))
    logits_ptrs = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "KS": "*fp32", "W": "*fp32", "KSTART": "*i32", "KEND": "*i32",
                   "OUT": "*fp32"}
    heads, d = 64, 128
    consts = {"H": heads, "D": d, "BLOCK_Q": 128 // heads, "BLOCK_N": 128, "TILES": 4, "stride_wh": 1}
    cases.append(Case("deep_gemm.mqa_logits", "BLOCK_Q=2 BLOCK_N=128 TILES=4 w8 s1", mqa_logits._mqa_logits_kernel,
                      logits_ptrs, consts, tuple(logits_ptrs) + ("s_kv", "stride_qt", "stride_qh", "stride_k",
                                                                 "stride_wt", "stride_ot"), 8, 1, mma_rows=64,
                      default=True))
    paged_ptrs = {"Q": "*fp8e4nv", "KV": "*fp8e4nv", "KS": "*fp32", "W": "*fp32", "LENS": "*i32", "BT": "*i32",
                  "OUT": "*fp32"}
    consts = {"H": heads, "D": d, "NEXT_N": 1, "LENS_2D": False, "BLOCK_Q": 1, "PAGE": 64, "TILES": 4,
              "stride_wh": 1}
    cases.append(Case("deep_gemm.paged_mqa_logits", "BLOCK_Q=1 PAGE=64 TILES=4 w8 s1",
                      mqa_logits._paged_mqa_logits_kernel, paged_ptrs, consts,
                      tuple(paged_ptrs) + ("max_model_len", "stride_qt", "stride_qh", "stride_blk", "stride_tok",
                                           "stride_sblk", "stride_wt", "stride_bt", "stride_ot"), 8, 1, mma_rows=64,
                      default=True))
    return cases


def fused_cases() -> list[Case]:
    """fused_ops at V3's shapes (rows of 7168 / 2048 values, 64-dim rotary heads), launched as the wrappers do."""
    from fused_ops.kernels import norm, permute, rope, router, swiglu

    def case(name, fn, pointers, consts, warps=4):
        divisible = tuple(pointers) + tuple(n for n in fn.arg_names if n.startswith("stride_") or n in ("D", "I"))
        cfg = " ".join(f"{k}={v}" for k, v in consts.items() if k.startswith("BLOCK")) + f" w{warps}"
        return Case(f"fused_ops.{name}", cfg, fn, pointers, consts, divisible, warps, 1, default=True,
                    vector_loads=True)

    row = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "H": "*bf16", "RSTD": "*fp32"}
    fp8 = {"Q": "*fp8e4nv", "S": "*fp32"}
    block = norm.MAX_CHUNK
    gu = {"GU": "*bf16", "WT": "*fp32"}
    gather = {"ASSIGN": "*i64", "W": "*fp32", "OUTW": "*fp32"}
    return [
        case("rmsnorm[bf16 +residual]", norm._rmsnorm_kernel, row, {"HAS_RESIDUAL": True, "BLOCK": block},
             norm._warps(block)),
        case("rmsnorm_fp8[bf16 +residual]", norm._rmsnorm_fp8_kernel, {**row, **fp8},
             {"HAS_RESIDUAL": True, "BLOCK": block}, norm._warps(block)),
        case("rmsnorm_backward[bf16 +residual grad]", norm._rmsnorm_backward_kernel,
             {"H": "*bf16", "W": "*bf16", "RSTD": "*fp32", "DY": "*bf16", "DH": "*bf16", "DX": "*bf16", "DW": "*fp32"},
             {"HAS_DH": True, "BLOCK": block}, norm._warps(block)),
        case("swiglu[bf16 weighted]", swiglu._swiglu_kernel, {**gu, "OUT": "*bf16"},
             {"HAS_WEIGHTS": True, "BLOCK": swiglu.BLOCK}),
        case("swiglu_fp8[bf16 weighted]", swiglu._swiglu_fp8_kernel, {**gu, **fp8},
             {"HAS_WEIGHTS": True, "BLOCK": swiglu.BLOCK}),
        case("swiglu_backward[bf16 weighted]", swiglu._swiglu_backward_kernel,
             {**gu, "G": "*bf16", "DGU": "*bf16", "DWT": "*fp32"}, {"HAS_WEIGHTS": True, "BLOCK": swiglu.BLOCK}),
        case("rope[interleaved]", rope._rope_interleaved_kernel,
             {"X": "*bf16", "OUT": "*bf16", "COS": "*fp32", "SIN": "*fp32"}, {"HALF": 32, "BLOCK_H": rope.BLOCK_H}),
        case("rope[half-split]", rope._rope_half_kernel,
             {"X": "*bf16", "OUT": "*bf16", "COS": "*fp32", "SIN": "*fp32"}, {"HALF": 32, "BLOCK_H": rope.BLOCK_H}),
        case("permute_gather[fp8 +scales +weights]", permute._gather_kernel,
             {**gather, "X": "*fp8e4nv", "XS": "*fp32", "OUT": "*fp8e4nv", "OUTS": "*fp32"},
             {"HAS_SCALES": True, "HAS_WEIGHTS": True, "BLOCK": permute.CHUNK_BYTES, "BLOCK_S": 64}),
        case("permute_gather_fp8[bf16 +weights]", permute._gather_fp8_kernel, {**gather, "X": "*bf16", **fp8},
             {"HAS_WEIGHTS": True, "BLOCK": permute.CHUNK_BYTES // 2}),
        case("gather_rows[bf16 +2 columns]", permute._gather_rows_kernel,
             {"ASSIGN": "*i64", "X": "*bf16", "C": "*bf16", "OUT": "*bf16"},
             {"HAS_COLUMNS": True, "BLOCK": permute.CHUNK_BYTES // 2, "BLOCK_C": 2}),
        case("gather_dequant_fp8[bf16 +weights]", permute._gather_dequant_fp8_kernel,
             {**gather, "Q": "*fp8e4nv", "S": "*fp32", "X": "*bf16", "Q2": "*fp8e4nv", "S2": "*fp32"},
             {"HAS_WEIGHTS": True, "BLOCK": permute.CHUNK_BYTES}),
        case("unpermute_sum[bf16]", permute._sum_rows_kernel, {"ROWS": "*i64", "Y": "*bf16", "W": "*fp32",
                                                              "OUT": "*bf16"},
             {"HAS_WEIGHTS": False, "BLOCK": permute.CHUNK_BYTES // 2}),
        case("unpermute_spread[bf16]", permute._spread_kernel, {"ASSIGN": "*i64", "G": "*bf16", "Y": "*bf16",
                                                               "W": "*fp32", "DY": "*bf16", "DW": "*fp32"},
             {"BLOCK": permute.CHUNK_BYTES // 2}),
        case("route[256 experts, 8 groups]", router._route_kernel,
             {"LOGITS": "*fp32", "BIAS": "*fp32", "WEIGHTS": "*fp32", "INDICES": "*i64", "SCORES": "*fp32"},
             {"GROUPS": 8, "PER_GROUP": 32, "TOPK_GROUPS": 4, "TOPK": 8, "NORM": True, "NODES": 1, "MAX_NODES": 1,
              "NODE_BEST": 1, "BLOCK_G": 8, "BLOCK_E": 32, "BLOCK_K": 8, "BLOCK_N": 1},
             router.WARPS),
        case("route[256 experts, 8 groups, 4 of 8 nodes]", router._route_kernel,
             {"LOGITS": "*fp32", "BIAS": "*fp32", "WEIGHTS": "*fp32", "INDICES": "*i64", "SCORES": "*fp32"},
             {"GROUPS": 8, "PER_GROUP": 32, "TOPK_GROUPS": 4, "TOPK": 8, "NORM": True, "NODES": 8, "MAX_NODES": 4,
              "NODE_BEST": 2, "BLOCK_G": 8, "BLOCK_E": 32, "BLOCK_K": 8, "BLOCK_N": 8},
             router.WARPS),
        case("route_backward[256 experts]", router._route_backward_kernel,
             {"SCORES": "*fp32", "INDICES": "*i64", "GW": "*fp32", "GS": "*fp32", "DL": "*fp32"},
             {"HAS_GS": True, "TOPK": 8, "NORM": True, "BLOCK": 256, "BLOCK_K": 8}, router.WARPS),
        case("route_softmax[160 experts, 8 groups]", router._route_softmax_kernel,
             {"LOGITS": "*fp32", "WEIGHTS": "*fp32", "INDICES": "*i64", "SCORES": "*fp32"},
             {"GROUPS": 8, "PER_GROUP": 20, "TOPK_GROUPS": 3, "TOPK": 6, "NORM": False, "NODES": 1, "MAX_NODES": 1,
              "NODE_BEST": 1, "BLOCK_G": 8, "BLOCK_E": 32, "BLOCK_K": 8, "BLOCK_N": 1},
             router.WARPS),
        case("route_softmax_backward[160 experts]", router._route_softmax_backward_kernel,
             {"SCORES": "*fp32", "INDICES": "*i64", "GW": "*fp32", "GS": "*fp32", "DL": "*fp32"},
             {"HAS_GS": True, "TOPK": 6, "NORM": False, "BLOCK": 256, "BLOCK_K": 8}, router.WARPS),
    ]


def v4_cases() -> list[Case]:
    """DeepSeek-V4's fused ops and FP8-cache decode at V4-Flash's shapes: mHC's 4 x 4 Sinkhorn, the CSA (ratio 4,
    overlapping) and HCA (ratio 128) gated pools over bf16 projections with an fp32 position bias, the indexer's
    logits (64 heads of 128, bf16) and its two backward kernels, the sparse decode over the 584-byte cache."""
    import triton.language as tl

    from flash_mla.kernels import v4_decode
    from fused_ops.kernels import gated_pool, indexer_logits, sinkhorn

    def case(name, fn, pointers, consts, warps=4, sizes=(), mma_rows=0):
        divisible = tuple(pointers) + tuple(n for n in fn.arg_names if n.startswith("stride_") or n in sizes)
        cfg = " ".join(f"{k}={v}" for k, v in consts.items() if k.startswith(("BLOCK", "M", "HC"))) + f" w{warps}"
        return Case(name, cfg, fn, pointers, consts, divisible, warps, 1, mma_rows=mma_rows, default=True,
                    vector_loads=not mma_rows)  # the memory-bound ones (no dots) must load 128 bits at a time

    hc = {"HC": 4, "BLOCK": sinkhorn.BLOCK}
    pool = {"KV": "*bf16", "S": "*bf16", "APE": "*fp32"}
    csa = {"M": 4, "W": 8, "OVERLAP": True, "SUM_DTYPE": tl.float32, "BLOCK_D": gated_pool.BLOCK_D}
    hca = {"M": 128, "W": 128, "OVERLAP": False, "SUM_DTYPE": tl.float32, "BLOCK_D": gated_pool.BLOCK_D}
    index = {"Q": "*bf16", "K": "*bf16", "WT": "*fp32"}
    tiles = {"BLOCK_T": indexer_logits.BLOCK_T, "BLOCK_N": indexer_logits.BLOCK_N, "BLOCK_D": 128, "UPCAST": False}
    decode = {"Q": "*bf16", "KN": "*fp8e4nv", "KR": "*bf16", "KS": "*u8", "IDX": "*i32", "SINK": "*fp32",
              "OUT": "*bf16", "LSE": "*fp32"}
    return [
        case("fused_ops.sinkhorn[4x4, 20 iterations]", sinkhorn._sinkhorn_kernel, {"Z": "*fp32", "OUT": "*fp32"}, hc),
        case("fused_ops.sinkhorn_backward[4x4, 20 iterations]", sinkhorn._sinkhorn_backward_kernel,
             {"Z": "*fp32", "DY": "*fp32", "DZ": "*fp32"}, hc),
        case("fused_ops.gated_pool[CSA bf16 d512]", gated_pool._gated_pool_kernel, {**pool, "OUT": "*bf16"}, csa, 1,
             ("CD", "D")),
        case("fused_ops.gated_pool_backward[CSA bf16 d512]", gated_pool._gated_pool_backward_kernel,
             {**pool, "DOUT": "*bf16", "DKV": "*bf16", "DS": "*bf16"}, csa, 1, ("CD", "D")),
        case("fused_ops.gated_pool[HCA bf16 d512]", gated_pool._gated_pool_kernel, {**pool, "OUT": "*bf16"}, hca, 4,
             ("CD", "D")),
        case("fused_ops.gated_pool_backward[HCA bf16 d512]", gated_pool._gated_pool_backward_kernel,
             {**pool, "DOUT": "*bf16", "DKV": "*bf16", "DS": "*bf16"}, hca, 4, ("CD", "D")),
        case("fused_ops.indexer_logits[64x128 bf16]", indexer_logits._indexer_logits_kernel, {**index, "OUT": "*fp32"},
             tiles, 4, ("N", "H", "D"), tiles["BLOCK_T"]),
        case("fused_ops.indexer_logits_backward.dq[64x128 bf16]", indexer_logits._dq_kernel,
             {**index, "DI": "*fp32", "DQ": "*bf16", "DWT": "*fp32"}, tiles, 4, ("N", "H", "D"), tiles["BLOCK_T"]),
        case("fused_ops.indexer_logits_backward.dk[64x128 bf16]", indexer_logits._dk_kernel,
             {**index, "DI": "*fp32", "DK": "*bf16"}, tiles, 4, ("N", "H", "D"), indexer_logits.BLOCK_N),
        case("flash_mla.sparse_sink_decode[V4 fp8 584 B]", v4_decode._v4_decode_kernel, decode,
             {"D_NOPE": 448, "ROPE_AT": 448, "SCALES_AT": 576, "UPCAST": False, "BLOCK_H": v4_decode.BLOCK_H,
              "BLOCK_K": v4_decode.BLOCK_K}, 8, (), v4_decode.BLOCK_H // 2),
    ]


def all_cases(capability: int = 90) -> list[Case]:
    return (gemm_cases(capability) + decode_cases(capability) + attention_cases(capability) + dsa_cases()
            + fused_cases() + v4_cases())


def _compile_one(index: int, capability: int = 90) -> dict:
    case = all_cases(capability)[index]
    row = {"kernel": case.kernel, "config": case.config, "capability": capability, "mma_rows": case.mma_rows,
           "needs_vector_loads": case.vector_loads}
    try:
        compiled = aot.compile_for(case.fn, case.pointers, case.constexprs, case.divisible, case.num_warps,
                                   case.num_stages, capability=capability)
        row.update(aot.kernel_stats(compiled).as_dict())
    except Exception as exc:  # a config that does not compile is a gate failure, reported as such
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def gate_failures(row: dict) -> list[str]:
    """Why a compiled case fails the gates (empty: it passes)."""
    if "error" in row:
        return [f"does not compile: {row['error']}"]
    bad = []
    if row["stack_bytes"] or row["spill_stores"]:
        bad.append(f"spills ({row['stack_bytes']} B stack, {row['spill_stores']} STL)")
    limit = aot.SMEM_PER_BLOCK[row.get("capability", 90)]
    if row["smem_bytes"] > limit:
        bad.append(f"{row['smem_bytes']} B shared memory > {limit}")
    if row["mma_rows"] >= 64 and not row["tensor_core_mma"]:
        mma = "tcgen05" if row.get("capability", 90) >= 100 else "wgmma"
        bad.append(f"no {mma} although the tile has >= 64 rows per warp group")
    if row.get("needs_vector_loads") and not row["vector_loads"]:
        bad.append("no 128-bit global loads in a memory-bound kernel")
    return bad


def compile_table(subset: str = "all", jobs: int = 2, match: str = "", capability: int = 90) -> list[dict]:
    """Compile the cases for ``capability`` (in ``jobs`` processes) and return one row per case, in case order;
    ``match``: only kernels whose name contains it."""
    cases = all_cases(capability)
    picked = [i for i, c in enumerate(cases) if (subset == "all" or c.default) and match in c.kernel]
    if jobs <= 1:
        return [_compile_one(i, capability) for i in picked]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, picked, [capability] * len(picked)))


COLUMNS = ("kernel", "config", "registers", "stack_bytes", "smem_bytes", "loop_instructions", "loop_global_loads",
           "loop_mmas", "tensor_core_mma", "tmem_loads", "tma", "vector_loads", "gate")


def markdown(rows: list[dict], title: str, capability: int = 90) -> str:
    import torch
    import triton

    mma = "tcgen05 (UTC*MMA)" if capability >= 100 else "wgmma (HGMMA/QGMMA)"
    lines = [f"## {title}", "",
             f"{datetime.date.today().isoformat()}, Triton {triton.__version__}, torch {torch.__version__}, target "
             f"cuda sm_{capability}a (compiled offline on a CPU: no GPU involved). tensor_core_mma = {mma} in the "
             "SASS; tmem_loads = LDTM (tensor memory read into registers); loop_* = one iteration of the innermost "
             "MMA loop in the SASS; vector_loads = 128-bit global loads (LDG.E.128); gate = no spills, shared memory "
             f"<= {aot.SMEM_PER_BLOCK[capability] // 1024} KB, the tensor-core MMA where the tile allows, 128-bit "
             "loads in the memory-bound (fused_ops) kernels.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [str(r.get(c, "")) for c in COLUMNS[:-1]]
        cells.append("; ".join(gate_failures(r)) or "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m recipes.kernels_compiled", description=__doc__.split("\n\n")[0])
    p.add_argument("--subset", choices=("all", "default"), default="all",
                   help="every autotune config, or only each kernel's default one")
    p.add_argument("--jobs", type=positive_int, default=min(4, os.cpu_count() or 1), help="compiler processes")
    p.add_argument("--match", default="", help="only kernels whose name contains this (e.g. flash_mla.decode)")
    p.add_argument("--capability", type=int, default=90,
                   help="CUDA compute capability to compile for: 90 (sm_90a, Hopper) or 100 (sm_100a, Blackwell)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--write", metavar="MD", help="replace this Markdown file's table for this Triton version")
    args = p.parse_args(argv)
    # before any kernel module is imported (all_cases): @triton.jit decides interpreter-or-compiler at import
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        try:
            aot.check_capability(args.capability)
        except ValueError as exc:
            raise ValueError(f"--capability: {exc}") from None
        for option, path in (("--json", args.json), ("--write", args.write)):
            if path:
                check_output_file(path, option)
        kernels = sorted({c.kernel for c in all_cases(args.capability)})
        if not any(args.match in k for k in kernels):
            raise ValueError(f"--match {args.match!r}: no kernel name contains it; kernels: {', '.join(kernels)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    rows = compile_table(args.subset, args.jobs, args.match, args.capability)
    import triton

    title = f"Triton {triton.__version__}, sm_{args.capability}a"
    text = markdown(rows, title, args.capability)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write:
        _write_section(Path(args.write), title, text)
    failing = [r for r in rows if gate_failures(r)]
    for r in failing:
        print(f"GATE FAIL {r['kernel']} {r['config']}: {'; '.join(gate_failures(r))}", file=sys.stderr)
    return 1 if failing else 0


def _write_section(path: Path, title: str, text: str) -> None:
    """Replace the ``## title`` section of ``path`` (or append it), keeping the other versions' tables."""
    old = path.read_text() if path.exists() else "# Kernels compiled for sm_90a and sm_100a\n\n"
    head = f"## {title}"
    if head in old:
        before, rest = old.split(head, 1)
        after = rest[rest.find("\n## "):] if "\n## " in rest else ""
        old = before + text + after.lstrip("\n")
        path.write_text(old if old.endswith("\n") else old + "\n")
    else:
        path.write_text(old.rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    raise SystemExit(main())
