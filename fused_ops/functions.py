"""The fused ops as differentiable functions (``torch.autograd.Function`` around the kernel ops of ``ops``).

Each forward saves only what V3's memory discipline keeps: RMSNorm its input (the updated residual) and the
per-row ``rstd``, never its output; SwiGLU its input; RoPE nothing but cos/sin; permute and unpermute the
index vectors (and unpermute's grouped input when it has routing weights, for their gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from accel import registry
from fused_ops import ops
from fused_ops.grouping import Grouping


def kernels_run(device: torch.device) -> bool:
    """Whether the fused Triton kernels (not their references) run for tensors on ``device`` now: the registry's
    choice (``DSV3_KERNEL_IMPL``), Triton where it can run. A caller with a tuned unfused path of its own (the
    model's CPU path) takes that one otherwise."""
    return registry.requested_impl() != "reference" and registry.triton_unavailable_reason(device) is None


class NormOut(NamedTuple):
    y: torch.Tensor
    residual: torch.Tensor | None  # x + residual, the stream the next layer adds to (None without a residual)
    fp8: tuple[torch.Tensor, torch.Tensor] | None  # y's 1x128 e4m3 cast (values, scales) when asked for


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, fp8):
        rows = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(rows.shape)
        out = (ops.rmsnorm_fp8_op if fp8 else ops.rmsnorm_op)(rows, weight, res, eps)
        y, rest = out[0], list(out[1:])
        h = rest.pop(0) if residual is not None else rows
        rstd = rest.pop(0)
        q, sf = rest if fp8 else (None, None)
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        if fp8:
            ctx.mark_non_differentiable(q, sf)
        h_out = h.view(x.shape) if residual is not None else None
        return y.view(*x.shape[:-1], y.shape[-1]), h_out, q, sf

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_h, _q, _sf):
        h, weight, rstd = ctx.saved_tensors
        dh = None if grad_h is None else grad_h.reshape(h.shape).contiguous()
        dx, dw = ops.rmsnorm_backward_op(h, weight, rstd, grad_y.reshape(h.shape).contiguous(), dh)
        dx = dx.view(grad_y.shape)
        return dx, dw.to(weight.dtype), dx if ctx.has_residual else None, None, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6,
            fp8: bool = False):
    """``(h * rstd).to(dtype) * weight`` with ``h = x + residual`` (or ``x``), one kernel forward and backward.

    Returns ``y`` alone for ``rmsnorm(x, weight)``; with a residual or ``fp8`` a ``NormOut(y, residual, fp8)``:
    the updated residual ``h`` and ``y``'s 1x128 e4m3 cast (not differentiable: the FP8 GEMM consumes it in
    the forward, the gradient reaches ``y``). The backward recomputes the normalised values from ``h`` and
    ``rstd``; the output is never kept.
    """
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rmsnorm: weight must be [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rmsnorm: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    y, h, q, sf = _RMSNorm.apply(x, weight, residual, eps, fp8)
    if residual is None and not fp8:
        return y
    return NormOut(y, h, (q, sf) if fp8 else None)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weights):
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        y = ops.swiglu_op(rows, None if weights is None else weights.reshape(-1).float().contiguous())
        ctx.save_for_backward(gate_up, weights)
        return y.view(*gate_up.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate_up, weights = ctx.saved_tensors
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        w = None if weights is None else weights.reshape(-1).float().contiguous()
        d_gu, dw = ops.swiglu_backward_op(rows, w, grad.reshape(rows.shape[0], -1).contiguous())
        dw = None if dw is None or not ctx.needs_input_grad[1] else dw.view(weights.shape).to(weights.dtype)
        return d_gu.view(gate_up.shape), dw


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 * inter]``, each row times ``weights [...]`` when given.
    The backward recomputes ``silu`` from ``gate_up`` (nothing but the input and the weights is kept)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    if weights is not None and weights.shape != gate_up.shape[:-1]:
        raise ValueError(f"swiglu: weights must be {list(gate_up.shape[:-1])} (one per row), got "
                         f"{list(weights.shape)}")
    return _SwiGLU.apply(gate_up, weights)


