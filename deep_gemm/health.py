"""FP8 health: what the e4m3 casts of each FP8 GEMM lose, counted per layer, GEMM and operand.

An ``Fp8Health`` collector is owned by whoever trains (``training.trainer.Trainer``) and handed to the FP8
layers (``attach``: each FP8 module's ``health`` attribute); ``deep_gemm.linear`` reports every cast it makes
while the collector is ``active`` (the trainer turns it on for one step in N), and does nothing otherwise.

Per cast (``observe``) of a tensor ``x`` into e4m3 values ``q`` with one fp32 scale per tile:
  underflow   nonzero values of ``x`` whose e4m3 value is 0 (lost entirely)
  subnormal   nonzero values whose e4m3 value lies below e4m3's smallest normal, 2^-6 (fewer than 3
              mantissa bits left: relative error up to 2^-9 / |q| instead of 2^-4)
  amax        log2 of each tile's amax (scale x 448) over the tiles holding a nonzero value: min, mean, max
  floored     tiles whose amax is below DeepGEMM's floor (1e-4; with UE8M0 scales, the floor's scale rounded up
              to a power of two): their scale is the floor's, not amax/448, so
              their values are scaled as if the tile were larger and sink into the subnormal range or to 0.
              ``hidden`` counts those values that became 0: the underflow a healthy-looking scale hides, which
              is where weight gradients (tiny dY in 128x1 tiles along the tokens) go
Fractions are of the nonzero values (tiles: of the tiles holding a nonzero value). A report samples the first
cast of each layer, GEMM and operand (one micro-batch); the counts stay on the device until ``counts`` reads
them all at once, so a reporting step costs four cheap passes per sampled cast and one host read, and any other
step a Python attribute test per GEMM. ``merge_counts`` adds reports of several ranks.

The FP4 casts are counted alike (``deep_gemm.mxfp4``: 32-blocks as tiles, the scale's exponent floor as the
floor, E2M1's one subnormal as the subnormals): the MXFP4 QAT experts' weights (``observe_mxfp4``, keyed by the
weight, operand ``w``) and the V3.2 / V4 lightning indexer's q and k after the Hadamard rotation
(``indexer_qk_format = "mxfp4_hadamard"``; ``observe_fp4_act``, keyed by the indexer module, GEMM ``fwd``, operands
``q`` and ``k``: the q . k scoring's inputs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deep_gemm.mxfp4 import fp4_act_cast_counts, mxfp4_cast_counts
from deep_gemm.reference import AMAX_FLOOR, ceil_to_ue8m0
from deep_gemm.utils import FP8_MAX, cast_count_row

E4M3_MIN_NORMAL = 2.0 ** -6
_E4M3_FIRST_NORMAL_BITS = 0b0000_1000  # exponent field 1, mantissa 0: 2^-6
GEMMS = ("fwd", "dgrad", "wgrad")
# counts per (layer, gemm, operand): summed fields, then the min and max of log2 amax
_FIELDS = ("values", "underflow", "subnormal", "tiles", "floored", "hidden", "log2_amax_sum")
_N = len(_FIELDS)


@dataclass
class HealthRow:
    """One (layer, GEMM, operand) over the reported steps; fractions in [0, 1]."""

    layer: str
    gemm: str
    operand: str
    values: int
    underflow: float
    subnormal: float
    floored: float
    hidden: float
    log2_amax_min: float
    log2_amax_mean: float
    log2_amax_max: float


def cast_counts(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[values, underflow, subnormal, tiles, floored, hidden, sum log2 amax, min, max]`` of one cast.

    ``x`` is what was cast (with or without the zero padding to ``q``'s shape), ``q`` its e4m3 values, ``scales``
    one per tile; the tile shape (1x128, 128x1 or 128x128) follows from the shapes. Leading dims (groups) are
    folded. A nonzero e4m3 value comes from a nonzero input, so underflow = nonzero inputs - nonzero outputs;
    e4m3's bits ``s eeee mmm`` make zero, subnormal and normal a test of the byte without its sign (0, 1..7,
    8 and up): four cheap passes."""
    rows, cols = q.shape[-2:]
    tr = 1 if scales.shape[-2] == rows else math.ceil(rows / scales.shape[-2])
    tc = 1 if scales.shape[-1] == cols else math.ceil(cols / scales.shape[-1])
    shape = (-1, scales.shape[-2], tr, scales.shape[-1], tc)
    magnitude = (q.view(torch.uint8) & 0x7F).reshape(shape)
    nonzero = x != 0
    if nonzero.shape != q.shape:  # the padding is zeros: pad the mask, not the tensor
        nonzero = F.pad(nonzero, (0, cols - nonzero.shape[-1], 0, rows - nonzero.shape[-2]))
    tile_nz = nonzero.reshape(shape).sum(dim=(2, 4))
    tile_under = tile_nz - (magnitude != 0).sum(dim=(2, 4))
    subnormal = (magnitude != 0).sum() - (magnitude >= _E4M3_FIRST_NORMAL_BITS).sum()
    live = tile_nz > 0
    amax = scales.float().reshape(tile_nz.shape) * FP8_MAX
    # the floor's scale is 1e-4 / 448 (fp32 scales), or that rounded up to a power of two (UE8M0 scales)
    ue8m0 = (torch.frexp(scales.float())[0] == 0.5).all()
    floor = torch.where(ue8m0, ceil_to_ue8m0(torch.tensor(AMAX_FLOOR / FP8_MAX)).to(q.device) * FP8_MAX,
                        torch.tensor(AMAX_FLOOR, device=q.device))
    floored = live & (amax <= floor * (1 + 1e-6))  # up to the scale's fp32 rounding
    return cast_count_row(tile_nz.sum(), tile_under.sum(), subnormal, live.sum(), floored.sum(),
                          (tile_under * floored).sum(), torch.log2(amax[live].double()))


