"""An error band on every answer: the leave-one-out residuals of the public runs nearest to the question.

``recipes.plan_loo`` writes, for each public run the planner can express, its system, GPU family, GPU count,
size (training FLOPs per token) and leave-one-out ratio measured / predicted, plus the figures fitted on all runs
(``planner.loo.residuals``): the compute scales (per system, per family, overall) and the per-step overhead. A
question's calibrated step is the planner's with the pipeline part scaled by its system's figure (its family's
where no run is on that system; ``scale_for``), plus the overhead. Its nearest runs are those of its GPU family
whose size is within ``SIZE_FACTOR`` of its own; the band comes from their ratios (from every run's, too, when
fewer than ``MIN_NEAREST`` are near: a spread of two or three runs says little): the range of the n ratios (in
log space) widened about its middle by (n + 1) / (n - 1). The bare min / max of n runs cannot cover the next
extreme (a new exchangeable run falls outside n runs' range with probability 2 / (n + 1)); of the rules tried
on runs held out (min / max, this, a Student-t 90% prediction interval, the largest |log ratio| widened alike)
this held for as many runs as any on the final calibration and, unlike min / max, kept its coverage on the
calibration before it, for two points more width (benchmarks/planner.md, "Reading it"). Where no run shares the
family, or none is of a similar size, or the GPU count lies beyond the runs', the answer says it lies outside
every run it has seen (and the band comes from the runs it falls back on).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from planner.runs import RUNS_DIR, family
from planner.search import Evaluation, Request, tokens_per_step

RESIDUALS = RUNS_DIR / "loo.json"
SIZE_FACTOR = 3.0  # a run is of a "similar size" within this factor of the question's training FLOPs per token
MIN_NEAREST = 5  # with fewer nearest runs their spread says little: the band also spans every run's residual


@dataclass(frozen=True)
class Band:
    """Calibration and band for one question (a system, a GPU count, a model size)."""

    scale: float  # the system's (family's) compute scale on the pipeline part
    scale_of: str  # whose scale it is: the system's name, its family's, or "every run"
    step_overhead_s: float  # the fitted host cost per optimizer step
    low: float  # the band's lower measured / predicted ratio (``widened_range`` of the nearest runs' ratios)
    high: float  # its upper one
    nearest: tuple[str, ...]  # the runs the band comes from
    outside: str  # why the question lies outside every run seen ("" when it does not)
    widened: bool  # fewer than MIN_NEAREST nearest runs: the band spans every run's residual too

    def step(self, ev: Evaluation, req: Request) -> tuple[float, float, float]:
        """(calibrated step, low, high) seconds of ``ev``."""
        pipe = ev.parts["pipeline"] * (ev.parts["straggler"] if "straggler" in req.terms else 1.0)
        cal = ev.step_time_s + (self.scale - 1.0) * pipe + self.step_overhead_s
        return cal, cal * self.low, cal * self.high

    def tokens_per_gpu(self, ev: Evaluation, req: Request) -> tuple[float, float, float]:
        """(calibrated, low, high) tokens/s per GPU of ``ev`` (low from the slow end of the band)."""
        cal, lo, hi = self.step(ev, req)
        per = tokens_per_step(req) / req.gpus
        return per / cal, per / hi, per / lo


def scale_key(scales: dict[str, float], gpu: str) -> str:
    """Whose compute scale a question on ``gpu`` takes: its system's (GPU model's), else its GPU family's, else
    every run's (``"*"``; ``planner.loo.fit_scales``)."""
    return gpu if gpu in scales else family(gpu) if family(gpu) in scales else "*"


def scale_for(scales: dict[str, float], gpu: str) -> float:
    """The compute scale of a question on ``gpu`` (``scale_key``)."""
    return scales[scale_key(scales, gpu)]


def load_residuals(path: Path = RESIDUALS) -> dict:
    """The residuals document; ValueError naming the file when it is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text())
        if not (isinstance(doc["runs"], list) and doc["runs"] and isinstance(doc["scales"], dict)):
            raise KeyError("runs")
        if not (isinstance(doc["step_overhead_s"], (int, float)) and doc["step_overhead_s"] >= 0):
            raise KeyError("step_overhead_s")
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r}: no leave-one-out residuals; run python -m recipes.plan_loo") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(path)!r}: not a residuals file of recipes.plan_loo ({exc})") from None
    return doc


def band_for(residuals: dict, gpu: str, gpus: int, flops_per_token: float) -> Band:
    """The band of a question on ``gpus`` GPUs of the shipped system ``gpu`` at ``flops_per_token``."""
    runs, fam = residuals["runs"], family(gpu)
    same = [r for r in runs if r["family"] == fam]
    why = []
    if not same:
        why.append(f"no public run on a {fam} GPU (band from all {len(runs)} runs)")
        same = runs
    near = [r for r in same if abs(math.log(r["flops_per_token"] / flops_per_token)) <= math.log(SIZE_FACTOR)]
    if not near:
        lo, hi = (min(r["flops_per_token"] for r in same), max(r["flops_per_token"] for r in same))
        why.append(f"its size ({flops_per_token / 1e9:.3g} GFLOP per token) is beyond {SIZE_FACTOR:g}x of the runs' "
                   f"{lo / 1e9:.3g}-{hi / 1e9:.3g}")
        near = sorted(same, key=lambda r: abs(math.log(r["flops_per_token"] / flops_per_token)))[:3]
    counts = [r["gpus"] for r in near]
    if not min(counts) <= gpus <= max(counts):
        why.append(f"{gpus} GPUs lies beyond the nearest runs' {min(counts)}-{max(counts)}")
    pool = near if len(near) >= MIN_NEAREST else near + [r for r in runs if r not in near]
    low, high = widened_range([r["ratio"] for r in pool])
    scales = residuals["scales"]
    key = scale_key(scales, gpu)
    return Band(scales[key], "every run" if key == "*" else key, residuals["step_overhead_s"], low, high,
                tuple(r["name"] for r in near), "; ".join(why), len(near) < MIN_NEAREST)


def widened_range(ratios: list[float]) -> tuple[float, float]:
    """(low, high): the range of ``ratios`` in log space widened about its middle by (n + 1) / (n - 1) for n
    ratios (the bare range for one)."""
    logs = [math.log(r) for r in ratios]
    n, mid, half = len(logs), (max(logs) + min(logs)) / 2, (max(logs) - min(logs)) / 2
    half *= (n + 1) / (n - 1) if n > 1 else 1.0
    return math.exp(mid - half), math.exp(mid + half)
