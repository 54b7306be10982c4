"""SwiGLU ``silu(gate) * up`` (times a per-row routing weight), or straight to its 1x128 FP8 cast.

``gate_up [rows, 2 * inter]`` is the fused gate/up projection's output. The rounding follows the unfused torch
sequence in the input dtype: ``silu(gate)`` rounded, times ``up`` rounded, times the fp32 weight rounded. One
program per row sweeps ``inter`` in chunks of ``BLOCK`` (a multiple of 128, so FP8 tiles never straddle chunks).
The backward recomputes ``silu`` from ``gate_up`` (V3 keeps the SwiGLU input, in FP8, and not its output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from fused_ops.kernels.common import on_grid, store_fp8

BLOCK = 1024


@triton.jit
def _swiglu_chunk(GU, WT, start, I, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of a row's output, fp32 on the output dtype's grid (zeros past the row's end)."""
    cols = start + tl.arange(0, BLOCK)
    gate = tl.load(GU + cols, mask=cols < I, other=0.0).to(tl.float32)
    up = tl.load(GU + I + cols, mask=cols < I, other=0.0).to(tl.float32)
    dtype = GU.dtype.element_ty
    y = on_grid(on_grid(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    if HAS_WEIGHTS:
        y = on_grid(y * tl.load(WT), dtype)
    return y


@triton.jit
def _swiglu_kernel(GU, WT, OUT, I, stride_gu, stride_out, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, I, BLOCK):
        y = _swiglu_chunk(GU + row * stride_gu, WT + row, start, I, HAS_WEIGHTS, BLOCK)
        cols = start + tl.arange(0, BLOCK)
        tl.store(OUT + row * stride_out + cols, y.to(OUT.dtype.element_ty), mask=cols < I)


@triton.jit
def _swiglu_fp8_kernel(GU, WT, Q, S, I, stride_gu, stride_q, stride_s, HAS_WEIGHTS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Only the e4m3 values and scales leave: the FP8 GEMM reads them, the backward recomputes from ``gate_up``."""
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, I, BLOCK):
        y = _swiglu_chunk(GU + row * stride_gu, WT + row, start, I, HAS_WEIGHTS, BLOCK)
        store_fp8(Q + row * stride_q, S + row * stride_s, y, start, I, BLOCK)


@triton.jit
def _swiglu_backward_kernel(GU, WT, G, DGU, DWT, I, stride_gu, stride_g, stride_dgu, HAS_WEIGHTS: tl.constexpr,
                            BLOCK: tl.constexpr):
    """``d gate = g up s (1 + gate (1 - s))``, ``d up = g silu(gate)`` (``s = sigmoid(gate)``, ``g = grad w``)
    and ``d w = sum(grad silu(gate) up)``, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    GU, G, DGU = GU + row * stride_gu, G + row * stride_g, DGU + row * stride_dgu
    w = 1.0
    if HAS_WEIGHTS:
        w = tl.load(WT + row)
    dw = tl.zeros([BLOCK], tl.float32)
    for start in range(0, I, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(GU + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + I + cols, mask=ok, other=0.0).to(tl.float32)
        grad = tl.load(G + cols, mask=ok, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-gate))
        dw += grad * gate * s * up
        g = grad * w
        dtype = DGU.dtype.element_ty
        tl.store(DGU + cols, on_grid(g * up * s * (1.0 + gate * (1.0 - s)), dtype).to(dtype), mask=ok)
        tl.store(DGU + I + cols, on_grid(g * gate * s, dtype).to(dtype), mask=ok)
    if HAS_WEIGHTS:
        tl.store(DWT + row, tl.sum(dw, axis=0))


def _check(gate_up: torch.Tensor, weights: torch.Tensor | None) -> None:
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        raise registry.Unsupported(f"gate_up must be a 2-D float32/bfloat16 tensor with contiguous rows, got "
                                   f"{gate_up.dtype} {list(gate_up.shape)}")
    if weights is not None and (weights.dtype != torch.float32 or not weights.is_contiguous()):
        raise registry.Unsupported(f"weights must be contiguous float32, got {weights.dtype}")


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    _check(gate_up, weights)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = registry.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        registry.wrap_triton(_swiglu_kernel)[(rows,)](gate_up, gate_up if weights is None else weights, out, inter,
                                                      gate_up.stride(0), out.stride(0), HAS_WEIGHTS=weights is not None,
                                                      BLOCK=BLOCK)
    return out


def swiglu_fp8(gate_up: torch.Tensor, weights: torch.Tensor | None = None):
    _check(gate_up, weights)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q = registry.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    sf = registry.empty(rows, triton.cdiv(inter, 128), dtype=torch.float32, device=gate_up.device)
    if rows:
        registry.wrap_triton(_swiglu_fp8_kernel)[(rows,)](gate_up, gate_up if weights is None else weights, q, sf,
                                                          inter, gate_up.stride(0), q.stride(0), sf.stride(0),
                                                          HAS_WEIGHTS=weights is not None, BLOCK=BLOCK)
    return q, sf


def swiglu_backward(gate_up: torch.Tensor, weights: torch.Tensor | None, grad: torch.Tensor):
    _check(gate_up, weights)
    if grad.stride(-1) != 1:
        raise registry.Unsupported("grad must have contiguous rows")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    dgu = registry.empty(rows, 2 * inter, dtype=gate_up.dtype, device=gate_up.device)
    dw = None if weights is None else registry.empty(rows, dtype=torch.float32, device=gate_up.device)
    if rows:
        registry.wrap_triton(_swiglu_backward_kernel)[(rows,)](gate_up, gate_up if weights is None else weights, grad,
                                                               dgu, dgu if dw is None else dw, inter, gate_up.stride(0),
                                                               grad.stride(0), dgu.stride(0),
                                                               HAS_WEIGHTS=weights is not None, BLOCK=BLOCK)
    return dgu, dw
