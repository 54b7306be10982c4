"""The fused memory-bound ops, each a Triton kernel with a plain PyTorch reference in ``accel.registry``.

=====================================  ===============================================================
``fused_ops.rmsnorm``                  ``(x [+ residual]) -> (y, [h,] rstd)``
``fused_ops.rmsnorm_fp8``              the same plus ``y``'s 1x128 e4m3 cast ``(q, scales)``
``fused_ops.rmsnorm_backward``         ``(h, weight, rstd, dy[, dh]) -> (dx, dweight)``
``fused_ops.swiglu``                   ``silu(gate) * up [* w]``
``fused_ops.swiglu_fp8``               only its 1x128 e4m3 cast (the bf16 result is never stored)
``fused_ops.swiglu_backward``          ``-> (d gate_up, d w)``
``fused_ops.rope``                     rotary embedding, interleaved pairs (MLA) or halves (indexer), into ``out``
``fused_ops.permute_gather``           tokens (values, scales, routing weights) into the grouped layout
``fused_ops.permute_gather_fp8``       the same, cast to e4m3 with 1x128 scales on the way
``fused_ops.gather_rows``              rows gathered with per-assignment columns appended (EP's rows to send)
``fused_ops.gather_dequant_fp8``       landed e4m3 rows dequantised into the grouped layout, with their recast
``fused_ops.unpermute_sum``            grouped rows back to tokens, weighted sum over the top-k
``fused_ops.unpermute_spread``         the unpermute backward
``fused_ops.route``                    sigmoid + bias + group- and node-limited top-k + normalised weights
``fused_ops.route_backward``           the logits' gradient from the weights' and the scores'
``fused_ops.route_softmax``            V2's router: softmax, group max, group- and node-limited top-k
``fused_ops.route_softmax_backward``   its logits' gradient
=====================================  ===============================================================

The references are the unfused torch sequences the model ran before (its rounding points included), so a
kernel differs from them only by fp32 evaluation order; the FP8 casts are DeepGEMM's per-token cast
(``deep_gemm.per_token_cast_to_fp8``) of the reference output, restated here because kernel packages import
only ``accel``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accel import registry
from accel.registry import Case, VerifySpec

FP8 = torch.float8_e4m3fn


def cast_1x128(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales ``[rows, ceil(d / 128)]``: scale = max(amax, 1e-4) / 448 per 128 columns."""
    rows, d = y.shape
    tiles = F.pad(y.float(), (0, -d % 128)).view(rows, -1, 128)
    sf = tiles.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    return (tiles * (1.0 / sf)).to(FP8).flatten(1)[:, :d].contiguous(), sf.squeeze(-1)


# ------------------------------------------------------------------------------------------------ references


@registry.reference_for("fused_ops.rmsnorm")
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                      eps: float = 1e-6):
    h = x if residual is None else x + residual
    rstd = torch.rsqrt(h.float().square().mean(-1) + eps)
    y = (h.float() * rstd.unsqueeze(-1)).to(x.dtype) * weight
    return (y, rstd) if residual is None else (y, h, rstd)


@registry.reference_for("fused_ops.rmsnorm_fp8")
def rmsnorm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                          eps: float = 1e-6):
    out = rmsnorm_reference.__wrapped__(x, weight, residual, eps)
    return (*out, *cast_1x128(out[0]))


@registry.reference_for("fused_ops.rmsnorm_backward")
def rmsnorm_backward_reference(h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor,
                               grad_h: torch.Tensor | None = None):
    x_hat = h.float() * rstd.unsqueeze(-1)
    g = grad_y.float() * weight.float()
    dx = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    dx = dx if grad_h is None else dx + grad_h.float()
    return dx.to(h.dtype), (grad_y.float() * x_hat).sum(0)


@registry.reference_for("fused_ops.swiglu")
def swiglu_reference(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else (out * weights.unsqueeze(-1)).to(out.dtype)


@registry.reference_for("fused_ops.swiglu_fp8")
def swiglu_fp8_reference(gate_up: torch.Tensor, weights: torch.Tensor | None = None):
    return cast_1x128(swiglu_reference.__wrapped__(gate_up, weights))


@registry.reference_for("fused_ops.swiglu_backward")
def swiglu_backward_reference(gate_up: torch.Tensor, weights: torch.Tensor | None, grad: torch.Tensor):
    gate, up = gate_up.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    g = grad.float() if weights is None else grad.float() * weights.unsqueeze(-1)
    d_gate_up = torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1).to(gate_up.dtype)
    return d_gate_up, None if weights is None else (grad.float() * gate * s * up).sum(-1)