class Fp8Health:
    """Cast statistics of every attached FP8 layer while ``active``; ``counts`` reads and resets them.

    ``attach(modules)`` hands the collector to each module with a ``health`` attribute and ``fp8`` on (the
    FP8 Linear and the grouped experts), MXFP4 QAT weights (``weight_format``) or FP4 q and k (an indexer's
    ``qk_fp4``), and names weights by their parameter names, modules by their module names."""

    def __init__(self) -> None:
        self.active = False
        self._names: dict[int, str] = {}
        self._acc: dict[tuple[str, str, str], torch.Tensor] = {}

    def attach(self, modules: Iterable[nn.Module]) -> int:
        """Hand the collector to the FP8 layers under ``modules``; returns how many layers got it."""
        n = 0
        for root in modules:
            for name, p in root.named_parameters():
                self._names.setdefault(id(p), name.removesuffix(".weight"))
            for name, m in root.named_modules():
                self._names.setdefault(id(m), name)
                quantised = (getattr(m, "fp8", False) or getattr(m, "weight_format", "") == "mxfp4_qat"
                             or getattr(m, "qk_fp4", False))
                if hasattr(m, "health") and quantised:
                    m.health = self
                    n += 1
        return n

    def observe(self, weight: torch.Tensor, gemm: str, operand: str, x: torch.Tensor,
                cast: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Count one cast of ``x`` (padded or not) into ``cast`` = (e4m3 values, scales) for ``weight``'s layer: the
        first of each (layer, GEMM, operand) per report, i.e. one micro-batch of a reporting step (a sample, at
        1 / micro-batches of the cost of counting them all; the weight's forward cast is the same in each)."""
        key = (self._names.get(id(weight), f"unnamed[{tuple(weight.shape)}]"), gemm, operand)
        if key not in self._acc:
            with torch.no_grad():
                self._acc[key] = cast_counts(x.detach(), *cast)

    def observe_mxfp4(self, weight: torch.Tensor, gemm: str, operand: str, x: torch.Tensor) -> None:
        """``observe`` for an MXFP4 cast of ``x`` (``deep_gemm.mxfp4``: 32-blocks with E8M0 scales): the same
        counts, the blocks as tiles and E8M0's exponent floor as the scale floor."""
        key = (self._names.get(id(weight), f"unnamed[{tuple(weight.shape)}]"), gemm, operand)
        if key not in self._acc:
            with torch.no_grad():
                self._acc[key] = mxfp4_cast_counts(x.detach())

    def observe_fp4_act(self, module: nn.Module, gemm: str, operand: str, x: torch.Tensor) -> None:
        """``observe`` for V4's FP4 activation cast of ``x`` (``deep_gemm.mxfp4.fp4_act_fake_quant``: power-of-two
        scales per 32 with an amax floor of 6 x 2^-126) made by ``module`` (keyed by its name): the indexer's
        rotated q and k."""
        key = (self._names.get(id(module), f"unnamed {type(module).__name__}"), gemm, operand)
        if key not in self._acc:
            with torch.no_grad():
                self._acc[key] = fp4_act_cast_counts(x.detach())

    def counts(self) -> dict[str, list[float]]:
        """The raw counts since the last call, keyed ``layer|gemm|operand`` (one host read), then reset."""
        if not self._acc:
            return {}
        keys = list(self._acc)
        values = torch.stack([self._acc[k].cpu() for k in keys]).tolist()
        self._acc.clear()
        return {"|".join(k): v for k, v in zip(keys, values)}


def merge_counts(parts: Iterable[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Counts of several ranks (or reports) as one: sums added, min of mins, max of maxes."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for k, v in part.items():
            o = out.get(k)
            out[k] = list(v) if o is None else [a + b for a, b in zip(o[:_N], v[:_N])] + [
                min(o[_N], v[_N]), max(o[_N + 1], v[_N + 1])]
    return out


def rows(counts: dict[str, list[float]]) -> list[HealthRow]:
    """Counts as fractions, sorted by layer, GEMM (fwd, dgrad, wgrad) and operand."""
    out = []
    for key, c in counts.items():
        layer, gemm, operand = key.split("|")
        values, tiles = max(c[0], 1.0), max(c[3], 1.0)
        out.append(HealthRow(layer, gemm, operand, int(c[0]), c[1] / values, c[2] / values, c[4] / tiles,
                             c[5] / values, c[7], c[6] / tiles, c[8]))
    order = {g: i for i, g in enumerate(GEMMS)}
    return sorted(out, key=lambda r: (r.layer, order.get(r.gemm, 9), r.operand))
