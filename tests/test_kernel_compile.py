"""Compile-time quality gates: the deep_gemm, flash_mla and fused_ops kernels, built on a CPU (no GPU) for sm_90a
(Hopper) and sm_100a (Blackwell).

``recipes.kernels_compiled`` compiles each kernel as the JIT would specialise it at the benchmark
shapes and reads the cubin back (``accel.aot``). Every case must pass the gates (``GATES``): no register
spills (stack bytes / STL), shared memory within a block of the target (227 KB on both), the target's
tensor-core MMA (Hopper's wgmma, Blackwell's tcgen05) wherever the tile has >= 64 rows per warp group,
asynchronous (pipelined) GEMM loads, and 128-bit global loads (LDG.E.128) in the memory-bound fused_ops
kernels. The FP8 GEMM main loop must keep the gains of the scalar-scale / 64-bit-base rewrite (``LEAN_LOOP``;
before it, at 128x128x128 on 8 warps for sm_90a: 247 registers, 323 SASS instructions and 42 global loads
per K block, Triton 3.9).

Default run: each kernel variant at its first autotune config for each target (the one correctness runs use
with autotuning off; ~40 compiles per target over 2 processes, 14 of them the small fused_ops kernels).
``DSV3_FULL_COMPILE=1`` compiles every config of every kernel, the set ``python -m recipes.kernels_compiled
--capability C --write benchmarks/kernels_compiled.md`` tabulates. Skipped when this Triton cannot compile for
CUDA offline.
New kernels: add their table names to ``KERNELS`` (and a row to ``GATES`` for a new kind of check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deep_gemm.kernels import fp8_fp4

REPO = Path(__file__).resolve().parents[1]
FULL = os.environ.get("DSV3_FULL_COMPILE") == "1"
CAPABILITIES = (90, 100)  # sm_90a (H100 / H200 / H800), sm_100a (B200 / GB200)
KERNELS = {  # every kernel variant each table must hold
    "deep_gemm.gemm[fp8 dense]", "deep_gemm.gemm[fp8 dense split-k]", "deep_gemm.gemm[fp8 dense wgrad]",
    "deep_gemm.gemm[fp8 m-grouped contiguous]",
    "deep_gemm.gemm[fp8 masked]", "deep_gemm.gemm[fp8 k-grouped]", "deep_gemm.gemm[fp8 k-grouped flat]",
    "deep_gemm.gemm[mxfp8 dense]", "deep_gemm.gemm[mxfp8 m-grouped contiguous]", "deep_gemm.gemm[mxfp8 k-grouped]",
    "deep_gemm.gemm[fp8 x mxfp4 m-grouped contiguous]",
    "deep_gemm.gemm[fp8 x mxfp4 m-grouped contiguous, 1x128 fp32 rows]",
    "deep_gemm.gemm[bf16 dense]", "deep_gemm.gemm[bf16 k-grouped]", "deep_gemm.cast[1x128]", "deep_gemm.cast[128x1]",
    "deep_gemm.cast[128x128]", "flash_mla.decode[bf16]", "flash_mla.decode[bf16 causal]", "flash_mla.decode[fp8]",
    "flash_mla.decode[fp8 causal]", "flash_mla.combine", "flash_mla.attention.fwd[192/128 causal]",
    "flash_mla.attention.bwd_dkdv[192/128 causal]", "flash_mla.attention.bwd_dq[192/128 causal]",
    "flash_mla.attention.delta",
    "flash_mla.sparse.fwd[576/512]", "flash_mla.sparse.decode[fp8]", "flash_mla.sparse.bwd[576/512]",
    "flash_mla.sparse.fwd[512/512 sink]", "flash_mla.sparse.bwd[512/512 sink]",
    "deep_gemm.mqa_logits", "deep_gemm.paged_mqa_logits",
    "fused_ops.rmsnorm[bf16 +residual]", "fused_ops.rmsnorm_fp8[bf16 +residual]",
    "fused_ops.rmsnorm_backward[bf16 +residual grad]", "fused_ops.swiglu[bf16 weighted]",
    "fused_ops.swiglu_fp8[bf16 weighted]", "fused_ops.swiglu_backward[bf16 weighted]", "fused_ops.rope[interleaved]",
    "fused_ops.rope[half-split]", "fused_ops.permute_gather[fp8 +scales +weights]",
    "fused_ops.permute_gather_fp8[bf16 +weights]", "fused_ops.unpermute_sum[bf16]", "fused_ops.unpermute_spread[bf16]",
    "fused_ops.route[256 experts, 8 groups]", "fused_ops.route_backward[256 experts]",
    "fused_ops.route[256 experts, 8 groups, 4 of 8 nodes]", "fused_ops.gather_rows[bf16 +2 columns]",
    "fused_ops.gather_dequant_fp8[bf16 +weights]", "fused_ops.route_softmax[160 experts, 8 groups]",
    "fused_ops.route_softmax_backward[160 experts]",
}
SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90 and sm_100 (CUDA programming guide)
# (what fails, which rows it applies to, the failing test on a row)
GATES = [
    ("spills", lambda r: True, lambda r: r["stack_bytes"] or r["spill_stores"]),
    ("shared memory > 227 KB", lambda r: True, lambda r: r["smem_bytes"] > SMEM_LIMIT),
    ("no tensor-core MMA (wgmma / tcgen05)", lambda r: r["mma_rows"] >= 64, lambda r: not r["tensor_core_mma"]),
    ("sm_100a MMA is not tcgen05", lambda r: r["capability"] == 100 and r["mma_rows"] >= 64,
     lambda r: not r["tcgen05"]),
    ("GEMM loads not pipelined", lambda r: r["kernel"].startswith("deep_gemm.gemm"), lambda r: not r["async_copies"]),
    ("memory-bound kernel without 128-bit loads", lambda r: r["kernel"].startswith("fused_ops."),
     lambda r: not r["vector_loads"]),
]
# Known gate failures (none at present), each with why and where the fix belongs: (capability, Triton "major.minor",
# kernel, config or "*") -> reason. Their rows make the test xfail (reported, never silently passed); any other
# failure fails it.
KNOWN_FAILURES: dict[tuple[int, str, str, str], str] = {}
# The FP8 dense GEMM at 128x128x128, 8 warps (Triton 3.9 / 3.6). sm_90a: 175 / 184 registers, 170-172 SASS
# instructions and 11 global loads (8 tile copies, A's scales, one B scale) per K block; the bounds leave ~15%
# for compiler drift and fail on a return of per-element addressing (247 registers, 323 instructions, 42 loads).
# sm_100a (Triton 3.9): 162 registers, 151 instructions, 10 loads, the tcgen05 product read back by LDTM.
LEAN_LOOP = {"registers": 200, "loop_instructions": 240, "loop_global_loads": 16}


# both targets' compiles (tens of seconds on 2 cores) are in `make test`, not `make test-fast`
@pytest.fixture(scope="module", params=[pytest.param(c, marks=[pytest.mark.slow]) for c in CAPABILITIES],
                ids=[f"sm_{c}a" for c in CAPABILITIES])
def table(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compile") / "rows.json"
    # The recipe clears TRITON_INTERPRET before importing the kernels: run it in its own process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "recipes.kernels_compiled", "--subset", "all" if FULL else "default",
                           "--capability", str(request.param), "--jobs", "2", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500 if FULL else 600)
    if not out.exists():
        if "ptxas" in proc.stderr or "cuobjdump" in proc.stderr:
            pytest.skip(f"cannot compile for CUDA offline here: {proc.stderr[-300:]}")
        raise AssertionError(proc.stderr[-3000:])
    rows = json.loads(out.read_text())
    errors = [r.get("error", "") for r in rows]
    if all(("ptxas" in e or "cuobjdump" in e or "not bundled" in e) for e in errors):
        pytest.skip(f"cannot compile for CUDA offline here: {errors[0]}")
    return rows


def _known(row: dict) -> str | None:
    import triton

    version = ".".join(triton.__version__.split(".")[:2])
    for config in (row["config"], "*"):
        reason = KNOWN_FAILURES.get((row["capability"], version, row["kernel"], config))
        if reason:
            return reason
    return None


@pytest.mark.timeout(1600 if FULL else 660)
def test_every_kernel_passes_the_gates(table):
    assert {r["kernel"] for r in table} >= KERNELS
    failures, known = [], []
    for r in table:
        bad = [f"does not compile: {r['error']}"] if "error" in r else [
            name for name, applies, fails in GATES if applies(r) and fails(r)]
        if bad:
            line = f"sm_{r['capability']}a {r['kernel']} {r['config']}: {'; '.join(bad)}"
            (known if _known(r) else failures).append(line + (f" (known: {_known(r)})" if _known(r) else ""))
    assert not failures, "\n".join(failures)
    if known:
        pytest.xfail("known gate failures:\n" + "\n".join(known))


@pytest.mark.timeout(1600 if FULL else 660)
def test_fp8_gemm_main_loop_stays_lean(table):
    row = next(r for r in table if r["kernel"] == "deep_gemm.gemm[fp8 dense]" and r["config"].startswith(
        "BLOCK_M=128 BLOCK_N=128 BLOCK_K=128"))
    assert row["loop_mmas"] >= 1  # the loop found is the MMA loop
    assert all(row[key] <= bound for key, bound in LEAN_LOOP.items()), row


@pytest.mark.timeout(1600 if FULL else 660)
def test_json_rows_carry_what_the_issue_asks(table):
    assert all({"kernel", "config", "stack_bytes", "smem_bytes", "tensor_core_mma"} <= set(r) for r in table)
    mx = [r for r in table if r["kernel"].startswith("deep_gemm.gemm[mxfp8")]
    assert mx and all(r["config"].startswith("BLOCK_M=128 ") for r in mx)  # gemm.tile_fits: 128 rows only
    if table[0]["capability"] == 100:  # MXFP8's scales applied by tcgen05's block-scaled MMA; Hopper emulates it
        assert all(r["tcgen05"] and r["block_scaled_mma"] for r in mx), mx
    # (both row-scale kinds: MXFP8's bytes per 1x32, blockwise fp32 per 1x128 applied after each step's MMA)
    fp4 = [r for r in table if r["kernel"].startswith("deep_gemm.gemm[fp8 x mxfp4 m-grouped contiguous")]
    # FP8 x MXFP4: tcgen05's block-scaled MMA on sm_100a; on sm_90a the dequantising path (upcast, then wgmma); the
    # fp32-rows kernel upcasts on sm_100a too where this Triton cannot compile its unit-scale tensor (lhs_unscaled)
    scaled = {r["kernel"]: r["capability"] == 100 and not fp8_fp4.lhs_unscaled(100, "fp32 rows" in r["kernel"])
              for r in fp4}
    assert fp4 and all(r["block_scaled_mma"] == scaled[r["kernel"]] and r["tensor_core_mma"] for r in fp4), fp4


def test_unknown_capability_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "recipes.kernels_compiled", "--capability", "80"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --capability: capability must be one of 90, 100")
