"""accel and the verification harness on a real GPU (CUDA or MUSA): detection, events, do_bench against
the device's peak, and the toy kernels compiled for the device, caught or passed by the harness.

Skipped on CPU. Needs compiled Triton: run with TRITON_INTERPRET=0 (benchmarks/gpu_check.sh sets it).
"""

from __future__ import annotations

import pytest
import torch

import accel
from tests import toy_kernels
from verifier import verify

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def compiled():
    if accel.triton_interpreted():
        pytest.skip("TRITON_INTERPRET=1: these tests need compiled Triton (run with TRITON_INTERPRET=0)")
    names = toy_kernels.register_toys()
    yield names
    toy_kernels.unregister_toys()


def test_gpu_backend():
    name = accel.backend()
    assert name in ("cuda", "musa")
    assert accel.default_device().type == name
    assert accel.dist_backend() == {"cuda": "nccl", "musa": "mccl"}[name]
    cap = accel.device_capability()
    assert accel.fp8_native() == (cap >= ((8, 9) if name == "cuda" else (3, 1)))


def test_do_bench_is_physically_plausible():
    """A 4096^3 bf16 product timed by do_bench (device events, L2 flushed) cannot beat the dense peak."""
    n = 4096
    a = torch.randn(n, n, device=accel.default_device(), dtype=torch.bfloat16)
    ms = accel.do_bench(lambda: a @ a, warmup=3, rep=10)
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    spec = accel.lookup(accel.device_name())
    assert ms > 0
    if spec is not None:
        assert tflops < 1.05 * spec.bf16_tflops, (tflops, spec)  # 5%: boost clocks above the datasheet


def test_harness_on_compiled_kernels(compiled):
    for name in toy_kernels.CORRECT:
        results = verify.verify_op(name, seeds=5)
        assert all(r.passed for r in results), verify.failures(results)
        assert all(r.launches == 1 for r in results)  # the compiled launch path is counted too
        assert all(r.kernel_ms > 0 for r in results if r.kernel_ms is not None)
    for name in ("toy.wrong_result", "toy.unwritten_output", "toy.unwritten_out_arg", "toy.calls_reference",
                 "toy.mutates_input", "toy.unsupported"):
        results = verify.verify_op(name, seeds=5, bench=False)
        assert results and not any(r.passed for r in results), name
