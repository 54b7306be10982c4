"""Leave-one-out against the public runs: which time terms and calibrated figures earn their place, and how far
off the planner is on runs it never saw.

For every run the planner can express (``planner.runs``) the step is evaluated once per setting of the two terms
that act inside the op timer (``memory_latency``, ``a2a_latency``); the other terms act on the step's parts
(``Evaluation.parts``), so a step with any set of ``TIME_TERMS`` is recombined from those four evaluations
without timing the layout again. The first calibrated figure is a ``compute scale`` on the pipeline part: the
median of (measured - per-step parts) / pipeline over the runs on the question's system (GPU model), over its
GPU family's runs where the fit has none on that system, over all runs where it has none of the family either;
fitted only on the runs not left out (``compute_scale`` is itself a term: without it the scale is 1). Per
system rather than per family: on Blackwell the family's median is the 4-layer B200 proxies', which says
nothing of 671B runs on GB200 (nested leave-one-out, benchmarks/planner.md). The other calibrated figure,
``step_overhead``, is one host cost per optimizer step shared by every run (``fit``).

Leave-one-out: each run (with the runs of its ``group``: repeats of one layout) is left out in turn, the scales
are fitted on the rest, the held-out run is predicted. ``select`` keeps a term unless dropping it lowers the
leave-one-out error (backward elimination on the mean absolute error; a tie keeps the term: it means the term
changes none of the runs, which then cannot judge it, and the time model's physics stands);
``nested`` repeats the whole selection inside each fold, so the held-out run also plays no part in choosing the
terms. ``table`` is the markdown ``recipes.plan_loo`` writes into ``benchmarks/planner.md``; ``residuals`` is
what ``recipes.plan`` reads to put a band on its answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass

from planner.band import band_for, scale_for
from planner.runs import Run, family
from planner.search import TIME_TERMS, evaluate
from training.config import TrainConfig

# candidates for leave-one-out selection: the planner's time terms; ep_overlap, which credits a run whose runtime
# overlaps EP all-to-alls across micro-batches (``layout.ep_overlap``) with hiding its exposed pipeline
# communication but the first micro-batch's (nothing of our runtime: it keeps the fit from blaming kernels for
# another runtime's overlap); compute_scale and step_overhead, the calibrated figures (``fit``)
TERMS = (*TIME_TERMS, "ep_overlap", "compute_scale", "step_overhead")
STEP_OVERHEAD_GRID = tuple(i * 0.005 for i in range(51))  # s: 0-250 ms in 5 ms (the shortest run's step: 282 ms)
TIMER_TERMS = ("memory_latency", "a2a_latency")  # act inside the op timer: one evaluation per setting


@dataclass(frozen=True)
class Parts:
    """One run's step parts for each setting of the timer terms, and what the planner knows of the question."""

    run: Run
    by_timer: dict  # frozenset of TIMER_TERMS on -> Evaluation.parts
    flops_per_token: float  # training FLOPs per token (the planner's count): the run's size


def evaluate_run(run: Run, base: TrainConfig) -> Parts:
    """The four evaluations of ``run`` (``base``: its model as a training config; memory is not checked: the run
    fitted on its machine)."""
    by_timer, flops = {}, math.nan
    for on in itertools.product((False, True), repeat=len(TIMER_TERMS)):
        timer = frozenset(t for t, o in zip(TIMER_TERMS, on) if o)
        req = run.request(base, timer | (frozenset(TIME_TERMS) - frozenset(TIMER_TERMS)))
        roomy = dataclasses.replace(req.system, memory_gib=1e9)  # the run fitted: time it whatever our estimate
        ev = evaluate(dataclasses.replace(req, system=roomy), run.planner_layout())
        if ev.status != "ok":
            raise ValueError(f"{run.name}: the planner cannot time its layout ({ev.status}: {ev.reason}); "
                             "mark it run.excluded with that reason")
        by_timer[timer] = ev.parts
        flops = ev.mfu * ev.step_time_s * run.gpus * req.system.bf16_tflops * 1e12 / (
            run.layout["global_batch"] * run.layout["seq_len"])
    return Parts(run, by_timer, flops)


