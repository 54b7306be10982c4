"""Toy Triton kernels, one correct and several deliberately broken, for the verification harness' own tests.

Every op computes ``out = alpha * x + beta * y`` on 1-D fp32 tensors. The broken ones each commit
one of the faults the harness must catch: a wrong result, an unwritten output (partial store, both
as a returned tensor and as an in-place output), a kernel that quietly runs a reference, a kernel
that scribbles on its input, and one that declares every input ``Unsupported``.

They are real ``@triton.jit`` kernels (the CPU interpreter runs them under TRITON_INTERPRET=1),
registered under ``toy.*`` names by ``register_toys()`` and removed by ``unregister_toys()``.
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from accel import registry
from accel.registry import Case, VerifySpec

BLOCK = 128
# Odd sizes leave a partial last block; 1000 spans several programs.
SHAPES = [{"n": 37}, {"n": 256}, {"n": 1000}]
# fp32 elementwise: kernel and reference round the same two products and one sum (an FMA at most
# changes the last bit), so calc_diff is ~1e-14; 1e-6 leaves room and still fails any real bug.
TOLERANCE = 1e-6


@triton.jit
def _load_block(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    return offs, mask, tl.load(x_ptr + offs, mask=mask), tl.load(y_ptr + offs, mask=mask)


@triton.jit
def _axpby_kernel(x_ptr, y_ptr, out_ptr, n, alpha, beta, BLOCK: tl.constexpr):
    offs, mask, x, y = _load_block(x_ptr, y_ptr, n, BLOCK)
    tl.store(out_ptr + offs, alpha * x + beta * y, mask=mask)


@triton.jit
def _axpby_wrong_operand_kernel(x_ptr, y_ptr, out_ptr, n, alpha, beta, BLOCK: tl.constexpr):
    offs, mask, x, y = _load_block(x_ptr, y_ptr, n, BLOCK)
    tl.store(out_ptr + offs, alpha * x + beta * x, mask=mask)  # bug: reads x where y belongs


@triton.jit
def _axpby_partial_store_kernel(x_ptr, y_ptr, out_ptr, n, alpha, beta, BLOCK: tl.constexpr):
    offs, mask, x, y = _load_block(x_ptr, y_ptr, n, BLOCK)
    tl.store(out_ptr + offs, alpha * x + beta * y, mask=offs < n - 1)  # bug: never writes the last element


@triton.jit
def _axpby_mutating_kernel(x_ptr, y_ptr, out_ptr, n, alpha, beta, BLOCK: tl.constexpr):
    offs, mask, x, y = _load_block(x_ptr, y_ptr, n, BLOCK)
    out = alpha * x + beta * y
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(x_ptr + offs, out, mask=mask)  # bug: uses its input as scratch space


@triton.jit
def _marker_kernel(ptr):
    tl.store(ptr, tl.load(ptr) + 1)


def launch_marker(device: torch.device | str = "cpu") -> None:
    """Launch one trivial Triton kernel: lets a plain-PyTorch test double pass as a Triton implementation."""
    _marker_kernel[(1,)](torch.zeros(1, device=device))


def _launch(kernel, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    n = x.numel()
    kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, alpha, beta, BLOCK=BLOCK)
    return out


def _returning(kernel):
    def impl(x: torch.Tensor, y: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        return _launch(kernel, x, y, registry.empty(x.shape, dtype=x.dtype, device=x.device), alpha, beta)

    return impl


def _in_place(kernel):
    def impl(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, alpha: float, beta: float) -> None:
        _launch(kernel, x, y, out, alpha, beta)

    return impl


def _reference(x: torch.Tensor, y: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    return alpha * x + beta * y


def _reference_out(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, alpha: float, beta: float) -> None:
    out.copy_(alpha * x + beta * y)


def _tail_by_reference(x: torch.Tensor, y: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Bug: full blocks in Triton, the ragged tail by toy.axpby's (counted) reference."""
    out = registry.empty(x.shape, dtype=x.dtype, device=x.device)
    full = x.numel() // BLOCK * BLOCK
    if full:
        _launch(_axpby_kernel, x[:full], y[:full], out[:full], alpha, beta)
    out[full:] = registry.get("toy.axpby").reference(x[full:], y[full:], alpha, beta)
    return out


def _unsupported(x: torch.Tensor, y: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    raise registry.Unsupported(f"toy kernel handles no inputs (got n={x.numel()})")


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    rng = random.Random(seed)
    x = torch.randn(shape["n"], device=device)
    y = torch.randn(shape["n"], device=device)
    return Case(args=(x, y, rng.uniform(0.5, 2.0), rng.uniform(-2.0, -0.5)))


def _make_case_out(shape: dict, seed: int, device: torch.device) -> Case:
    x, y, alpha, beta = _make_case(shape, seed, device).args
    return Case(args=(x, y, torch.randn(shape["n"], device=device), alpha, beta), outputs=(2,))


def _spec(make_case=_make_case) -> VerifySpec:
    return VerifySpec(make_case=make_case, shapes=SHAPES, tolerance=TOLERANCE,
                      flops=lambda s: 3.0 * s["n"], bytes_moved=lambda s: 12.0 * s["n"])


# name -> (reference, triton implementation, make_case)
TOYS = {
    "toy.axpby": (_reference, _returning(_axpby_kernel), _make_case),
    "toy.axpby_out": (_reference_out, _in_place(_axpby_kernel), _make_case_out),
    "toy.wrong_result": (_reference, _returning(_axpby_wrong_operand_kernel), _make_case),
    "toy.unwritten_output": (_reference, _returning(_axpby_partial_store_kernel), _make_case),
    "toy.unwritten_out_arg": (_reference_out, _in_place(_axpby_partial_store_kernel), _make_case_out),
    "toy.calls_reference": (_reference, _tail_by_reference, _make_case),
    "toy.mutates_input": (_reference, _returning(_axpby_mutating_kernel), _make_case),
    "toy.unsupported": (_reference, _unsupported, _make_case),
}
CORRECT = ("toy.axpby", "toy.axpby_out")


def register_toys() -> list[str]:
    for name, (reference, impl, make_case) in TOYS.items():
        registry.register(name, reference=registry.reference_for(name)(reference), triton=impl,
                          verify=_spec(make_case))
    return list(TOYS)


def unregister_toys() -> None:
    for name in TOYS:
        if name in registry.ops():
            registry.unregister(name)
