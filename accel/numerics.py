"""The toolkit's error measures: DeepGEMM's ``calc_diff``, a blockwise variant a wrong tile cannot hide in,
and ``tensor_error`` (one output against its reference, NaN/Inf positions included).

They live in ``accel`` because the kernel packages' tests and public helpers (``deep_gemm.calc_diff``) use
them, and the kernel-admission verifier (``verifier``) scores with them.
"""

from __future__ import annotations

import math

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error ``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64 (0 = identical).

    Scale-aware (2x the reference gives 0.2) and 0 for two all-zero tensors.
    """
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


BLOCK_GRID = 8  # blockwise_diff tiles (leading dims flattened) x (last dim) into up to 8 x 8 blocks


def blockwise_diff(x: torch.Tensor, y: torch.Tensor, grid: int = BLOCK_GRID) -> float:
    """calc_diff that a wrong tile cannot hide in: the worst block's error, and never less than calc_diff.

    calc_diff equals sum((x-y)^2) / sum(x^2 + y^2), so one garbage 64x64 tile in a 4096x4096 output
    moves it by only ~2e-4, under a 1e-3 tolerance. Here each block's squared error is divided by the
    larger of its own energy and its fair share of the whole tensor's energy (numel_block / numel),
    so a wrong tile scores ~1/64 or more, while a block of near-zero reference values with tiny
    absolute errors is not blown up into a false failure. For uniform errors this equals calc_diff.
    """
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    total = (x * x + y * y).sum()
    if total == 0:
        return 0.0
    worst = calc_diff(x, y)
    if x.dim() == 0:
        return worst
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    rows, cols = x2.shape
    if rows * cols == 0:
        return worst
    for xr, yr in zip(x2.tensor_split(min(grid, rows), 0), y2.tensor_split(min(grid, rows), 0)):
        for xb, yb in zip(xr.tensor_split(min(grid, cols), 1), yr.tensor_split(min(grid, cols), 1)):
            fair_share = total * xb.numel() / x2.numel()
            energy = torch.maximum((xb * xb + yb * yb).sum(), fair_share)
            worst = max(worst, float(((xb - yb) ** 2).sum() / energy))
    return worst


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.element_size() == 1:  # fp8: go through fp32, the cast every backend implements
        t = t.to(torch.float32)
    return t.to(torch.float64)


def _nonfinite_code(t: torch.Tensor) -> torch.Tensor:
    """0 for NaN, +1 for +Inf, -1 for -Inf, 2 for finite: equal codes = equal non-finite pattern."""
    return torch.where(torch.isnan(t), 0, torch.where(torch.isinf(t), torch.sign(t).to(torch.int64), 2))


def tensor_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Error of one output: blockwise_diff over the finite elements for floats (inf when NaN/Inf
    positions differ), the fraction of differing elements for integers and bools."""
    if got.shape != want.shape:
        return math.inf
    if not (want.is_floating_point() or want.is_complex()):
        if got.numel() == 0:
            return 0.0
        return float((got.detach().to(torch.int64) != want.detach().to(torch.int64)).double().mean())
    g, w = _as_float64(got), _as_float64(want)
    if not torch.equal(_nonfinite_code(g), _nonfinite_code(w)):
        return math.inf
    finite = torch.isfinite(w)
    zero = torch.zeros((), dtype=torch.float64, device=w.device)
    # Non-finite positions already agree; zeroing them on both sides keeps the layout for the blocks.
    return blockwise_diff(torch.where(finite, g, zero), torch.where(finite, w, zero))
