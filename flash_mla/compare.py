"""How flash_mla's attention outputs are compared with their references (the decode, sparse prefill and sparse
decode ops share it): FlashMLA's cosine pass mark on ``out``, a relative bound on the log-sum-exp."""

from __future__ import annotations

import math

import torch

from accel.numerics import calc_diff


def compare_decode(got, want) -> dict[str, tuple[float, float]]:
    """out: cosine diff < 1e-5 (FlashMLA's pass mark); lse: max relative error < 1e-5 over finite entries,
    with Inf/NaN in the same places (an error of inf when they differ).

    Where |lse| < 1 the error is taken relative to 1: an absolute lse error is already the relative error
    of the softmax normaliser, and a row seeing one key has lse = its score, which may be ~0.
    """
    if isinstance(got, dict):  # verifier.verify names a returned tuple's tensors out[0], out[1]
        got, want = (got["out[0]"], got["out[1]"]), (want["out[0]"], want["out[1]"])
    (out, lse), (ref_out, ref_lse) = got, want
    out_err = math.inf if not torch.isfinite(out).all() else calc_diff(out, ref_out)
    same_special = torch.equal(torch.isnan(lse), torch.isnan(ref_lse)) and torch.equal(
        torch.isinf(lse) & (lse > 0), torch.isinf(ref_lse) & (ref_lse > 0)) and torch.equal(
        torch.isinf(lse) & (lse < 0), torch.isinf(ref_lse) & (ref_lse < 0))
    finite = torch.isfinite(ref_lse)
    rel = ((lse[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp_min(1.0)).max().item() \
        if finite.any() else 0.0
    return {"out": (out_err, 1e-5), "lse": (rel if same_special else math.inf, 1e-5)}