def split(p: Parts, terms: frozenset[str]) -> tuple[float, float]:
    """(pipeline part incl. stragglers, per-step part) in seconds of ``p``'s step with ``terms`` on."""
    q = p.by_timer[frozenset(terms) & frozenset(TIMER_TERMS)]
    pipe = q["pipeline"]
    if "ep_overlap" in terms and p.run.layout["ep_overlap"]:
        pipe -= q["exposed_pipeline_comm"] * (1.0 - 1.0 / q["microbatches"])
    pipe *= q["straggler"] if "straggler" in terms else 1.0
    rest = (q["dp_comm"] if "dp_comm" in terms else 0.0) + (
        q["optimizer_with_passes"] if "gradient_passes" in terms else q["optimizer"])
    return pipe, rest


@dataclass(frozen=True)
class Fit:
    """The calibrated figures of one fit: compute scales (``scale_for`` keys) and the per-step overhead."""

    scales: dict[str, float]
    step_overhead_s: float = 0.0


def fit_scales(parts: list[Parts], terms: frozenset[str], overhead_s: float = 0.0) -> dict[str, float]:
    """Median of (measured - per-step part - ``overhead_s``) / pipeline part over ``parts``: per system (GPU
    model) and per GPU family, and ``"*"`` over all of them (only ``"*"`` = 1.0 without ``compute_scale``).
    System and family names differ (``planner.runs.FAMILIES``), so one dict holds both."""
    return _scales(_rows(parts, terms), "compute_scale" in terms, overhead_s)


def _rows(parts: list[Parts], terms: frozenset[str]) -> list[tuple[str, str, float, float, float]]:
    """(system, family, measured, pipeline part, per-step part) of each of ``parts`` with ``terms`` on."""
    return [(p.run.gpu, p.run.family, p.run.measured_step_s, *split(p, terms)) for p in parts]


def _scales(rows: list[tuple[str, str, float, float, float]], compute_scale: bool, overhead_s: float) -> dict:
    if not compute_scale or not rows:
        return {"*": 1.0}
    ratio: dict[str, list[float]] = {}
    for gpu, fam, measured, pipe, rest in rows:
        x = (measured - rest - overhead_s) / pipe
        for key in (gpu, fam, "*"):
            ratio.setdefault(key, []).append(x)
    return {k: statistics.median(v) for k, v in ratio.items()}


def fit(parts: list[Parts], terms: frozenset[str]) -> Fit:
    """The scales (``fit_scales``) and, with ``step_overhead``, the one per-step overhead of every run (a host
    cost per optimizer step that no term times: the step's start and end, logging, the data loader's hand-off)
    on ``STEP_OVERHEAD_GRID``, the point whose refitted scales give ``parts`` the least sum of squared log
    errors (the first such point: the smallest overhead on a tie)."""
    rows, compute_scale = _rows(parts, terms), "compute_scale" in terms
    if "step_overhead" not in terms or not parts:
        return Fit(_scales(rows, compute_scale, 0.0))
    best = None
    for c in STEP_OVERHEAD_GRID:
        scales = _scales(rows, compute_scale, c)
        err = math.fsum(math.log((pipe * scale_for(scales, gpu) + rest + c) / measured) ** 2
                        for gpu, _, measured, pipe, rest in rows)
        if best is None or err < best[0]:
            best = (err, Fit(scales, c))
    return best[1]


def predict(p: Parts, terms: frozenset[str], f: Fit) -> float:
    pipe, rest = split(p, terms)
    return pipe * scale_for(f.scales, p.run.gpu) + rest + f.step_overhead_s


