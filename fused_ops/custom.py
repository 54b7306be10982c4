"""The 17 fused kernel ops as PyTorch custom ops, ``torch.ops.dsv3.<name>`` (docs/custom_ops.md).

Each body is its ``accel.registry`` op (``fused_ops.ops``: Triton or the reference), with the reference's flat
arguments. Outputs a call does not produce (``h`` without a residual, the grouped scales or weights without
them) are 0-element tensors: a custom op returns no ``None``. ``rope`` writes ``out`` and returns nothing.

Autograd is registered where the op's own arguments are all its backward needs (RMSNorm, SwiGLU, the two
routers), saving what V3's memory discipline keeps: RMSNorm its input (the updated residual) and ``rstd``, never
its output; SwiGLU its input and the routing weights; the routers their scores and indices. The permutes, whose
backward needs the layout's inverse, are differentiable through ``fused_ops.functions``' composite ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from accel import registry
from fused_ops import ops


def absent(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An output this call does not produce: 0 elements (``like``'s device, ``dtype`` or ``like``'s)."""
    return like.new_empty(0, dtype=dtype or like.dtype)


# ------------------------------------------------------------------------------------------------ RMSNorm


def _norm_setup(ctx, inputs, output) -> None:
    x, weight, residual, _eps = inputs
    ctx.save_for_backward(x if residual is None else output[1], weight, output[2])
    ctx.has_residual = residual is not None
    if len(output) == 5:  # the FP8 cast feeds an FP8 GEMM's forward; the gradient reaches y
        ctx.mark_non_differentiable(output[3], output[4])


def _norm_backward(ctx, grad_y: Tensor, grad_h: Tensor, *_fp8):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rmsnorm_backward(h, weight, rstd, grad_y.contiguous(), grad_h.contiguous() if ctx.has_residual else None)
    return dx, dw.to(weight.dtype), dx if ctx.has_residual else None, None


@registry.torch_op(ops.rmsnorm_op, backward=_norm_backward, setup_context=_norm_setup)
def rmsnorm(x: Tensor, weight: Tensor, residual: Tensor | None = None,
            eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h, rstd)`` of rows ``x [rows, dim]``; ``h = x + residual`` (0 elements without a residual)."""
    out = ops.rmsnorm_op(x, weight, residual, eps)
    return (out[0], absent(x), out[1]) if residual is None else out


@registry.torch_op(ops.rmsnorm_fp8_op, backward=_norm_backward, setup_context=_norm_setup)
def rmsnorm_fp8(x: Tensor, weight: Tensor, residual: Tensor | None = None,
                eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``rmsnorm``'s outputs and ``y``'s 1x128 e4m3 cast ``(q, scales)`` (not differentiable)."""
    out = ops.rmsnorm_fp8_op(x, weight, residual, eps)
    return (out[0], absent(x), *out[1:]) if residual is None else out


@registry.torch_op(ops.rmsnorm_backward_op)
def rmsnorm_backward(h: Tensor, weight: Tensor, rstd: Tensor, grad_y: Tensor,
                     grad_h: Tensor | None = None) -> tuple[Tensor, Tensor]:
    dx, dw = ops.rmsnorm_backward_op(h, weight, rstd, grad_y, grad_h)
    return dx, dw


# ------------------------------------------------------------------------------------------------ SwiGLU


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad: Tensor):
    gate_up, weights = ctx.saved_tensors
    d_gate_up, dw = swiglu_backward(gate_up, weights, grad.contiguous())
    return d_gate_up, None if weights is None else dw


@registry.torch_op(ops.swiglu_op, backward=_swiglu_backward, setup_context=_swiglu_setup)
def swiglu(gate_up: Tensor, weights: Tensor | None = None) -> Tensor:
    """``silu(gate) * up [* weights]`` of rows ``gate_up [rows, 2 * inter]``, ``weights [rows]`` fp32."""
    return ops.swiglu_op(gate_up, weights)