def swiglu_fp8(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1x128 e4m3 cast ``(values [rows, inter], scales [rows, ceil(inter / 128)])`` of ``swiglu(gate_up,
    weights)`` for ``gate_up [rows, 2 * inter]``, without the bf16 result ever stored: the input of the down
    projection's FP8 GEMM, recomputed in backward from ``gate_up`` (V3 keeps that in FP8). Not differentiable."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fp8: gate_up must be [rows, 2 * inter], got {list(gate_up.shape)}")
    w = None if weights is None else weights.detach().reshape(-1).float().contiguous()
    return ops.swiglu_fp8_op(gate_up.detach(), w)


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleaved: bool,
                 inverse: bool) -> torch.Tensor:
    return ops.rope_op(x, cos.float().contiguous(), sin.float().contiguous(), out, interleaved=interleaved,
                       inverse=inverse)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _inverse_rotation(grad: torch.Tensor, cos, sin, interleaved: bool) -> torch.Tensor:
    g = grad if grad.stride(-1) == 1 else grad.contiguous()
    return _rotate_into(g, cos, sin, _fresh(g), interleaved, True)


class _RopeInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        _rotate_into(x, cos, sin, x, interleaved, False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _inverse_rotation(grad, cos, sin, ctx.interleaved), None, None, None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        src = x if x.stride(-1) == 1 else x.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate_into(src, cos, sin, _fresh(src), interleaved, False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _inverse_rotation(grad, cos, sin, ctx.interleaved), None, None, None


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x must be [batch, seq, heads, d] with d even, got {list(x.shape)}")
    want = (x.shape[1], x.shape[-1] // 2)
    if cos.shape != sin.shape or tuple(cos.shape[-2:]) != want or cos.dim() not in (2, 3):
        raise ValueError(f"rope: cos and sin must be [seq, d/2] = {list(want)} (or [batch, seq, d/2]), got "
                         f"{list(cos.shape)} and {list(sin.shape)}")


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate ``x [batch, seq, heads, d]`` in place by ``cos/sin [seq, d/2]`` (or ``[batch, seq, d/2]``;
    YaRN's frequencies and scale included in them) and return it. ``interleaved``: pairs ``(x0, x1), ...`` as
    DeepSeek-V3's MLA; else halves ``(x_i, x_{i+d/2})`` as the V3.2 indexer. Backward: the inverse rotation."""
    _check_rope(x, cos, sin)
    return _RopeInPlace.apply(x, cos, sin, interleaved)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """``rope_`` into a new tensor (for inputs that must stay as they are)."""
    _check_rope(x, cos, sin)
    return _Rope.apply(x, cos, sin, interleaved)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, layout: Grouping):
        w = None if weights is None else weights.reshape(-1).float().contiguous()
        grouped, _, grouped_w = ops.permute_gather_op(x.contiguous(), layout.assign, layout.k, None, w)
        ctx.layout = layout
        return grouped, grouped_w

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_w):
        layout = ctx.layout
        dx = ops.unpermute_sum_op(grad.contiguous(), layout.rows, layout.k) if ctx.needs_input_grad[0] else None
        dw = None if grad_w is None or not ctx.needs_input_grad[1] else grad_w[layout.rows].view(-1, layout.k)
        return dx, dw, None


def permute(x: torch.Tensor, layout: Grouping, weights: torch.Tensor | None = None, scales: torch.Tensor | None = None,
            fp8: bool = False):
    """Tokens ``x [T, d]`` into the grouped layout: ``(x_grouped [M, d], scales_grouped, weights_grouped [M])``.

    - bf16/fp32 ``x``: differentiable (backward: each token's rows summed back); ``scales_grouped`` None.
    - ``fp8=True``: ``x`` cast to e4m3 with 1x128 scales on the way (DeepGEMM's cast of the grouped rows).
    - e4m3 ``x`` with its ``scales [T, ceil(d/128)]``: values and scales moved together.
    The FP8 forms feed an FP8 GEMM's forward and carry no gradient. ``weights [T, k]`` (routing weights): moved
    to their rows (0 on padding), differentiable. Padding rows are zeros.
    """
    if x.dim() != 2 or x.shape[0] != layout.num_tokens:
        raise ValueError(f"permute: x must be [{layout.num_tokens}, d] (the layout's tokens), got {list(x.shape)}")
    if weights is not None and weights.shape != (layout.num_tokens, layout.k):
        raise ValueError(f"permute: weights must be [{layout.num_tokens}, {layout.k}], got {list(weights.shape)}")
    if (x.dtype == ops.FP8) != (scales is not None):
        raise ValueError("permute: scales go with (and only with) e4m3 x")
    if scales is None and not fp8:
        grouped, grouped_w = _Permute.apply(x, weights, layout)
        return grouped, None, grouped_w
    w = None if weights is None else weights.detach().reshape(-1).float().contiguous()
    if scales is not None:
        return ops.permute_gather_op(x.contiguous(), layout.assign, layout.k, scales.contiguous(), w)
    return ops.permute_gather_fp8_op(x.contiguous(), layout.assign, layout.k, w)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, layout: Grouping):
        w = None if weights is None else weights.reshape(-1).float().contiguous()
        ctx.layout = layout
        ctx.save_for_backward(y if w is not None else None, w)
        return ops.unpermute_sum_op(y.contiguous(), layout.rows, layout.k, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, w = ctx.saved_tensors
        layout = ctx.layout
        grad = grad.contiguous()
        if w is None:
            return ops.permute_gather_op(grad, layout.assign, layout.k)[0], None, None
        dy, dw = ops.unpermute_spread_op(grad, y.contiguous(), layout.assign, layout.k, w)
        return dy, dw.view(-1, layout.k), None


def unpermute(y_grouped: torch.Tensor, layout: Grouping, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped rows back to tokens: ``[T, d]``, each token's ``k`` rows summed, weighted by ``weights [T, k]``
    when given (in ``y``'s dtype, as ``(y * w).sum``); fp32 accumulation."""
    if y_grouped.dim() != 2 or y_grouped.shape[0] != layout.assign.numel():
        raise ValueError(f"unpermute: y_grouped must be [{layout.assign.numel()}, d] (the layout's rows), got "
                         f"{list(y_grouped.shape)}")
    return _Unpermute.apply(y_grouped, weights, layout)


def _gather_rows_backward(ctx, grad: torch.Tensor):
    """``gather_rows``' backward: each source row's gradient summed over its rows (one kernel), the columns'
    gradient at their assignment."""
    assign, inverse = ctx.saved_tensors
    grad = grad.contiguous()
    dx = ops.unpermute_sum_op(grad[:, :ctx.dim], inverse, ctx.k) if ctx.needs_input_grad[0] else None
    dc = None
    if ctx.needs_input_grad[1]:  # a few columns per assignment: plain torch
        real = assign >= 0
        dc = grad.new_zeros(inverse.numel(), grad.shape[1] - ctx.dim).index_put_((assign[real],), grad[real, ctx.dim:])
    return dx, dc


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, columns, assign, inverse, k):
        ctx.save_for_backward(assign, inverse)
        ctx.k, ctx.dim = k, x.shape[1]
        return ops.gather_rows_op(x.contiguous(), assign, k, None if columns is None else columns.contiguous())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return *_gather_rows_backward(ctx, grad), None, None, None


class _PackRowsFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, columns, assign, inverse, k, x_fp8):
        if x_fp8 is None:  # cast on the way
            q, sf, _ = ops.permute_gather_fp8_op(x.detach().contiguous(), assign, k)
        else:  # the producer's cast, moved with its scales
            q, sf, _ = ops.permute_gather_op(x_fp8[0].contiguous(), assign, k, x_fp8[1].contiguous())
        parts = [q.view(torch.uint8), sf.view(torch.uint8)]
        if columns is not None:  # a few values per row: plain torch
            parts.append(columns.detach()[assign].contiguous().view(torch.uint8))
        width = sum(p.shape[1] for p in parts)
        parts.append(q.new_zeros(len(q), -width % 16, dtype=torch.uint8))  # rows 16-byte aligned: 128-bit loads
        wire = torch.cat(parts, dim=1)
        ctx.save_for_backward(assign, inverse)
        ctx.k, ctx.dim = k, x.shape[1]
        ctx.mark_non_differentiable(wire)
        width = x.shape[1] + (0 if columns is None else columns.shape[1])
        return x.new_zeros(()).expand(assign.numel(), width), wire  # no storage: the rows never exist in x's dtype

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _wire):
        return *_gather_rows_backward(ctx, grad), None, None, None, None


def pack_rows_fp8(x: torch.Tensor, assign: torch.Tensor, inverse: torch.Tensor, k: int = 1,
                  columns: torch.Tensor | None = None,
                  x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_rows``' rows as they travel in FP8: ``(rows, wire)``. ``wire`` is bytes ``[len(assign), d + 4 *
    ceil(d / 128) + c * itemsize]`` rounded up to 16: each row's e4m3 values, its 1x128 fp32 scales, its columns'
    bytes, zeros (so that rows start 16-byte aligned: the receiving kernel's 128-bit loads). The values
    are cast on the way (DeepGEMM's per-token cast, one kernel), or with ``x_fp8 = (values, scales)``, ``x``'s own
    1x128 cast made by its producer, moved with their scales (no cast). ``rows`` stands for the ``[len(assign),
    d + c]`` rows in x's dtype without their storage (they are never materialised): what the gradient of the
    rows is taken against, ``gather_rows``' backward (straight through the cast)."""
    _check_gather("pack_rows_fp8", x, inverse, k, columns)
    if x_fp8 is not None and (x_fp8[0].shape != x.shape or x_fp8[0].dtype != ops.FP8 or
                              x_fp8[1].shape != (x.shape[0], -(-x.shape[1] // 128))):
        raise ValueError(f"pack_rows_fp8: x_fp8 must be (e4m3 {list(x.shape)}, fp32 [{x.shape[0]}, "
                         f"{-(-x.shape[1] // 128)}]) for x")
    return _PackRowsFp8.apply(x, columns, assign, inverse, k, x_fp8)


def gather_rows(x: torch.Tensor, assign: torch.Tensor, inverse: torch.Tensor, k: int = 1,
                columns: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[len(assign), d (+ c)]``: row ``m`` is ``x[assign[m] // k]`` followed by ``columns[assign[m]]``
    (``columns [len(x) * k, c]`` in x's dtype: a few values per (row, slot) assignment), zeros where
    ``assign[m] < 0``. One kernel, no concatenation.

    ``inverse [len(x) * k]`` is the output row of each assignment (-1: none), what the backward needs to sum each
    source row's gradients without atomics (one kernel); the columns get theirs at their assignment.
    """
    _check_gather("gather_rows", x, inverse, k, columns)
    return _GatherRows.apply(x, columns, assign, inverse, k)


def _check_gather(name: str, x: torch.Tensor, inverse: torch.Tensor, k: int, columns: torch.Tensor | None) -> None:
    if x.dim() != 2 or inverse.numel() != x.shape[0] * k:
        raise ValueError(f"{name}: x must be [n, d] and inverse [n * k] = [{x.shape[0] * k}], got "
                         f"{list(x.shape)} and {list(inverse.shape)}")
    if columns is not None and (columns.dim() != 2 or columns.shape[0] != inverse.numel() or columns.dtype != x.dtype):
        raise ValueError(f"{name}: columns must be [{inverse.numel()}, c] in {x.dtype}, got "
                         f"{columns.dtype} {list(columns.shape)}")


class _RegroupRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, dim, assign, inverse):
        values = rows[:, :dim]
        weights = rows[:, dim:].float().sum(1) if rows.shape[1] > dim else None  # a column or two: plain torch
        grouped, _, grouped_w = ops.permute_gather_op(values, assign, 1, None, weights)
        ctx.save_for_backward(inverse)
        ctx.columns = rows.shape[1] - dim
        return grouped, grouped_w

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_w):
        return _regroup_backward(ctx, grad, grad_w), None, None, None


def _regroup_backward(ctx, grad: torch.Tensor, grad_w: torch.Tensor | None) -> torch.Tensor:
    """``regroup_rows``' backward: each input row's gradient gathered back (one kernel), the weight's gradient
    into each of its columns."""
    (inverse,) = ctx.saved_tensors
    columns = None
    if ctx.columns:
        gw = torch.zeros(grad.shape[0], device=grad.device) if grad_w is None else grad_w
        columns = gw.to(grad.dtype).unsqueeze(1).expand(-1, ctx.columns).contiguous()
    return ops.gather_rows_op(grad.contiguous(), inverse, 1, columns)


class _RegroupRowsFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, wire, dim, assign, inverse, keep_rows):
        blocks = -(-dim // 128)
        values = wire[:, :dim].view(ops.FP8)
        scales = wire[:, dim:dim + 4 * blocks].contiguous().view(torch.float32)
        ends = dim + 4 * blocks + (rows.shape[1] - dim) * rows.element_size()
        columns = wire[:, dim + 4 * blocks:ends].contiguous().view(rows.dtype)  # a column or two: plain torch
        weights = columns.float().sum(1) if columns.shape[1] else None
        grouped, q, sf, grouped_w = ops.gather_dequant_fp8_op(values, scales, assign, rows.dtype, weights, keep_rows)
        if grouped is None:  # a stand-in without storage: what the gradient of the grouped rows is taken against
            grouped = rows.new_zeros(()).expand(len(assign), dim)
        ctx.save_for_backward(inverse)
        ctx.columns = rows.shape[1] - dim
        ctx.mark_non_differentiable(q, sf)
        return grouped, grouped_w, q, sf

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_w, _q, _sf):
        return _regroup_backward(ctx, grad, grad_w), None, None, None, None, None


def regroup_rows_fp8(rows: torch.Tensor, wire: torch.Tensor, dim: int, assign: torch.Tensor, inverse: torch.Tensor,
                     keep_rows: bool = True):
    """``regroup_rows`` for rows that travelled as ``pack_rows_fp8``'s ``wire`` (``rows``: their stand-in
    ``[n, dim + c]``, n = len(wire) + 1 with the spare row): ``(values [M, dim], weights [M] or None, (e4m3 [M,
    dim], scales [M, ceil(dim / 128)]))``. The values are the e4m3 rows times their scales rounded to ``rows``'
    dtype (the dequantisation), the last pair that result's own 1x128 cast, bit for bit what an FP8 GEMM fed the
    values would make of them (not differentiable: ``deep_gemm.grouped_linear(..., x_fp8=)``). Without
    ``keep_rows`` the values are a stand-in without storage (for a GEMM that reads only the cast and keeps it
    for its wgrad: ``fp8_cache``). One kernel each way; the backward is ``regroup_rows``'."""
    if rows.dim() != 2 or wire.dtype != torch.uint8 or inverse.numel() != rows.shape[0] or len(wire) >= len(rows):
        raise ValueError(f"regroup_rows_fp8: rows must be [n, dim + c], wire uint8 [< n, bytes] and inverse [n]; got "
                         f"{list(rows.shape)}, {wire.dtype} {list(wire.shape)}, {list(inverse.shape)}")
    grouped, weights, q, sf = _RegroupRowsFp8.apply(rows, wire, dim, assign, inverse, keep_rows)
    return grouped, weights, (q, sf)


def regroup_rows(rows: torch.Tensor, dim: int, assign: torch.Tensor,
                 inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows that carry a weight as trailing columns (``rows [n, dim + c]``, the weight the columns' fp32 sum; c may
    be 0) into another order: ``(values [len(assign), dim], weights [len(assign)] fp32 or None)`` with row ``m``
    from ``rows[assign[m]]``, zeros (and weight 0) where ``assign[m] < 0``. One kernel each way: the backward
    gathers each row's gradient back through ``inverse [n]`` (the output row of each input row, -1: none), the
    weight's gradient into each of its columns."""
    if rows.dim() != 2 or not 0 <= dim <= rows.shape[1] or inverse.numel() != rows.shape[0]:
        raise ValueError(f"regroup_rows: rows must be [n, >= dim={dim}] and inverse [n]; got {list(rows.shape)} "
                         f"and {list(inverse.shape)}")
    return _RegroupRows.apply(rows, dim, assign, inverse)


def _logits_grad(ctx, backward_op, grad_w: torch.Tensor | None, grad_scores: torch.Tensor | None) -> torch.Tensor:
    """A router's logits gradient from its weights' and scores' gradients (either may be None), by ``backward_op``."""
    scores, indices = ctx.saved_tensors
    grad_w = torch.zeros(indices.shape, device=scores.device) if grad_w is None else grad_w.contiguous()
    grad_scores = None if grad_scores is None else grad_scores.contiguous()
    return backward_op(scores, indices, grad_w, grad_scores, ctx.route_scale, ctx.norm)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes):
        weights, indices, scores = ops.route_op(logits.contiguous(), bias.float().contiguous(), topk, groups,
                                                topk_groups, route_scale, norm, nodes, max_nodes)
        ctx.save_for_backward(scores, indices)
        ctx.route_scale, ctx.norm = route_scale, norm
        ctx.mark_non_differentiable(indices)
        return weights, indices, scores

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_w, _grad_indices, grad_scores):
        return _logits_grad(ctx, ops.route_backward_op, grad_w, grad_scores), *(None,) * 8


class _RouteSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes):
        weights, indices, scores = ops.route_softmax_op(logits.contiguous(), topk, groups, topk_groups, route_scale,
                                                        norm, nodes, max_nodes)
        ctx.save_for_backward(scores, indices)
        ctx.route_scale, ctx.norm = route_scale, norm
        ctx.mark_non_differentiable(indices)
        return weights, indices, scores

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_w, _grad_indices, grad_scores):
        return _logits_grad(ctx, ops.route_softmax_backward_op, grad_w, grad_scores), *(None,) * 7


def route(logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
          norm: bool = True, nodes: int = 1, max_nodes: int | None = None):
    """DeepSeek-V3's sigmoid router after the fp32 logits: ``(weights [T, k], indices [T, k], scores [T, E])``.

    Selection on ``sigmoid(logits) + bias`` limited to the ``topk_groups`` groups with the best top-2 sums, then
    (``max_nodes`` < ``nodes``) to the ``max_nodes`` of ``nodes`` contiguous expert blocks whose ``topk //
    max_nodes`` best remaining values sum highest (V3's node-limited routing, ``balancing.node_limited_mask``);
    weights from the unbiased scores, normalised when ``norm``, times ``route_scale``. One kernel each way;
    ``bias`` gets no gradient (it is updated by the balancing rule).
    """
    if bias.shape != logits.shape[-1:]:
        raise ValueError(f"route: bias must be [experts] = {list(logits.shape[-1:])}, got {list(bias.shape)}")
    _check_route("route", logits, groups, nodes, max_nodes)
    return _Route.apply(logits, bias, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes)


def route_softmax(logits: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
                  norm: bool = False, nodes: int = 1, max_nodes: int | None = None):
    """DeepSeek-V2 / V2-Lite's router after the fp32 logits: ``(weights [T, k], indices [T, k], scores [T, E])``.

    Scores ``softmax(logits)`` over the experts; selection on them limited to the ``topk_groups`` groups with the
    largest single score, then the node limit as in ``route``; weights the picked scores, normalised when
    ``norm``, times ``route_scale``. One kernel each way."""
    _check_route("route_softmax", logits, groups, nodes, max_nodes)
    return _RouteSoftmax.apply(logits, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes)


def _check_route(name: str, logits: torch.Tensor, groups: int, nodes: int, max_nodes: int | None) -> None:
    if logits.dim() != 2 or logits.shape[-1] % groups:
        raise ValueError(f"{name}: logits must be [tokens, experts] with experts divisible by groups={groups}, got "
                         f"{list(logits.shape)}")
    if logits.shape[-1] % nodes or (max_nodes is not None and not 1 <= max_nodes <= nodes):
        raise ValueError(f"{name}: nodes={nodes} must divide the {logits.shape[-1]} experts and "
                         f"max_nodes={max_nodes} lie in [1, nodes]")
