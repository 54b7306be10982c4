"""The fused ops' public, differentiable API: thin wrappers over the ``torch.ops.dsv3`` custom ops.

The kernel ops (``fused_ops.custom``) carry their own autograd where their arguments suffice (RMSNorm, SwiGLU,
the routers). The permutes' backward needs the layout's inverse, which the kernel op does not take: they are
composite custom ops here (``torch.ops.dsv3.permute``, ``unpermute``, ``gather_rows_differentiable``,
``pack_rows_fp8``, ``regroup_rows``, ``regroup_rows_fp8``, ``apply_rope``) with the ``Grouping`` flattened into
index tensors, each ``torch.library.triton_op`` (traceable: ``torch.compile`` sees the kernel ops inside) with
``register_autograd``. Saved for backward: only what V3's memory discipline keeps: RMSNorm its input (the updated
residual) and the per-row ``rstd``, never its output; SwiGLU its input; RoPE nothing but cos/sin; permute and
unpermute the index vectors (and unpermute's grouped input when it has routing weights, for their gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from accel import registry
from fused_ops import custom, ops
from fused_ops.grouping import Grouping


class NormOut(NamedTuple):
    y: torch.Tensor
    residual: torch.Tensor | None  # x + residual, the stream the next layer adds to (None without a residual)
    fp8: tuple[torch.Tensor, torch.Tensor] | None  # y's 1x128 e4m3 cast (values, scales) when asked for


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
    rows = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(rows.shape)
    out = (custom.rmsnorm_fp8 if fp8 else custom.rmsnorm)(rows, weight, res, eps)
    y = out[0].view(*x.shape[:-1], out[0].shape[-1])
    if residual is None and not fp8:
        return y
    return NormOut(y, None if residual is None else out[1].view(x.shape), (out[3], out[4]) if fp8 else None)


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 * inter]``, each row times ``weights [...]`` when given.
    The backward recomputes ``silu`` from ``gate_up`` (nothing but the input and the weights is kept)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    if weights is not None and weights.shape != gate_up.shape[:-1]:
        raise ValueError(f"swiglu: weights must be {list(gate_up.shape[:-1])} (one per row), got "
                         f"{list(weights.shape)}")
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    y = custom.swiglu(rows, None if weights is None else weights.reshape(-1).float().contiguous())
    return y.view(*gate_up.shape[:-1], y.shape[-1])


def swiglu_fp8(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1x128 e4m3 cast ``(values [rows, inter], scales [rows, ceil(inter / 128)])`` of ``swiglu(gate_up,
    weights)`` for ``gate_up [rows, 2 * inter]``, without the bf16 result ever stored: the input of the down
    projection's FP8 GEMM, recomputed in backward from ``gate_up`` (V3 keeps that in FP8). Not differentiable."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fp8: gate_up must be [rows, 2 * inter], got {list(gate_up.shape)}")
    w = None if weights is None else weights.detach().reshape(-1).float().contiguous()
    return custom.swiglu_fp8(gate_up.detach(), w)


@registry.library_op("dsv3::apply_rope", triton=True)
def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    custom.rope(x, cos, sin, out, interleaved=interleaved, inverse=inverse)
    return out


def _rope_setup(ctx, inputs, output) -> None:
    _x, cos, sin, ctx.interleaved, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, grad: Tensor):
    cos, sin = ctx.saved_tensors
    g = grad if grad.stride(-1) == 1 else grad.contiguous()
    return _apply_rope(g, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


_apply_rope.register_autograd(_rope_backward, setup_context=_rope_setup)


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
    DeepSeek-V3's MLA; else halves ``(x_i, x_{i+d/2})`` as the V3.2 indexer. Backward: the inverse rotation.

    A custom op that writes an input cannot carry an autograd formula, so where a gradient is wanted this is
    ``apply_rope`` copied back (autograd records the copy); otherwise one kernel rotates in place."""
    _check_rope(x, cos, sin)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return x.copy_(_apply_rope(x if x.stride(-1) == 1 else x.contiguous(), cos, sin, interleaved, False))
    custom.rope(x, cos, sin, x, interleaved=interleaved, inverse=False)
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """``rope_`` into a new tensor (for inputs that must stay as they are)."""
    _check_rope(x, cos, sin)
    return _apply_rope(x if x.stride(-1) == 1 else x.contiguous(), cos.float().contiguous(), sin.float().contiguous(),
                       interleaved, False)