def loo_errors(parts: list[Parts], terms: frozenset[str]) -> dict[str, float]:
    """Run name -> (predicted - measured) / measured with its group left out of the fit."""
    out = {}
    for p in parts:
        train = [q for q in parts if q.run.group != p.run.group]
        out[p.run.name] = predict(p, terms, fit(train, terms)) / p.run.measured_step_s - 1
    return out


def score(errors: dict[str, float]) -> float:
    return statistics.fmean(abs(e) for e in errors.values())


def select(parts: list[Parts], start: frozenset[str] = frozenset(TERMS)) -> tuple[frozenset[str], list[tuple]]:
    """Backward elimination: drop the term whose removal lowers the leave-one-out score most, only if it strictly
    lowers it (a term that changes no run of ``parts``, such as ``ep_overlap`` where no run has several
    micro-batches and the switch, cannot be judged there and stays as the time model has it),
    until none does. Returns the kept terms and the steps ``(term, score with it, score without)``."""
    kept, steps = frozenset(start), []
    while kept:
        now = score(loo_errors(parts, kept))
        trials = sorted((score(loo_errors(parts, kept - {t})), t) for t in sorted(kept))
        best, term = trials[0]
        if best >= now:
            break
        steps.append((term, now, best))
        kept = kept - {term}
    return kept, steps


def nested(parts: list[Parts]) -> dict[str, float]:
    """Leave-one-out with the term selection inside each fold: run name -> held-out error."""
    out = {}
    for p in parts:
        train = [q for q in parts if q.run.group != p.run.group]
        kept, _ = select(train)
        out[p.run.name] = predict(p, kept, fit(train, kept)) / p.run.measured_step_s - 1
    return out


def ablation(parts: list[Parts], kept: frozenset[str]) -> dict[str, float]:
    """Leave-one-out score with each candidate term toggled against ``kept``."""
    return {t: score(loo_errors(parts, kept ^ {t})) for t in TERMS}


def band_holds(parts: list[Parts], kept: frozenset[str]) -> dict[str, tuple[float, float, float]]:
    """Does the band hold for a run it never saw? Per run: its group left out, the residuals and scales are
    rebuilt from the others (``residuals``), the run is predicted and banded as ``recipes.plan`` would
    (``planner.band``). Run name -> (measured / predicted, band low, band high)."""
    out = {}
    for p in parts:
        train = [q for q in parts if q.run.group != p.run.group]
        band = band_for(residuals(train, kept), p.run.gpu, p.run.gpus, p.flops_per_token)
        out[p.run.name] = (p.run.measured_step_s / predict(p, kept, fit(train, kept)), band.low, band.high)
    return out


def residuals(parts: list[Parts], kept: frozenset[str]) -> dict:
    """What ``recipes.plan`` needs for its band: the kept terms, the scales fitted on every run, and each run's
    family, size, GPU count and leave-one-out ratio measured / predicted (JSON-ready)."""
    errors, f = loo_errors(parts, kept), fit(parts, kept)
    return {"terms": sorted(kept), "scales": f.scales, "step_overhead_s": f.step_overhead_s,
            "runs": [{"name": p.run.name, "gpu": p.run.gpu, "family": p.run.family, "gpus": p.run.gpus,
                      "flops_per_token": p.flops_per_token, "ratio": 1.0 / (1.0 + errors[p.run.name])}
                     for p in parts]}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _summary(errors: dict[str, float]) -> tuple[float, float]:
    a = [abs(e) for e in errors.values()]
    return statistics.median(a), max(a)


