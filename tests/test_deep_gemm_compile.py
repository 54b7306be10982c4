"""The GEMM kernel compiles for Hopper (sm_90) without a GPU, with tensor cores and pipelined loads.

The CPU interpreter proves the arithmetic but not that the kernel compiles, nor that it is fast:
here Triton's own compiler and the bundled ptxas build every mode with the largest autotune tiles
and the argument specialisation the JIT would see (unit strides as constants, 16-divisible sizes),
and the TTGIR must contain warp-group MMAs (wgmma) and asynchronous global->shared copies; the three
cast kernels must compile too. Skipped when this Triton build cannot target CUDA offline.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from deep_gemm.kernels import gemm as kernels  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older or newer Triton layouts
    GPUTarget = ASTSource = None

POINTERS = ("a_ptr", "b_ptr", "d_ptr", "sfa_ptr", "sfb_ptr", "grp_ptr")


def _compile(mode: int, fp8: bool, block_m: int, block_n: int, num_warps: int, num_stages: int, flat: bool = False,
             split_k: int = 1):
    jit = (kernels._fp8_kernel if fp8 else kernels._bf16_kernel).fn
    names = jit.arg_names
    elem = "*fp8e4nv" if fp8 else "*bf16"
    fp32_out = mode == kernels.K_GROUPED or split_k > 1
    ptr_types = {"a_ptr": elem, "b_ptr": elem, "d_ptr": "*fp32" if fp32_out else "*bf16",
                 "sfa_ptr": "*fp32", "sfb_ptr": "*fp32", "grp_ptr": "*i32"}
    consts = {"MODE": mode, "FP8": fp8, "SFB_GRAN_N": 1 if mode == kernels.K_GROUPED else 128,
              "ACCUMULATE": mode == kernels.K_GROUPED, "FLAT_K_MAJOR": flat, "SPLIT_K": split_k,
              "INTERPRETED": False, "BLOCK_M": block_m,
              "BLOCK_N": block_n, "BLOCK_K": 128 if fp8 else 64, "GROUP_M": 8}
    # What launch() passes on a GPU: FP8 operands K-major (copied if needed); bf16 k-grouped stays MN-major.
    mn_major = mode == kernels.K_GROUPED and not fp8
    unit = ("s_am", "s_bn", "s_dn") if mn_major else ("s_ak", "s_bk", "s_dn")
    consts.update({n: 1 for n in unit})
    signature = {n: "constexpr" if n in consts else ptr_types.get(n, "i32") for n in names}
    divisible = [n for n in names if n not in consts and (n in POINTERS or n.startswith("s_") or n in ("N", "K"))]
    src = ASTSource(fn=jit, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


CASES = [(kernels.DENSE, True, False, 1), (kernels.DENSE, True, False, 4), (kernels.CONTIGUOUS, True, False, 1),
         (kernels.MASKED, True, False, 1), (kernels.K_GROUPED, True, False, 1), (kernels.K_GROUPED, True, True, 1),
         (kernels.DENSE, False, False, 1), (kernels.K_GROUPED, False, False, 1)]  # (mode, fp8, flat, split_k)


def _compile_cast(tile_r: int, tile_c: int):
    from deep_gemm.kernels import cast

    jit = cast._cast_kernel
    names = jit.arg_names
    consts = {"TILE_R": tile_r, "TILE_C": tile_c, "BLOCK_R": 32 if tile_r == 1 else tile_r,
              "BLOCK_C": 64 if tile_c == 1 else tile_c, "AMAX_FLOOR": 1e-4, "UE8M0": False, "s_xc": 1, "s_qc": 1}
    ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "sf_ptr": "*fp32"}
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn=jit, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_all() -> dict:
    """Compile every case with the largest tiles; return what the test checks (runs without the interpreter)."""
    out = {}
    for tile in ((1, 128), (128, 1), (128, 128)):  # the three casts: they must compile too
        _compile_cast(*tile)
    for mode, fp8, flat, split_k in CASES:
        compiled = _compile(mode, fp8, block_m=128, block_n=256, num_warps=8, num_stages=3, flat=flat, split_k=split_k)
        ttgir = compiled.asm["ttgir"]
        out[f"mode={mode},fp8={fp8},flat={flat},split_k={split_k}"] = {"wgmma": "warp_group_dot" in ttgir,
                                         "pipelined": bool(re.search(r"async_copy_global_to_local", ttgir)),
                                         "shared": compiled.metadata.shared}
    return out


@pytest.mark.skipif(GPUTarget is None, reason="this Triton has no offline compile API")
@pytest.mark.slow  # ~20 s of CPU: eleven full Triton -> PTX -> cubin compiles
@pytest.mark.timeout(300)
def test_kernel_compiles_for_sm90_with_wgmma_and_pipelined_loads():
    # @triton.jit decided interpreter-or-compiler at import, so compile in a process without TRITON_INTERPRET.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.test_deep_gemm_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=280)
    if proc.returncode != 0:
        if "ptxas" in proc.stderr or "CUDA" in proc.stderr and "backend" in proc.stderr:
            pytest.skip(f"cannot compile for CUDA offline here: {proc.stderr[-300:]}")
        raise AssertionError(proc.stderr[-3000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    for case, r in results.items():
        assert r["wgmma"], f"{case}: no Hopper tensor-core MMA"
        assert r["pipelined"], f"{case}: global loads are not pipelined"
        assert r["shared"] <= 227 * 1024, f"{case}: {r['shared']} B shared memory exceeds an H100/H200 block"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