@registry.torch_op(ops.swiglu_fp8_op)
def swiglu_fp8(gate_up: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    q, sf = ops.swiglu_fp8_op(gate_up, weights)
    return q, sf


@registry.torch_op(ops.swiglu_backward_op)
def swiglu_backward(gate_up: Tensor, weights: Tensor | None, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(d gate_up, d weights)``; the second has 0 elements without weights."""
    d_gate_up, dw = ops.swiglu_backward_op(gate_up, weights, grad)
    return d_gate_up, absent(grad, torch.float32) if dw is None else dw


# ------------------------------------------------------------------------------------------------ RoPE


@registry.torch_op(ops.rope_op, mutates_args=("out",))
def rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, interleaved: bool = True, inverse: bool = False) -> None:
    """Rotated ``x`` written into ``out`` (which may be ``x``)."""
    ops.rope_op(x, cos, sin, out, interleaved=interleaved, inverse=inverse)


# ------------------------------------------------------------------------------------------------ permutes


@registry.torch_op(ops.permute_gather_op)
def permute_gather(x: Tensor, assign: Tensor, k: int, scales: Tensor | None = None,
                   weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, their scales, their weights)``; the last two 0 elements when not given."""
    rows, s, w = ops.permute_gather_op(x, assign, k, scales, weights)
    return rows, absent(x, torch.float32) if s is None else s, absent(x, torch.float32) if w is None else w


@registry.torch_op(ops.permute_gather_fp8_op)
def permute_gather_fp8(x: Tensor, assign: Tensor, k: int,
                       weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    q, sf, w = ops.permute_gather_fp8_op(x, assign, k, weights)
    return q, sf, absent(x, torch.float32) if w is None else w


@registry.torch_op(ops.gather_rows_op)
def gather_rows(x: Tensor, assign: Tensor, k: int, columns: Tensor | None = None) -> Tensor:
    return ops.gather_rows_op(x, assign, k, columns)


@registry.torch_op(ops.gather_dequant_fp8_op)
def gather_dequant_fp8(values: Tensor, scales: Tensor, assign: Tensor, dtype: torch.dtype,
                       weights: Tensor | None = None, keep_rows: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(rows or 0 elements without keep_rows, q, scales, weights or 0 elements)``."""
    rows, q, sf, w = ops.gather_dequant_fp8_op(values, scales, assign, dtype, weights, keep_rows)
    return (absent(scales, dtype) if rows is None else rows, q, sf,
            absent(scales, torch.float32) if w is None else w)


@registry.torch_op(ops.unpermute_sum_op)
def unpermute_sum(y: Tensor, rows: Tensor, k: int, weights: Tensor | None = None) -> Tensor:
    return ops.unpermute_sum_op(y, rows, k, weights)


@registry.torch_op(ops.unpermute_spread_op)
def unpermute_spread(grad: Tensor, y: Tensor, assign: Tensor, k: int, weights: Tensor) -> tuple[Tensor, Tensor]:
    dy, dw = ops.unpermute_spread_op(grad, y, assign, k, weights)
    return dy, dw


# ------------------------------------------------------------------------------------------------ routers


def _route_setup(ctx, inputs, output) -> None:
    _weights, indices, scores = output
    ctx.save_for_backward(scores, indices)
    route_scale, norm = (inputs[5], inputs[6]) if len(inputs) == 9 else (inputs[4], inputs[5])
    ctx.route_scale, ctx.norm = route_scale, norm
    ctx.mark_non_differentiable(indices)


def _route_backward(ctx, grad_w: Tensor, _grad_indices: Tensor, grad_scores: Tensor):
    scores, indices = ctx.saved_tensors
    return route_backward(scores, indices, grad_w.contiguous(), grad_scores.contiguous(), ctx.route_scale,
                          ctx.norm), *(None,) * 8


def _route_softmax_backward(ctx, grad_w: Tensor, _grad_indices: Tensor, grad_scores: Tensor):
    scores, indices = ctx.saved_tensors
    return route_softmax_backward(scores, indices, grad_w.contiguous(), grad_scores.contiguous(), ctx.route_scale,
                                  ctx.norm), *(None,) * 7


@registry.torch_op(ops.route_op, backward=_route_backward, setup_context=_route_setup)
def route(logits: Tensor, bias: Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
          norm: bool = True, nodes: int = 1, max_nodes: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    weights, indices, scores = ops.route_op(logits, bias, topk, groups, topk_groups, route_scale, norm, nodes,
                                            max_nodes)
    return weights, indices, scores


@registry.torch_op(ops.route_softmax_op, backward=_route_softmax_backward, setup_context=_route_setup)
def route_softmax(logits: Tensor, topk: int, groups: int, topk_groups: int, route_scale: float, norm: bool = True,
                  nodes: int = 1, max_nodes: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    weights, indices, scores = ops.route_softmax_op(logits, topk, groups, topk_groups, route_scale, norm, nodes,
                                                    max_nodes)
    return weights, indices, scores


@registry.torch_op(ops.route_backward_op)
def route_backward(scores: Tensor, indices: Tensor, grad_weights: Tensor, grad_scores: Tensor | None,
                   route_scale: float, norm: bool = True) -> Tensor:
    return ops.route_backward_op(scores, indices, grad_weights, grad_scores, route_scale, norm)


@registry.torch_op(ops.route_softmax_backward_op)
def route_softmax_backward(scores: Tensor, indices: Tensor, grad_weights: Tensor, grad_scores: Tensor | None,
                           route_scale: float, norm: bool = True) -> Tensor:
    return ops.route_softmax_backward_op(scores, indices, grad_weights, grad_scores, route_scale, norm)
