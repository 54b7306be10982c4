"""The project's own registered ops under the stricter fall-back gate (verifier.fallback via verifier.verify):
every deep_gemm, flash_mla and fused_ops Triton path launches its kernels, runs no PyTorch compute beyond its
VerifySpec's declared allow-list, and writes its outputs with its own launches.

One seed on each op's first (smallest) verify shape keeps this inside the CPU test budget; the full
matrix is `python -m recipes.verify_kernels` (every shape, 5 seeds).
"""

from __future__ import annotations

import pytest

import accel
from accel import registry
from verifier import verify

registry.load_all()
OPS = verify.select_ops(["deep_gemm.*", "flash_mla.*", "fused_ops.*"])


def test_every_kernel_package_registered_ops():
    assert len([o for o in OPS if o.startswith("deep_gemm.")]) >= 19
    assert {"flash_mla.flash_mla_with_kvcache", "flash_mla.mla_attention"} <= set(OPS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", OPS)
def test_project_op_passes_the_fallback_gate(name):
    op = registry.get(name)
    if op.verify.interpreter_gap and op.verify.interpreter_gap() and accel.triton_interpreted():
        pytest.skip(op.verify.interpreter_gap())
    for reason in op.verify.allow.values():
        assert len(reason) > 30  # a declared operator says why
    [result] = verify.verify_op(name, shapes=op.verify.shapes[:1], seeds=[1234], bench=False)
    assert result.passed, result.reason
    assert result.launches >= 1


def test_undeclared_pytorch_compute_in_a_triton_path_is_caught():
    from tests import toy_kernels

    def impl(x):
        toy_kernels.launch_marker()
        return x * 2

    def case(shape, seed, device):
        import torch

        return registry.Case(args=(torch.randn(8, generator=torch.Generator().manual_seed(seed)),))

    registry.register("test_project.pytorch_inside", reference=lambda x: x * 2, triton=impl,
                      verify=registry.VerifySpec(make_case=case, shapes=[{}]))
    try:
        [result] = verify.verify_op("test_project.pytorch_inside", seeds=[1], bench=False)
    finally:
        registry.unregister("test_project.pytorch_inside")
    assert not result.passed
    assert result.reason == ("PyTorch computed inside the candidate: aten.mul x1 (not allocation, a view or "
                             "allow-listed); out was produced by aten.mul, not by the candidate's kernel")