def _flat_weights(weights: torch.Tensor | None) -> torch.Tensor | None:
    return None if weights is None else weights.reshape(-1).float().contiguous()


@registry.library_op("dsv3::permute", triton=True)
def _permute(x: Tensor, weights: Tensor | None, assign: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    grouped, _, grouped_w = custom.permute_gather(x, assign, k, None, weights)
    return grouped, grouped_w


def _permute_setup(ctx, inputs, output) -> None:
    _x, weights, _assign, rows, ctx.k = inputs
    ctx.save_for_backward(rows)
    ctx.has_weights = weights is not None


def _permute_backward(ctx, grad: Tensor, grad_w: Tensor):
    (rows,) = ctx.saved_tensors
    dx = custom.unpermute_sum(grad.contiguous(), rows, ctx.k) if ctx.needs_input_grad[0] else None
    dw = grad_w[rows] if ctx.has_weights and ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


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
        grouped, grouped_w = _permute(x.contiguous(), _flat_weights(weights), layout.assign, layout.rows, layout.k)
        return grouped, None, None if weights is None else grouped_w
    x, w = x.detach().contiguous(), None if weights is None else _flat_weights(weights.detach())
    if scales is not None:
        grouped, grouped_s, grouped_w = custom.permute_gather(x, layout.assign, layout.k, scales.detach().contiguous(),
                                                              w)
        return grouped, grouped_s, None if w is None else grouped_w
    q, sf, grouped_w = custom.permute_gather_fp8(x, layout.assign, layout.k, w)
    return q, sf, None if w is None else grouped_w


@registry.library_op("dsv3::unpermute", triton=True)
def _unpermute(y: Tensor, weights: Tensor | None, assign: Tensor, rows: Tensor, k: int) -> Tensor:
    return custom.unpermute_sum(y, rows, k, weights)


def _unpermute_setup(ctx, inputs, output) -> None:
    y, weights, assign, _rows, ctx.k = inputs
    ctx.save_for_backward(None if weights is None else y, weights, assign)


def _unpermute_backward(ctx, grad: Tensor):
    y, w, assign = ctx.saved_tensors
    grad = grad.contiguous()
    if w is None:
        return custom.permute_gather(grad, assign, ctx.k)[0], None, None, None, None
    dy, dw = custom.unpermute_spread(grad, y, assign, ctx.k, w)
    return dy, dw, None, None, None


_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute(y_grouped: torch.Tensor, layout: Grouping, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped rows back to tokens: ``[T, d]``, each token's ``k`` rows summed, weighted by ``weights [T, k]``
    when given (in ``y``'s dtype, as ``(y * w).sum``); fp32 accumulation."""
    if y_grouped.dim() != 2 or y_grouped.shape[0] != layout.assign.numel():
        raise ValueError(f"unpermute: y_grouped must be [{layout.assign.numel()}, d] (the layout's rows), got "
                         f"{list(y_grouped.shape)}")
    return _unpermute(y_grouped.contiguous(), _flat_weights(weights), layout.assign, layout.rows, layout.k)


def _gather_setup(ctx, inputs, output) -> None:
    x, columns, assign, inverse, ctx.k = inputs[:5]
    ctx.save_for_backward(assign, inverse)
    ctx.dim = x.shape[1]


def _gather_backward(ctx, grad: Tensor, *_wire):
    """``gather_rows``' backward: each source row's gradient summed over its rows (one kernel), the columns'
    gradient at their assignment."""
    assign, inverse = ctx.saved_tensors
    grad = grad.contiguous()
    dx = custom.unpermute_sum(grad[:, :ctx.dim], inverse, ctx.k) if ctx.needs_input_grad[0] else None
    dc = None
    if ctx.needs_input_grad[1]:  # a few columns per assignment: plain torch; padding rows into a spare slot
        n = inverse.numel()
        dc = grad.new_zeros(n + 1, grad.shape[1] - ctx.dim).index_put_(
            (torch.where(assign >= 0, assign, n),), grad[:, ctx.dim:])[:n]
    return dx, dc, *(None,) * (len(ctx.needs_input_grad) - 2)


@registry.library_op("dsv3::gather_rows_differentiable", triton=True)
def _gather_rows(x: Tensor, columns: Tensor | None, assign: Tensor, inverse: Tensor, k: int) -> Tensor:
    return custom.gather_rows(x, assign, k, columns)


_gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)


@registry.library_op("dsv3::pack_rows_fp8", triton=True)
def _pack_rows_fp8(x: Tensor, columns: Tensor | None, assign: Tensor, inverse: Tensor, k: int,
                   x_fp8: Tensor | None, x_fp8_scales: Tensor | None) -> tuple[Tensor, Tensor]:
    if x_fp8 is None:  # cast on the way
        q, sf, _ = custom.permute_gather_fp8(x, assign, k)
    else:  # the producer's cast, moved with its scales
        q, sf, _ = custom.permute_gather(x_fp8, assign, k, x_fp8_scales)
    parts = [q.view(torch.uint8), sf.view(torch.uint8)]
    if columns is not None:  # a few values per row: plain torch
        parts.append(columns[assign].contiguous().view(torch.uint8))
    width = sum(p.shape[1] for p in parts)
    parts.append(q.new_zeros(len(q), -width % 16, dtype=torch.uint8))  # rows 16-byte aligned: 128-bit loads
    wire = torch.cat(parts, dim=1)
    width = x.shape[1] + (0 if columns is None else columns.shape[1])
    return x.new_zeros(()).expand(assign.numel(), width), wire  # no storage: the rows never exist in x's dtype


def _pack_setup(ctx, inputs, output) -> None:
    _gather_setup(ctx, inputs, output)
    ctx.mark_non_differentiable(output[1])


_pack_rows_fp8.register_autograd(_gather_backward, setup_context=_pack_setup)


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
    values, scales = (None, None) if x_fp8 is None else (x_fp8[0].contiguous(), x_fp8[1].contiguous())
    return _pack_rows_fp8(x.contiguous(), None if columns is None else columns.contiguous(), assign, inverse, k,
                          values, scales)


def gather_rows(x: torch.Tensor, assign: torch.Tensor, inverse: torch.Tensor, k: int = 1,
                columns: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[len(assign), d (+ c)]``: row ``m`` is ``x[assign[m] // k]`` followed by ``columns[assign[m]]``
    (``columns [len(x) * k, c]`` in x's dtype: a few values per (row, slot) assignment), zeros where
    ``assign[m] < 0``. One kernel, no concatenation.

    ``inverse [len(x) * k]`` is the output row of each assignment (-1: none), what the backward needs to sum each
    source row's gradients without atomics (one kernel); the columns get theirs at their assignment.
    """
    _check_gather("gather_rows", x, inverse, k, columns)
    return _gather_rows(x.contiguous(), None if columns is None else columns.contiguous(), assign, inverse, k)


def _check_gather(name: str, x: torch.Tensor, inverse: torch.Tensor, k: int, columns: torch.Tensor | None) -> None:
    if x.dim() != 2 or inverse.numel() != x.shape[0] * k:
        raise ValueError(f"{name}: x must be [n, d] and inverse [n * k] = [{x.shape[0] * k}], got "
                         f"{list(x.shape)} and {list(inverse.shape)}")
    if columns is not None and (columns.dim() != 2 or columns.shape[0] != inverse.numel() or columns.dtype != x.dtype):
        raise ValueError(f"{name}: columns must be [{inverse.numel()}, c] in {x.dtype}, got "
                         f"{columns.dtype} {list(columns.shape)}")


@registry.library_op("dsv3::regroup_rows", triton=True)
def _regroup_rows(rows: Tensor, dim: int, assign: Tensor, inverse: Tensor) -> tuple[Tensor, Tensor]:
    values = rows[:, :dim]
    weights = rows[:, dim:].float().sum(1) if rows.shape[1] > dim else None  # a column or two: plain torch
    grouped, _, grouped_w = custom.permute_gather(values, assign, 1, None, weights)
    return grouped, grouped_w


def _regroup_setup(ctx, inputs, output) -> None:
    rows, dim, _assign, inverse = inputs[:4]
    ctx.save_for_backward(inverse)
    ctx.columns = rows.shape[1] - dim
    if len(output) == 4:  # regroup_rows_fp8: the cast feeds an FP8 GEMM's forward
        ctx.mark_non_differentiable(output[2], output[3])


def _regroup_backward(ctx, grad: Tensor, grad_w: Tensor, *_fp8):
    """``regroup_rows``' backward: each input row's gradient gathered back (one kernel), the weight's gradient
    into each of its columns."""
    (inverse,) = ctx.saved_tensors
    columns = None
    if ctx.columns:
        gw = torch.zeros(grad.shape[0], device=grad.device) if grad_w.numel() == 0 else grad_w
        columns = gw.to(grad.dtype).unsqueeze(1).expand(-1, ctx.columns).contiguous()
    return custom.gather_rows(grad.contiguous(), inverse, 1, columns), *(None,) * (len(ctx.needs_input_grad) - 1)


_regroup_rows.register_autograd(_regroup_backward, setup_context=_regroup_setup)


@registry.library_op("dsv3::regroup_rows_fp8", triton=True)
def _regroup_rows_fp8(rows: Tensor, wire: Tensor, dim: int, assign: Tensor, inverse: Tensor,
                      keep_rows: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    blocks = -(-dim // 128)
    values = wire[:, :dim].view(ops.FP8)
    scales = wire[:, dim:dim + 4 * blocks].contiguous().view(torch.float32)
    ends = dim + 4 * blocks + (rows.shape[1] - dim) * rows.element_size()
    columns = wire[:, dim + 4 * blocks:ends].contiguous().view(rows.dtype)  # a column or two: plain torch
    weights = columns.float().sum(1) if columns.shape[1] else None
    grouped, q, sf, grouped_w = custom.gather_dequant_fp8(values, scales, assign, rows.dtype, weights, keep_rows)
    if not keep_rows:  # a stand-in without storage: what the gradient of the grouped rows is taken against
        grouped = rows.new_zeros(()).expand(len(assign), dim)
    return grouped, grouped_w, q, sf


def _regroup_fp8_setup(ctx, inputs, output) -> None:
    rows, _wire, dim, _assign, inverse = inputs[:5]
    _regroup_setup(ctx, (rows, dim, None, inverse), output)


_regroup_rows_fp8.register_autograd(_regroup_backward, setup_context=_regroup_fp8_setup)


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
    grouped, weights, q, sf = _regroup_rows_fp8(rows, wire, dim, assign, inverse, keep_rows)
    return grouped, None if rows.shape[1] == dim else weights, (q, sf)


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
    grouped, weights = _regroup_rows(rows, dim, assign, inverse)
    return grouped, None if rows.shape[1] == dim else weights


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
    return custom.route(logits.contiguous(), bias.detach().float().contiguous(), topk, groups, topk_groups,
                        route_scale, norm, nodes, max_nodes)


def route_softmax(logits: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
                  norm: bool = False, nodes: int = 1, max_nodes: int | None = None):
    """DeepSeek-V2 / V2-Lite's router after the fp32 logits: ``(weights [T, k], indices [T, k], scores [T, E])``.

    Scores ``softmax(logits)`` over the experts; selection on them limited to the ``topk_groups`` groups with the
    largest single score, then the node limit as in ``route``; weights the picked scores, normalised when
    ``norm``, times ``route_scale``. One kernel each way."""
    _check_route("route_softmax", logits, groups, nodes, max_nodes)
    return custom.route_softmax(logits.contiguous(), topk, groups, topk_groups, route_scale, norm, nodes, max_nodes)


def _check_route(name: str, logits: torch.Tensor, groups: int, nodes: int, max_nodes: int | None) -> None:
    if logits.dim() != 2 or logits.shape[-1] % groups:
        raise ValueError(f"{name}: logits must be [tokens, experts] with experts divisible by groups={groups}, got "
                         f"{list(logits.shape)}")
    if logits.shape[-1] % nodes or (max_nodes is not None and not 1 <= max_nodes <= nodes):
        raise ValueError(f"{name}: nodes={nodes} must divide the {logits.shape[-1]} experts and "
                         f"max_nodes={max_nodes} lie in [1, nodes]")
