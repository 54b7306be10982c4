"""Tolerances for fp32 results that differ from a reference only in the order of their sums.

A multi-process run, another CPU (AMD or Intel), another MKL/OpenBLAS kernel or another thread
count adds the same fp32 terms in another order. Summing ``n`` terms in any order is within
``gamma_n * sum|terms|`` of the exact sum, with ``gamma_n = n u / (1 - n u)`` and ``u = 2**-24``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2), so two orders
differ by at most twice that. The outputs do not show ``sum|terms|``; for a dot product of
length ``n`` of independent random factors it is about ``sqrt(n)`` times the largest output
(the output is a random walk of ``n`` terms; the absolute sum grows like ``n``). A result
computed through ``depth`` such sums in a row accumulates one such error per level.

So the tolerance scales with the tensor's own magnitude and the reduction lengths, not with this
machine: ``atol = 2 * depth * gamma_n * sqrt(n) * max|expected|``. A real bug (a wrong row, a
dropped term, a missing scale) moves results by 1e-2 of their magnitude or more, far outside it.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # fp32 unit roundoff


def reorder_atol(expected: torch.Tensor | float, reduction: int, depth: int = 1) -> float:
    """Largest difference between two fp32 evaluations of ``expected`` that differ only in summation
    order: ``depth`` chained sums of at most ``reduction`` terms each (see the module docstring)."""
    if reduction < 1 or depth < 1:
        raise ValueError(f"reduction and depth must be >= 1, got reduction={reduction}, depth={depth}")
    scale = float(expected.detach().abs().max()) if isinstance(expected, torch.Tensor) else abs(float(expected))
    gamma = reduction * U32 / (1 - reduction * U32)
    return 2 * depth * gamma * math.sqrt(reduction) * scale


def assert_reorder_close(actual: torch.Tensor, expected: torch.Tensor, reduction: int, depth: int = 1,
                         msg: str | None = None) -> None:
    """``assert_close`` with :func:`reorder_atol` as the absolute tolerance and no relative term
    (a relative term would let elements near zero pass anything their magnitude allows)."""
    atol = reorder_atol(expected, reduction, depth)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol,
                               msg=lambda m: f"{msg + ': ' if msg else ''}{m}\n(fp32 reorder bound: reduction "
                                             f"{reduction}, depth {depth}, atol {atol:.3g})")


# ---- FP8 (e4m3) ------------------------------------------------------------------------------------------
E4M3_MANTISSA_BITS = 3
# One cast to e4m3 rounds a value m * 2^e (1 <= m < 2, normal range) to the nearest of 2^3 steps per binade: the
# error is uniform within half a step, 2^(e-4), so its relative variance is (2^-4 / m)^2 / 3, largest at m = 1:
E4M3_REL_VAR = (2.0 ** -(E4M3_MANTISSA_BITS + 1)) ** 2 / 3  # 1.30e-3 (Gaussian inputs average 3/(8 ln 2) of it)


def fp8_calc_diff_bound(casts: int, reduction: int, samples: int) -> float:
    """Bound on ``calc_diff(result, exact)`` for a product whose operands went through ``casts`` e4m3 roundings
    in all (a GEMM of two cast operands: 2; the wgrad of the FP8 Linear, whose X is cast twice: 3).

    Each output sums ``reduction`` terms a_i b_i (1 + d_i), d_i the terms' summed relative cast errors of variance
    ``casts_per_term * E4M3_REL_VAR``. For inputs of random sign the output and its error are both random walks of
    the ``reduction`` terms, so their power ratio ``casts * E4M3_REL_VAR`` is independent of the length, and
    calc_diff ~ ||err||^2 / (2 ||y||^2) is half of it; same-sign inputs make the output grow like the length and
    the ratio shrink, so random signs are the worst case. fp32 accumulation adds (2 gamma_reduction)^2, negligible.
    ``samples`` outputs estimate that mean with a relative spread ~ sqrt(2 / samples): the bound allows 6 of it.
    """
    if casts < 1 or reduction < 1 or samples < 1:
        raise ValueError(f"casts, reduction and samples must be >= 1, got {casts}, {reduction}, {samples}")
    gamma = reduction * U32 / (1 - reduction * U32)
    return (casts * E4M3_REL_VAR / 2 + (2 * gamma) ** 2) * (1 + 6 * math.sqrt(2 / samples))