@registry.reference_for("fused_ops.rope")
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                   interleaved: bool = True, inverse: bool = False) -> torch.Tensor:
    c, s = (cos[None, :, None], sin[None, :, None]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    s = -s if inverse else s
    if interleaved:
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        y = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    else:
        x0, x1 = x.float().chunk(2, dim=-1)
        y = torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)
    return out.copy_(y)


@registry.reference_for("fused_ops.permute_gather")
def permute_gather_reference(x: torch.Tensor, assign: torch.Tensor, k: int, scales: torch.Tensor | None = None,
                             weights: torch.Tensor | None = None):
    real = assign >= 0
    src = assign.clamp_min(0)

    def rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        picked = t[index]
        return torch.where(real.view(-1, *[1] * (picked.dim() - 1)), picked, torch.zeros((), dtype=t.dtype))

    return (rows(x.view(torch.uint8) if x.dtype == FP8 else x, src // k).view(x.dtype),
            None if scales is None else rows(scales, src // k), None if weights is None else rows(weights, src))


@registry.reference_for("fused_ops.permute_gather_fp8")
def permute_gather_fp8_reference(x: torch.Tensor, assign: torch.Tensor, k: int, weights: torch.Tensor | None = None):
    grouped, _, w = permute_gather_reference.__wrapped__(x, assign, k, None, weights)
    return (*cast_1x128(grouped), w)


@registry.reference_for("fused_ops.gather_rows")
def gather_rows_reference(x: torch.Tensor, assign: torch.Tensor, k: int,
                          columns: torch.Tensor | None = None) -> torch.Tensor:
    src = assign.clamp_min(0)
    rows = x[src // k] if columns is None else torch.cat([x[src // k], columns[src]], dim=1)
    return torch.where((assign >= 0).unsqueeze(-1), rows, torch.zeros((), dtype=x.dtype))


@registry.reference_for("fused_ops.gather_dequant_fp8")
def gather_dequant_fp8_reference(values: torch.Tensor, scales: torch.Tensor, assign: torch.Tensor, dtype: torch.dtype,
                                 weights: torch.Tensor | None = None, keep_rows: bool = True):
    x = (values.float() * scales.repeat_interleave(128, dim=1)[:, :values.shape[1]]).to(dtype)
    grouped, _, w = permute_gather_reference.__wrapped__(x, assign, 1, None, weights)
    return (grouped if keep_rows else None, *cast_1x128(grouped), w)


@registry.reference_for("fused_ops.unpermute_sum")
def unpermute_sum_reference(y: torch.Tensor, rows: torch.Tensor, k: int,
                            weights: torch.Tensor | None = None) -> torch.Tensor:
    picked = torch.where((rows >= 0).unsqueeze(-1), y[rows.clamp_min(0)], torch.zeros((), dtype=y.dtype))
    picked = picked.view(rows.numel() // k, k, y.shape[-1])
    return picked.sum(1) if weights is None else (picked * weights.view(-1, k).to(y.dtype).unsqueeze(-1)).sum(1)


@registry.reference_for("fused_ops.unpermute_spread")
def unpermute_spread_reference(grad: torch.Tensor, y: torch.Tensor, assign: torch.Tensor, k: int,
                               weights: torch.Tensor):
    real = (assign >= 0).unsqueeze(-1)
    src = assign.clamp_min(0)
    g = grad.float()[src // k]
    dy = torch.where(real, g * weights.to(y.dtype).float()[src].unsqueeze(-1), 0.0).to(y.dtype)
    dots = (g * y.float()).sum(-1)
    # each real row's dot at its assignment; padding rows into a spare last slot, dropped (no data-dependent shape)
    n = weights.numel()
    return dy, torch.zeros(n + 1, dtype=torch.float32, device=y.device).index_put(
        (torch.where(assign >= 0, src, n),), dots)[:n]


def _keep_best(choice: torch.Tensor, blocks: int, best: int, count: int) -> torch.Tensor:
    """``choice [T, E]`` with all but the ``count`` contiguous blocks (of ``blocks``) whose ``best`` largest values
    sum highest masked to -inf: the group limit (top-2 sums) and the node limit."""
    grouped = choice.view(len(choice), blocks, -1)
    kept = grouped.topk(best, dim=-1).values.sum(-1).topk(count, dim=-1).indices
    losing = torch.ones(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, kept, False)
    return grouped.masked_fill(losing.unsqueeze(-1), float("-inf")).flatten(1)


@registry.reference_for("fused_ops.route")
def route_reference(logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, topk_groups: int,
                    route_scale: float, norm: bool = True, nodes: int = 1, max_nodes: int | None = None):
    scores = logits.sigmoid()
    return _limited_topk(scores, scores + bias, 2, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes)


@registry.reference_for("fused_ops.route_softmax")
def route_softmax_reference(logits: torch.Tensor, topk: int, groups: int, topk_groups: int, route_scale: float,
                            norm: bool = True, nodes: int = 1, max_nodes: int | None = None):
    scores = logits.softmax(dim=-1)
    return _limited_topk(scores, scores, 1, topk, groups, topk_groups, route_scale, norm, nodes, max_nodes)


def _limited_topk(scores: torch.Tensor, choice: torch.Tensor, group_best: int, topk: int, groups: int,
                  topk_groups: int, route_scale: float, norm: bool, nodes: int, max_nodes: int | None):
    """Selection on ``choice`` (groups scored by their ``group_best`` largest values, then the node limit),
    weights from ``scores``."""
    if groups > 1:
        choice = _keep_best(choice, groups, group_best, topk_groups)
    if max_nodes is not None and max_nodes < nodes:
        choice = _keep_best(choice, nodes, min(choice.shape[-1] // nodes, max(1, topk // max_nodes)), max_nodes)
    indices = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) if norm else weights
    return weights * route_scale, indices, scores


def _scores_grad(scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
                 grad_scores: torch.Tensor | None, route_scale: float, norm: bool) -> torch.Tensor:
    """The scores' gradient: ``grad_scores`` plus the weights' at the picked experts (through the normalisation)."""
    picked = scores.gather(1, indices)
    g = grad_weights * route_scale
    if norm:
        total = picked.sum(-1, keepdim=True) + 1e-20
        g = (g - (g * picked).sum(-1, keepdim=True) / total) / total
    d = torch.zeros_like(scores) if grad_scores is None else grad_scores.clone()
    return d.scatter_add_(1, indices, g)


@registry.reference_for("fused_ops.route_backward")
def route_backward_reference(scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
                             grad_scores: torch.Tensor | None, route_scale: float, norm: bool = True) -> torch.Tensor:
    return _scores_grad(scores, indices, grad_weights, grad_scores, route_scale, norm) * scores * (1 - scores)


@registry.reference_for("fused_ops.route_softmax_backward")
def route_softmax_backward_reference(scores: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor,
                                     grad_scores: torch.Tensor | None, route_scale: float,
                                     norm: bool = True) -> torch.Tensor:
    d = _scores_grad(scores, indices, grad_weights, grad_scores, route_scale, norm)
    return scores * (d - (scores * d).sum(-1, keepdim=True))


# ------------------------------------------------------------------------------------------------ verify cases


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dtype(shape: dict) -> torch.dtype:
    return getattr(torch, shape.get("dtype", "bfloat16"))


def _rows(shape: dict, seed: int, device: torch.device, cols: int, scale: float = 1.0) -> torch.Tensor:
    g = _gen(seed)
    x = torch.randn(shape["rows"], cols, generator=g) * scale * torch.exp(torch.randn(shape["rows"], 1, generator=g))
    return x.to(device=device, dtype=_dtype(shape))


def _norm_case(shape: dict, seed: int, device: torch.device) -> Case:
    x = _rows(shape, seed, device, shape["dim"])
    w = (1 + 0.1 * torch.randn(shape["dim"], generator=_gen(seed + 1))).to(device=device, dtype=_dtype(shape))
    residual = _rows(shape, seed + 2, device, shape["dim"]) if shape.get("residual", True) else None
    return Case(args=(x, w, residual), kwargs={"eps": 1e-6})


def _norm_backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    x, w, residual = _norm_case(shape, seed, device).args
    h = x if residual is None else x + residual
    rstd = torch.rsqrt(h.float().square().mean(-1) + 1e-6)
    return Case(args=(h, w, rstd, _rows(shape, seed + 3, device, shape["dim"]),
                      _rows(shape, seed + 4, device, shape["dim"]) if shape.get("residual", True) else None))


def _routing_weights(shape: dict, seed: int, device: torch.device) -> torch.Tensor | None:
    return torch.rand(shape["rows"], generator=_gen(seed + 7)).to(device) if shape.get("weights", True) else None


def _swiglu_case(shape: dict, seed: int, device: torch.device) -> Case:
    return Case(args=(_rows(shape, seed, device, 2 * shape["inter"], 2.0), _routing_weights(shape, seed, device)))


def _swiglu_backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    gate_up, w = _swiglu_case(shape, seed, device).args
    return Case(args=(gate_up, w, _rows(shape, seed + 3, device, shape["inter"])))


def _rope_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = _gen(seed)
    b, s, h, d = shape["b"], shape["s"], shape["h"], shape["d"]
    x = torch.randn(b, s, h, d, generator=g).to(device=device, dtype=_dtype(shape))
    angles = torch.rand(s, d // 2, generator=g) * 100
    cos, sin = (angles.cos() * 1.2).to(device), (angles.sin() * 1.2).to(device)  # scaled as YaRN's mscale does
    return Case(args=(x, cos, sin, torch.empty_like(x)), kwargs={"interleaved": shape["interleaved"]}, outputs=(3,))


def _assignments(shape: dict, seed: int, device: torch.device):
    """(assign [M], rows [T k]) of a random top-k routing over ``experts``, 8-row alignment, rows shuffled."""
    g = _gen(seed + 5)
    t, k, e = shape["rows"], shape["k"], shape["experts"]
    indices = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    counts = torch.bincount(indices.flatten(), minlength=e)
    padded = (counts + 7) // 8 * 8
    order = indices.flatten().argsort(stable=True)
    rank = torch.arange(t * k) - (counts.cumsum(0) - counts)[indices.flatten()[order]]
    rows = torch.empty(t * k, dtype=torch.long)
    rows[order] = (padded.cumsum(0) - padded)[indices.flatten()[order]] + rank
    assign = torch.full((int(padded.sum()),), -1, dtype=torch.long)
    assign[rows] = torch.arange(t * k)
    return assign.to(device), rows.to(device)


def _permute_case(shape: dict, seed: int, device: torch.device) -> Case:
    assign, _ = _assignments(shape, seed, device)
    x = _rows(shape, seed, device, shape["dim"])
    weights = torch.rand(shape["rows"] * shape["k"], generator=_gen(seed + 6)).to(device)
    if shape.get("dtype") == "float8_e4m3fn":
        x = _rows({**shape, "dtype": "float32"}, seed, device, shape["dim"], 10.0).to(FP8)
        scales = torch.rand(shape["rows"], -(-shape["dim"] // 128), generator=_gen(seed + 8)).to(device)
        return Case(args=(x, assign, shape["k"], scales, weights))
    return Case(args=(x, assign, shape["k"]), kwargs={"weights": weights})


def _gather_rows_case(shape: dict, seed: int, device: torch.device) -> Case:
    assign, _ = _assignments(shape, seed, device)
    x = _rows(shape, seed, device, shape["dim"])
    columns = _rows({**shape, "rows": shape["rows"] * shape["k"]}, seed + 6, device, shape["columns"]) \
        if shape["columns"] else None
    return Case(args=(x, assign, shape["k"], columns))


def _dequant_case(shape: dict, seed: int, device: torch.device) -> Case:
    """Landed rows: e4m3 values with 1x128 scales over 6 decades, one all-zero row (the amax floor's scale)."""
    assign, _ = _assignments({**shape, "k": 1}, seed, device)
    x = _rows({**shape, "dtype": "float32"}, seed, device, shape["dim"], 100.0).clamp(-448, 448).to(FP8)
    x[0] = 0
    scales = torch.exp(torch.randn(shape["rows"], -(-shape["dim"] // 128), generator=_gen(seed + 8)) * 3) / 448
    scales[0] = 1e-4 / 448
    weights = torch.rand(shape["rows"], generator=_gen(seed + 6)).to(device)
    return Case(args=(x.to(device), scales.to(device), assign, _dtype(shape), weights),
                kwargs={"keep_rows": shape.get("keep_rows", True)})


def _unpermute_case(shape: dict, seed: int, device: torch.device) -> Case:
    assign, rows = _assignments(shape, seed, device)
    if shape.get("dropped"):  # assignments that were never sent: rows -1, nothing to add
        rows = torch.where(torch.arange(rows.numel(), device=device) % 5 == 1, -1, rows)
    y = _rows({**shape, "rows": assign.numel()}, seed, device, shape["dim"])
    weights = torch.rand(shape["rows"] * shape["k"], generator=_gen(seed + 6)).to(device)
    return Case(args=(y, rows, shape["k"], weights))


def _spread_case(shape: dict, seed: int, device: torch.device) -> Case:
    assign, _ = _assignments(shape, seed, device)
    y = _rows({**shape, "rows": assign.numel()}, seed, device, shape["dim"])
    grad = _rows(shape, seed + 3, device, shape["dim"])
    weights = torch.rand(shape["rows"] * shape["k"], generator=_gen(seed + 6)).to(device)
    return Case(args=(grad, y, assign, shape["k"], weights))


def _near_ties(choice: torch.Tensor, groups: int, group_best: int, gap: float, nodes: int = 1,
               node_best: int = 1) -> torch.Tensor:
    """Rows whose selection scores (or group, or node scores) have two values closer than ``gap``: there a few-ulp
    difference between two sigmoids or softmaxes (a GPU's fast ``exp``) may legitimately swap two experts."""
    scores = [choice, choice.view(len(choice), groups, -1).topk(min(group_best, choice.shape[-1] // groups),
                                                               -1).values.sum(-1),
              choice.view(len(choice), nodes, -1).topk(node_best, -1).values.sum(-1)]
    return torch.stack([(v.sort(-1).values.diff(dim=-1) < gap).any(-1) for v in scores]).any(0)


def _logits_away_from_ties(shape: dict, g: torch.Generator, choice_of) -> torch.Tensor:
    """``[rows, experts]`` logits whose selection (``choice_of(logits)``, float64) has no near-ties (>= 1e-6 apart:
    ~17 fp32 ulps of a sigmoid score, hundreds of a softmax one)."""
    logits = torch.randn(shape["rows"], shape["experts"], generator=g) * 2
    nodes, max_nodes = shape.get("nodes", 1), shape.get("max_nodes")
    best = min(shape["experts"] // nodes, max(1, shape["k"] // (max_nodes or nodes)))
    group_best = 1 if shape.get("softmax") else 2
    while (redo := _near_ties(choice_of(logits.double()), shape["groups"], group_best, 1e-6, nodes, best)).any():
        logits[redo] = torch.randn(int(redo.sum()), shape["experts"], generator=g) * 2
    return logits


def _route_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = _gen(seed)
    bias = torch.randn(shape["experts"], generator=g) * 0.1
    logits = _logits_away_from_ties(shape, g, lambda lg: lg.sigmoid() + bias.double())
    return Case(args=(logits.to(device), bias.to(device), shape["k"], shape["groups"], shape["topk_groups"], 2.5),
                kwargs={"nodes": shape.get("nodes", 1), "max_nodes": shape.get("max_nodes")})


def _route_softmax_case(shape: dict, seed: int, device: torch.device) -> Case:
    logits = _logits_away_from_ties({**shape, "softmax": True}, _gen(seed), lambda lg: lg.softmax(-1))
    return Case(args=(logits.to(device), shape["k"], shape["groups"], shape["topk_groups"], 1.0),
                kwargs={"norm": shape.get("norm", False), "nodes": shape.get("nodes", 1),
                        "max_nodes": shape.get("max_nodes")})


def _route_backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    case = _route_case(shape, seed, device)
    weights, indices, scores = route_reference.__wrapped__(*case.args, **case.kwargs)
    g = _gen(seed + 1)
    grad_scores = torch.randn(scores.shape, generator=g).to(device) if shape["rows"] % 2 else None
    return Case(args=(scores, indices, torch.randn(weights.shape, generator=g).to(device), grad_scores, 2.5))


def _route_softmax_backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    case = _route_softmax_case(shape, seed, device)
    weights, indices, scores = route_softmax_reference.__wrapped__(*case.args, **case.kwargs)
    g = _gen(seed + 1)
    grad_scores = torch.randn(scores.shape, generator=g).to(device) if shape["rows"] % 2 else None
    return Case(args=(scores, indices, torch.randn(weights.shape, generator=g).to(device), grad_scores, 1.0),
                kwargs={"norm": case.kwargs["norm"]})


def _fp8_compare(tolerance: float):
    """Values: blockwise calc_diff. FP8 outputs: dequantised (times their scales) against the reference's, so a
    1-ulp difference of the unquantised output (fp32 evaluation order) that moves a rounding counts as what it
    is; the FP8 bytes' bit-equality with DeepGEMM's cast of the same output is in tests/test_fused_ops.py."""
    from accel.numerics import tensor_error

    def compare(got: dict, want: dict) -> dict:
        out = {}
        for name, w in want.items():
            if w.dtype == FP8:
                sf = next(n for n in want if n != name and want[n].dim() == 2 and want[n].dtype == torch.float32
                          and want[n].shape[-1] == -(-w.shape[-1] // 128))

                def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
                    return q.float() * s.repeat_interleave(128, dim=-1)[:, :q.shape[-1]]

                out[name] = (tensor_error(deq(got[name], got[sf]), deq(w, want[sf])), tolerance)
            else:
                out[name] = (tensor_error(got[name], w), 0.0 if not w.is_floating_point() else tolerance)
        return out

    return compare


# Tolerances (blockwise calc_diff): kernel and reference round at the same points and differ only by fp32
# evaluation order (a sum of squares over <= 7168 terms, exp); at worst that flips one rounding of a bf16
# output (2^-9 relative) in a few elements, calc_diff ~1e-6; 1e-5 still catches a wrong row, column, scale
# or mask (>= 1e-3). fp32 outputs: relative 1e-6 at worst, calc_diff ~1e-12.
TOL = 1e-5
_ALLOW_SUM = {"aten.sum": "the weight gradient's per-program partial sums ([programs, dim] fp32) are added up "
                          "by torch after the kernel: a reduction over <= 4 * SMs rows"}


def _row_bytes(shape: dict, reads: float, writes: float, cols: str = "dim") -> float:
    return shape["rows"] * shape[cols] * (2 if shape.get("dtype", "bfloat16") == "bfloat16" else 4) * (reads + writes)


_NORM_SHAPES = [dict(rows=5, dim=384), dict(rows=3, dim=200, residual=False), dict(rows=4, dim=96, dtype="float32"),
                dict(rows=2, dim=300, dtype="float32", residual=False)]
_NORM_BENCH = [dict(rows=4096, dim=7168), dict(rows=4096, dim=1536)]
_SWIGLU_SHAPES = [dict(rows=6, inter=256), dict(rows=3, inter=200, weights=False), dict(rows=4, inter=130,
                                                                                        dtype="float32")]
_SWIGLU_BENCH = [dict(rows=32768, inter=2048), dict(rows=4096, inter=18432, weights=False)]
_ROPE_SHAPES = [dict(b=2, s=3, h=5, d=64, interleaved=True), dict(b=1, s=4, h=3, d=64, interleaved=False),
                dict(b=2, s=2, h=17, d=16, interleaved=True, dtype="float32")]
_ROPE_BENCH = [dict(b=1, s=4096, h=128, d=64, interleaved=True), dict(b=1, s=4096, h=64, d=64, interleaved=False)]
_PERMUTE_SHAPES = [dict(rows=9, k=3, experts=5, dim=384), dict(rows=7, k=2, experts=4, dim=200, dtype="float32"),
                   dict(rows=6, k=2, experts=3, dim=256, dtype="float8_e4m3fn")]
_PERMUTE_BENCH = [dict(rows=4096, k=8, experts=256, dim=7168)]
_UNPERMUTE_SHAPES = _PERMUTE_SHAPES[:2] + [dict(rows=5, k=3, experts=4, dim=130, dropped=True)]
_GATHER_ROWS_SHAPES = [dict(rows=9, k=3, experts=5, dim=384, columns=2),
                       dict(rows=7, k=2, experts=4, dim=200, dtype="float32", columns=1),
                       dict(rows=5, k=1, experts=3, dim=130, columns=0)]
_GATHER_ROWS_BENCH = [dict(rows=4096, k=8, experts=256, dim=7168, columns=2)]
_ROUTE_SHAPES = [dict(rows=9, experts=64, k=8, groups=8, topk_groups=4), dict(rows=5, experts=24, k=6, groups=3,
                                                                              topk_groups=2),
                 dict(rows=4, experts=16, k=2, groups=1, topk_groups=1),
                 dict(rows=7, experts=24, k=4, groups=1, topk_groups=1, nodes=6, max_nodes=2),
                 dict(rows=6, experts=32, k=6, groups=4, topk_groups=3, nodes=8, max_nodes=3)]
_ROUTE_BENCH = [dict(rows=4096, experts=256, k=8, groups=8, topk_groups=4)]
_ROUTE_SOFTMAX_SHAPES = [dict(rows=9, experts=64, k=6, groups=8, topk_groups=3, norm=True),  # V2's 160 / 8 / 3, scaled
                         dict(rows=5, experts=24, k=6, groups=1, topk_groups=1),  # V2-Lite: no groups, no norm
                         dict(rows=6, experts=30, k=4, groups=3, topk_groups=2, nodes=5, max_nodes=2)]
_ROUTE_SOFTMAX_BENCH = [dict(rows=4096, experts=160, k=6, groups=8, topk_groups=3, norm=True)]


def _impl(name: str) -> str:
    return f"fused_ops.kernels.{name}"


rmsnorm_op = registry.register(
    "fused_ops.rmsnorm", reference=rmsnorm_reference, triton=_impl("norm:rmsnorm"),
    verify=VerifySpec(make_case=_norm_case, shapes=_NORM_SHAPES, bench_shapes=_NORM_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: _row_bytes(s, 2, 2)))
rmsnorm_fp8_op = registry.register(
    "fused_ops.rmsnorm_fp8", reference=rmsnorm_fp8_reference, triton=_impl("norm:rmsnorm_fp8"),
    verify=VerifySpec(make_case=_norm_case, shapes=_NORM_SHAPES, bench_shapes=_NORM_BENCH, tolerance=TOL,
                      compare=_fp8_compare(TOL), bytes_moved=lambda s: _row_bytes(s, 2, 2.5)))
rmsnorm_backward_op = registry.register(
    "fused_ops.rmsnorm_backward", reference=rmsnorm_backward_reference, triton=_impl("norm:rmsnorm_backward"),
    verify=VerifySpec(make_case=_norm_backward_case, shapes=_NORM_SHAPES, bench_shapes=_NORM_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: _row_bytes(s, 3, 1), allow=_ALLOW_SUM))
swiglu_op = registry.register(
    "fused_ops.swiglu", reference=swiglu_reference, triton=_impl("swiglu:swiglu"),
    verify=VerifySpec(make_case=_swiglu_case, shapes=_SWIGLU_SHAPES, bench_shapes=_SWIGLU_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: _row_bytes(s, 2, 1, "inter")))
swiglu_fp8_op = registry.register(
    "fused_ops.swiglu_fp8", reference=swiglu_fp8_reference, triton=_impl("swiglu:swiglu_fp8"),
    verify=VerifySpec(make_case=_swiglu_case, shapes=_SWIGLU_SHAPES, bench_shapes=_SWIGLU_BENCH, tolerance=TOL,
                      compare=_fp8_compare(TOL), bytes_moved=lambda s: _row_bytes(s, 2, 0.5, "inter")))
swiglu_backward_op = registry.register(
    "fused_ops.swiglu_backward", reference=swiglu_backward_reference, triton=_impl("swiglu:swiglu_backward"),
    verify=VerifySpec(make_case=_swiglu_backward_case, shapes=_SWIGLU_SHAPES, bench_shapes=_SWIGLU_BENCH,
                      tolerance=TOL, bytes_moved=lambda s: _row_bytes(s, 3, 2, "inter")))
rope_op = registry.register(
    "fused_ops.rope", reference=rope_reference, triton=_impl("rope:rope"),
    verify=VerifySpec(make_case=_rope_case, shapes=_ROPE_SHAPES, bench_shapes=_ROPE_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: s["b"] * s["s"] * (s["h"] * s["d"] * 2 * 2 + s["d"] * 4)))
permute_gather_op = registry.register(
    "fused_ops.permute_gather", reference=permute_gather_reference, triton=_impl("permute:gather"),
    verify=VerifySpec(make_case=_permute_case, shapes=_PERMUTE_SHAPES, bench_shapes=_PERMUTE_BENCH, tolerance=0.0,
                      bytes_moved=lambda s: s["rows"] * s["k"] * s["dim"] * 2 * 2))
permute_gather_fp8_op = registry.register(
    "fused_ops.permute_gather_fp8", reference=permute_gather_fp8_reference, triton=_impl("permute:gather_fp8"),
    verify=VerifySpec(make_case=_permute_case, shapes=_PERMUTE_SHAPES[:2], bench_shapes=_PERMUTE_BENCH,
                      tolerance=0.0, bytes_moved=lambda s: s["rows"] * s["k"] * s["dim"] * 3))
gather_rows_op = registry.register(
    "fused_ops.gather_rows", reference=gather_rows_reference, triton=_impl("permute:gather_rows"),
    verify=VerifySpec(make_case=_gather_rows_case, shapes=_GATHER_ROWS_SHAPES, bench_shapes=_GATHER_ROWS_BENCH,
                      tolerance=0.0, bytes_moved=lambda s: s["rows"] * s["k"] * (s["dim"] + s["columns"]) * 2 * 2))
gather_dequant_fp8_op = registry.register(
    "fused_ops.gather_dequant_fp8", reference=gather_dequant_fp8_reference, triton=_impl("permute:gather_dequant_fp8"),
    verify=VerifySpec(make_case=_dequant_case,
                      shapes=[dict(rows=9, experts=4, dim=384), dict(rows=7, experts=3, dim=200, dtype="float32"),
                              dict(rows=5, experts=2, dim=130, keep_rows=False)],
                      bench_shapes=[dict(rows=32768, experts=32, dim=7168)], tolerance=TOL, compare=_fp8_compare(TOL),
                      bytes_moved=lambda s: s["rows"] * s["dim"] * (1 + 2 + 1)))
unpermute_sum_op = registry.register(
    "fused_ops.unpermute_sum", reference=unpermute_sum_reference, triton=_impl("permute:sum_rows"),
    verify=VerifySpec(make_case=_unpermute_case, shapes=_UNPERMUTE_SHAPES, bench_shapes=_PERMUTE_BENCH,
                      tolerance=TOL, bytes_moved=lambda s: s["rows"] * (s["k"] + 1) * s["dim"] * 2))
unpermute_spread_op = registry.register(
    "fused_ops.unpermute_spread", reference=unpermute_spread_reference, triton=_impl("permute:spread"),
    verify=VerifySpec(make_case=_spread_case, shapes=_PERMUTE_SHAPES[:2], bench_shapes=_PERMUTE_BENCH,
                      tolerance=TOL, bytes_moved=lambda s: s["rows"] * s["k"] * s["dim"] * 2 * 3))
route_op = registry.register(
    "fused_ops.route", reference=route_reference, triton=_impl("router:route"),
    verify=VerifySpec(make_case=_route_case, shapes=_ROUTE_SHAPES, bench_shapes=_ROUTE_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: s["rows"] * s["experts"] * 8))
route_backward_op = registry.register(
    "fused_ops.route_backward", reference=route_backward_reference, triton=_impl("router:route_backward"),
    verify=VerifySpec(make_case=_route_backward_case, shapes=_ROUTE_SHAPES, bench_shapes=_ROUTE_BENCH,
                      tolerance=TOL, bytes_moved=lambda s: s["rows"] * s["experts"] * 12))
route_softmax_op = registry.register(
    "fused_ops.route_softmax", reference=route_softmax_reference, triton=_impl("router:route_softmax"),
    verify=VerifySpec(make_case=_route_softmax_case, shapes=_ROUTE_SOFTMAX_SHAPES, bench_shapes=_ROUTE_SOFTMAX_BENCH,
                      tolerance=TOL, bytes_moved=lambda s: s["rows"] * s["experts"] * 8))
route_softmax_backward_op = registry.register(
    "fused_ops.route_softmax_backward", reference=route_softmax_backward_reference,
    triton=_impl("router:route_softmax_backward"),
    verify=VerifySpec(make_case=_route_softmax_backward_case, shapes=_ROUTE_SOFTMAX_SHAPES,
                      bench_shapes=_ROUTE_SOFTMAX_BENCH, tolerance=TOL,
                      bytes_moved=lambda s: s["rows"] * s["experts"] * 12))
