"""The grouped layout the routed experts' GEMMs read: tokens copied once per chosen expert into
expert-contiguous blocks (DeepGEMM's "contiguous" layout: each expert's rows padded to the alignment,
pad rows indexed -1), and the way back. Shared by the one-rank MoE and expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

import fused_ops
from models.deepseek_v3.layers import Precast

_ZERO_TILE_SCALE = 1e-4 / 448  # DeepGEMM's 1x128 scale of an all-zero tile: max(amax, 1e-4) / 448


@dataclass
class PermuteState:
    """How to undo ``permute``: where each (token, slot) assignment sits in the grouped buffer."""

    rows: torch.Tensor  # [T * k] row of assignment (t, j) in x_grouped, at index t * k + j
    num_tokens: int
    tokens_per_expert: torch.Tensor  # [E] int64, unpadded
    layout: fused_ops.Grouping | None = None  # set when the rows moved through fused_ops (unpermute does too)


def permute(x: torch.Tensor, indices: torch.Tensor, num_experts: int, alignment: int,
            fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, PermuteState]:
    """Copy each token once per chosen expert into expert-contiguous groups padded to ``alignment`` rows.

    x ``[T, D]``, indices ``[T, k]`` (values in ``[0, num_experts)``) -> ``x_grouped [M, D]`` (pad rows 0),
    ``m_indices [M]`` (expert of each row, -1 for padding) and the state ``unpermute`` needs. ``fused``: the
    same layout, rows moved by ``fused_ops.permute`` (one kernel each way) where it runs
    (``fused_ops.permute_tokens`` decides).
    """
    grouped = fused_ops.permute_tokens(x, indices, num_experts, alignment, fused)
    return grouped.x_grouped, grouped.m_indices, PermuteState(rows=grouped.rows, num_tokens=indices.shape[0],
                                                              tokens_per_expert=grouped.tokens_per_expert,
                                                              layout=grouped.layout)


class _GroupedStandIn(torch.autograd.Function):
    """``[M, d]`` of x's dtype with no storage per row, standing for the grouped rows of ``x``; backward is
    permute's: each token's rows' gradients summed (``fused_ops.unpermute``, the fused permute's own backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: fused_ops.Grouping) -> torch.Tensor:
        ctx.layout = layout
        return x.new_zeros(()).expand(layout.assign.numel(), x.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return fused_ops.unpermute(grad, ctx.layout), None


def permute_fp8(x: torch.Tensor, indices: torch.Tensor, num_experts: int, alignment: int,
                x_fp8: Precast | None = None) -> tuple[torch.Tensor, Precast, torch.Tensor, PermuteState]:
    """``permute`` for an FP8 grouped GEMM that keeps its input's cast for the weight gradient (``fp8_cache``),
    where the fused kernels run: ``(x_grouped, its 1x128 cast, m_indices, state)``.

    The rows move once, as e4m3 with their scales: cast on the way (``fused_ops.permute(fp8=True)``, the cast
    the GEMM would make of the grouped rows, bit for bit) or, given ``x_fp8`` (x's cast, from the norm), moved
    with its scales. The bf16 grouped rows are never materialised: that GEMM reads only the cast, keeps it for
    its wgrad, and its dgrad needs no input, so ``x_grouped`` is a stand-in without storage (a broadcast zero)
    that carries the rows' gradient back to ``x``. Read its values and you read zeros.
    """
    layout = fused_ops.grouping(indices, num_experts, alignment)
    if x_fp8 is None:
        values, scales, _ = fused_ops.permute(x.detach(), layout, fp8=True)
    else:
        values, scales, _ = fused_ops.permute(x_fp8[0].reshape(x.shape), layout,
                                              scales=x_fp8[1].reshape(x.shape[0], -1))
        # padding rows come with zero scales; the GEMM takes only positive ones: a zero tile's, as the cast makes
        scales = torch.where((layout.assign >= 0).unsqueeze(1), scales, _ZERO_TILE_SCALE)
    state = PermuteState(rows=layout.rows, num_tokens=layout.num_tokens, tokens_per_expert=layout.tokens_per_expert,
                         layout=layout)
    return _GroupedStandIn.apply(x, layout), (values, scales), layout.m_indices, state


def group_weights(weights: torch.Tensor, state: PermuteState, num_rows: int) -> torch.Tensor:
    """The routing weights ``[T, k]`` of each assignment at its row of the grouped layout: ``[num_rows]``,
    0 on padding rows (differentiable; backward gathers the rows' gradients back)."""
    return weights.new_zeros(num_rows).index_put((state.rows,), weights.reshape(-1))


def unpermute(y_grouped: torch.Tensor, state: PermuteState, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Gather each assignment's expert output and sum them per token, weighted by ``weights [T, k]`` when
    given (None: the rows are already weighted, see ``Experts.forward``)."""
    if state.layout is not None:
        return fused_ops.unpermute(y_grouped, state.layout, weights)
    k = state.rows.numel() // max(state.num_tokens, 1) if weights is None else weights.shape[-1]
    y = y_grouped[state.rows].view(state.num_tokens, k, y_grouped.shape[-1])  # k explicit: T may be 0
    if weights is None:
        return y.sum(dim=1)
    return (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)  # 2x faster than a [T] batch of 1xk bmm on CPU