def table(parts: list[Parts], excluded: list[Run], kept: frozenset[str], steps: list[tuple],
          nested_errors: dict[str, float], target: tuple[float, float] = (0.10, 0.20)) -> str:
    """The markdown section: per run, per family and system, overall; the selection steps; the runs kept out of
    the fit."""
    everything = frozenset(TERMS)
    errs, all_terms = loo_errors(parts, kept), loo_errors(parts, everything)
    raw = {p.run.name: predict(p, frozenset(TIME_TERMS), Fit({"*": 1.0})) / p.run.measured_step_s - 1 for p in parts}
    held = band_holds(parts, kept)
    lines = ["| run | GPUs | model | measured s | shipped model (no fit) | LOO, all terms | LOO, kept terms | "
             "nested LOO | measured / LOO prediction in its LOO band |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for p in sorted(parts, key=lambda p: (p.run.family, p.run.name)):
        r = p.run
        ratio, lo, hi = held[r.name]
        inside = "yes" if lo <= ratio <= hi else "**no**"
        lines.append(f"| {r.name} | {r.gpus} x {r.gpu} | {r.model} | {r.measured_step_s:.3f} | {_pct(raw[r.name])} | "
                     f"{_pct(all_terms[r.name])} | {_pct(errs[r.name])} | {_pct(nested_errors[r.name])} | "
                     f"{inside}: {ratio:.3f} in [{lo:.3f}, {hi:.3f}] |")
    lines += ["", "| family / system | runs | median abs, kept | worst abs, kept | median abs, nested | "
              "worst abs, nested | target met, nested (>= 3 runs: median <= 10%, no run beyond 20%) |",
              "|---|---:|---:|---:|---:|---:|---|"]
    groups = [(f, lambda p, f=f: p.run.family == f) for f in sorted({p.run.family for p in parts})]
    groups += [(f"{g} ({family(g)})", lambda p, g=g: p.run.gpu == g) for g in sorted({p.run.gpu for p in parts})]
    for label, member in [*groups, ("all", lambda p: True)]:
        names = [p.run.name for p in parts if member(p)]
        m, w = _summary({n: errs[n] for n in names})
        nm, nw = _summary({n: nested_errors[n] for n in names})
        if len(names) < 3:
            verdict = "n/a (< 3 runs)"
        else:
            miss = [n for n in names if abs(nested_errors[n]) > target[1]]
            median = [f"median {100 * nm:.1f}%"] if nm > target[0] else []
            verdict = "yes" if not (miss or median) else f"no: {', '.join(median + miss)}"
        lines.append(f"| {label} | {len(names)} | {100 * m:.1f}% | {100 * w:.1f}% | {100 * nm:.1f}% | {100 * nw:.1f}% "
                     f"| {verdict} |")
    covered = sum(lo <= x <= hi for x, lo, hi in held.values())
    lines += ["", f"The band (``planner.band``: the nearest runs' ratios, their range widened by (n + 1) / (n - 1)) "
              f"held for {covered} of {len(held)} runs it never saw (each run's group left out of the scales, the "
              "residuals and the band)."]
    lines += ["", f"Kept terms: {', '.join(sorted(kept)) or 'none'}. Dropped, in order (mean abs LOO error with "
              "the term -> without):"]
    lines += [f"- {t}: {100 * a:.2f}% -> {100 * b:.2f}%" for t, a, b in steps] or ["- none"]
    abl = ablation(parts, kept)
    lines += ["", "Each term toggled against the kept set (mean abs LOO error): "
              + ", ".join(f"{t} {'off' if t in kept else 'on'} {100 * v:.2f}%" for t, v in abl.items())
              + f"; kept set {100 * score(errs):.2f}%."]
    f = fit(parts, kept)
    lines += ["", "Fitted on every run: compute scale per system and per family (for systems without a run) "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(f.scales.items()) if k != "*")
              + f"; every run's (for families without one) {f.scales['*']:.3f}; per-step overhead "
              + f"{1e3 * f.step_overhead_s:.0f} ms."]
    lines += ["", "Runs kept out of the fit (recorded, with the reason):", ""]
    lines += [f"- {r.name} ({r.gpus} x {r.gpu}, {r.model}): {r.excluded}" for r in excluded]
    return "\n".join(lines)
