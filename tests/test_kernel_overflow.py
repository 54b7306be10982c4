"""Kernels address tensors past 2^31 elements correctly: 64-bit page / token offsets, proven without a GPU.

Each case runs the Triton kernel in the CPU interpreter on a view whose element offsets pass 2^31:
a paged decode cache of ~58K pages (bf16) / ~51K pages (FP8, 656 bytes per token) with the sequence's
pages at the far end, attention inputs whose token stride puts rows past 2^31, and a GEMM operand
with such a row stride. The big tensors are ``torch.empty`` (virtual memory: only the pages written
are ever committed, a few MB). A 32-bit offset wraps negative there, so the interpreter reads outside
the tensor (a segfault, or garbage); the result must instead equal the reference computed on a compact
copy of the same data. The cases run in a child process, so a wrapped address fails the tests, not pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
INT32_LIMIT = 2**31


def _decode_case(fp8: bool) -> dict:
    import flash_mla
    from flash_mla.decode import compare_decode, flash_mla_with_kvcache_reference, make_paged_case
    from flash_mla.kernels.decode import flash_mla_decode_triton
    from flash_mla.metadata import BLOCK_SIZE
    from verifier.verify import calc_diff

    g = torch.Generator().manual_seed(5)
    seqlens = [150, 40]
    q, small, table, lens = make_paged_case(2, 1, 16, 1, seqlens, fp8, g, "cpu")
    meta, splits = flash_mla.get_mla_metadata(lens, 16, 1)
    raw = small.view(torch.uint8) if fp8 else small
    # the first page whose latent offset (page * 64 tokens * row elements) passes 2^31
    far = INT32_LIMIT // (BLOCK_SIZE * raw.shape[-1]) + 1
    big = torch.empty((far + raw.shape[0],) + raw.shape[1:], dtype=raw.dtype)  # ~4 GB virtual
    big[far:] = raw
    cache = big.view(torch.float8_e4m3fn) if fp8 else big
    out, lse = flash_mla_decode_triton(q, cache, table + far, lens, 512, meta, splits, None, False, fp8)
    want = flash_mla_with_kvcache_reference(q, small, table, lens, 512, meta, splits, causal=False,
                                            is_fp8_kvcache=fp8)
    errors = compare_decode((out, lse), want)
    return {"max_offset": int(table.max() + far) * BLOCK_SIZE * raw.shape[-1], "out": errors["out"][0],
            "lse": errors["lse"][0], "cos": calc_diff(out.double(), want[0].double())}


def _attention_case() -> dict:
    import flash_mla
    from accel import registry
    from flash_mla.attention import mla_attention_reference
    from verifier.verify import calc_diff

    g = torch.Generator().manual_seed(7)
    lens, dqk, dv, stride = [34, 6], 48, 32, 2**26  # rows from 33 on (and the 2nd sequence's start) pass 2^31
    total = sum(lens)
    storage = torch.empty(total * stride, dtype=torch.bfloat16)  # ~5 GB virtual: q, k, v share each row
    views = []
    for offset, d in ((0, dqk), (dqk, dqk), (2 * dqk, dv)):
        t = storage.as_strided((total, 1, d), (stride, d, 1), offset)
        t.copy_(torch.randn(total, 1, d, generator=g))
        views.append(t)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    dout = torch.randn(total, 1, dv, generator=g).to(torch.bfloat16)

    def run(fn, q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v, True, None, cu, max(lens))
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    def triton(q, k, v, causal, scale, cu, max_seqlen):
        return flash_mla.mla_attention(q, k, v, causal, scale, cu_seqlens=cu, max_seqlen=max_seqlen)

    with registry.force("triton"):  # forward and backward kernels (the backward runs on this thread)
        got = run(triton, *views)
    want = run(mla_attention_reference, *(t.contiguous() for t in views))
    return {"max_offset": (total - 1) * stride, **{name: calc_diff(a.double(), b.double())
                                                   for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}}


def _gemm_case() -> dict:
    from deep_gemm.kernels import gemm
    from deep_gemm.reference import cast_tiles, fp8_gemm_nt_reference
    from verifier.verify import calc_diff

    g = torch.Generator().manual_seed(9)
    m, n, k, stride = 32, 128, 256, 2**27  # A's rows from 16 on pass 2^31 (1-byte elements)
    a_f = torch.randn(m, k, generator=g)
    b_f = torch.randn(n, k, generator=g)
    a_q, sfa = cast_tiles(a_f, 1, 128)
    b_q, sfb = cast_tiles(b_f, 128, 128)
    storage = torch.empty(m * stride, dtype=torch.uint8)  # 4 GB virtual
    a_big = storage.as_strided((m, k), (stride, 1)).view(torch.float8_e4m3fn)
    a_big.copy_(a_q)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    gemm.gemm_nt((a_big, sfa), (b_q, sfb), d)
    want = torch.empty(m, n, dtype=torch.bfloat16)
    fp8_gemm_nt_reference((a_q, sfa), (b_q, sfb), want)
    return {"max_offset": (m - 1) * stride, "d": calc_diff(d.double(), want.double())}


CASES = {"decode_bf16": lambda: _decode_case(False), "decode_fp8": lambda: _decode_case(True),
         "attention": _attention_case, "gemm_fp8": _gemm_case}
# decode: FlashMLA's pass mark (cos diff and lse relative error < 1e-5); attention: bf16 outputs and
# gradients, as tests/test_flash_mla_attention.py (5e-5); GEMM: the same fp8 inputs and scales as the
# reference, fp32 accumulation in another order, bf16 output (< 1e-5).
TOLERANCE = {"decode_bf16": 1e-5, "decode_fp8": 1e-5, "attention": 5e-5, "gemm_fp8": 1e-5}


@pytest.fixture(scope="module")
def results() -> tuple[dict, str]:
    """All cases in one fresh interpreter process (one start-up); each prints its JSON line when done."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-m", "tests.test_kernel_overflow", *CASES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=280)
    done = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    return done, f"exit {proc.returncode} (a negative exit is a signal, -11: a wrapped address)\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_offsets_past_int32_are_exact(case, results):
    done, failure = results
    assert case in done, f"{case} did not finish: {failure}"
    result = dict(done[case])
    assert result.pop("max_offset") >= INT32_LIMIT, "the case does not reach past 2^31"
    for name, err in result.items():
        assert err < TOLERANCE[case], f"{case} {name}: {err:.3g} >= {TOLERANCE[case]}"


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps([name, CASES[name]()]), flush=True)
