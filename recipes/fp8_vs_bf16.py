"""FP8 vs BF16 training of the same DeepSeek-V3 over several seeds: the loss gap with a confidence interval.

    python -m recipes.fp8_vs_bf16 [--steps 60] [--seeds 3] [--window 20] [--threshold 0.25]
                                  [--recipes blockwise[,mxfp8][,muon][,mxfp4_qat]] [--nproc 1]
                                  [--out runs/fp8_vs_bf16] [--set k=v ...]

For each seed the same model is trained once without FP8 (bf16 autocast on a GPU, fp32 on a CPU) and once
per FP8 recipe (``model.fp8=true``: attention projections and expert GEMMs block-scaled in deep_gemm; with
the MXFP8 recipe, ``model.fp8_recipe``, when the config has it). ``--recipes muon,mxfp4_qat`` compares
DeepSeek-V4's choices the same way: Muon against AdamW (``optim.name``) and MXFP4 quantisation-aware routed
experts against BF16 ones (``model.expert_weight_format``), each without FP8. The seed sets the initial weights and the
data order, and both runs of a seed share them: the gap of a seed is a paired difference, so most of the
run-to-run noise cancels. Per window of ``--window`` steps and per seed, the relative gap is
``mean(FP8 loss) / mean(BF16 loss) - 1``; across the seeds this prints the mean gap and the 95% Student-t
interval (``mean +- t(0.975, n-1) * sd / sqrt(n)``, sd over the n per-seed gaps). The verdict uses the last
window: *within* when the whole interval lies inside +-threshold (DeepSeek-V3 report: 0.25%), *outside*
when it lies wholly outside, else *inconclusive* (more seeds or steps would decide). Writes
``fp8_vs_bf16.png`` (mean loss curves with the seed range; the gap per window with its interval) and
``fp8_vs_bf16.json``. A run already complete under ``--out`` (its ``summary.json`` written, every step logged) is
read instead of trained again, so a study cut short continues where it stopped (or is summarised with fewer
``--seeds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_dir, positive_int
from recipes.benchutil import context, run_training
from training.config import ModelConfig, TrainConfig, load_config
from training.trainer import check_static

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

ROOT = Path(__file__).resolve().parent.parent
BASE = ["logging.progress=false", "logging.wandb=disabled", "checkpoint.final=false", "checkpoint.interval=0",
        "run.sample_tokens=0", "logging.eval_batches=2"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]
BASELINE = "bf16"
FP8_RECIPES = ("blockwise", "mxfp8")
# the other variants compared with the same baseline (no FP8, AdamW, BF16 experts): DeepSeek-V4's optimizer and
# expert precision, one config key each
OTHER_VARIANTS = {"muon": "Muon", "mxfp4_qat": "MXFP4 QAT experts"}
VARIANTS = FP8_RECIPES + tuple(OTHER_VARIANTS)


def has_recipe_field() -> bool:
    """Whether the config has ``model.fp8_recipe`` (the MXFP8 recipe's switch)."""
    return "fp8_recipe" in {f.name for f in dataclasses.fields(ModelConfig)}


def default_recipes() -> list[str]:
    """Block-scaled FP8 always; MXFP8 too where the config can select it."""
    return list(FP8_RECIPES) if has_recipe_field() else ["blockwise"]


def parse_recipes(text: str) -> list[str]:
    """``--recipes`` as a list; ValueError naming the option for an unknown or unavailable recipe."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in names if r not in VARIANTS]
    if not names or bad:
        raise ValueError(f"--recipes must be a comma-separated subset of {', '.join(VARIANTS)}, got {text!r}")
    if any(r == "mxfp8" for r in names) and not has_recipe_field():
        raise ValueError(f"--recipes {text!r}: this checkout has no model.fp8_recipe (the MXFP8 recipe); "
                         "only 'blockwise' can run here")
    return list(dict.fromkeys(names))


def variant(nproc: int, steps: int, seed: int, recipe: str, overrides: list[str],
            config: str | None = None) -> list[str]:
    """The ``--set`` overrides of one run: ``recipe`` is ``bf16`` (no FP8), an FP8 recipe, ``muon``
    (``optim.name = "muon"`` at the config's AdamW LR and weight decay: Moonlight's RMS-matched scale makes them
    carry over) or ``mxfp4_qat`` (``model.expert_weight_format``); the last two without FP8."""
    layout = SINGLE if nproc == 1 else []
    fp8 = recipe in FP8_RECIPES
    sets = [f"model.fp8={str(fp8).lower()}"]
    if fp8 and has_recipe_field():
        sets.append(f"model.fp8_recipe={recipe}")
    if recipe == "muon":
        optim = load_config(config, overrides).optim
        sets += ['optim.name="muon"', f"optim.muon_lr={optim.lr!r}", f"optim.muon_weight_decay={optim.weight_decay!r}"]
    if recipe == "mxfp4_qat":
        sets.append('model.expert_weight_format="mxfp4_qat"')
    return BASE + layout + [f"run.steps={steps}", f"run.seed={seed}"] + sets + overrides


# ---------------------------------------------------------------- the statistics


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """Student-t quantile by bisection on its CDF (the density integrated with Simpson's rule, float64).

    Needs no scipy; exact to ~1e-9 for the df >= 1 a seed count gives."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(t: float, n: int = 2000) -> float:  # 0.5 + integral of the density over [0, t]
        h = t / n
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass
class WindowGap:
    """The relative loss gap over steps ``[start, end)`` (1-based step numbers, end exclusive) across seeds."""

    start: int
    end: int
    mean: float  # mean over seeds of the per-seed relative gap
    half_width: float  # of the 95% t-interval (nan with one seed)
    per_seed: list[float]

    @property
    def n(self) -> int:
        return len(self.per_seed)


def window_gaps(fp8: Sequence[Sequence[float]], base: Sequence[Sequence[float]], window: int,
                confidence: float = 0.95) -> list[WindowGap]:
    """Per window of ``window`` steps: each seed's ``mean(fp8) / mean(base) - 1``, their mean and t-interval.

    ``fp8[s]`` and ``base[s]`` are seed ``s``'s per-step losses (same length); a last partial window counts
    when it has at least half a window of steps."""
    if len(fp8) != len(base) or not fp8:
        raise ValueError(f"need the same number (>= 1) of FP8 and baseline curves, got {len(fp8)} and {len(base)}")
    steps = min(min(len(c) for c in fp8), min(len(c) for c in base))
    if steps < 1 or window < 1:
        raise ValueError(f"need curves with >= 1 step and window >= 1, got {steps} steps, window {window}")
    n = len(fp8)
    t = t_quantile(0.5 + confidence / 2, n - 1) if n > 1 else math.nan
    out = []
    for a in range(0, steps, window):
        b = min(a + window, steps)
        if b - a < max(1, window // 2) and out:
            break
        gaps = [sum(f[a:b]) / sum(r[a:b]) - 1.0 for f, r in zip(fp8, base)]
        mean = sum(gaps) / n
        sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1)) if n > 1 else math.nan
        out.append(WindowGap(a + 1, b + 1, mean, t * sd / math.sqrt(n), gaps))
    return out


def verdict(gap: WindowGap, threshold: float) -> str:
    """``within`` when the whole interval lies in (-threshold, threshold), ``outside`` when it lies wholly beyond
    it, else ``inconclusive`` (one seed has no interval: always inconclusive)."""
    if math.isnan(gap.half_width):
        return "inconclusive"
    if abs(gap.mean) + gap.half_width < threshold:
        return "within"
    if abs(gap.mean) - gap.half_width > threshold:
        return "outside"
    return "inconclusive"


def baseline_name(cfg: TrainConfig, long: bool) -> str:
    """What the baseline run is, from its config (``--set`` may change it): ``BF16`` (short, beside an FP8 recipe)
    or ``AdamW + BF16 experts`` (long, beside Muon or MXFP4) for the default; e.g. ``AdamW + FP8 (blockwise)
    experts`` with ``--set model.fp8=true``."""
    precision = f"FP8 ({cfg.model.fp8_recipe})" if cfg.model.fp8 else "BF16"
    fmt = cfg.model.expert_weight_format
    if not long and cfg.optim.name == "adamw" and fmt == "bf16":
        return precision
    optimizer = {"adamw": "AdamW", "muon": "Muon"}.get(cfg.optim.name, cfg.optim.name)
    return f"{optimizer} + {precision} {'experts' if fmt == 'bf16' else f'{fmt} experts'}"


def verdict_line(recipe: str, gap: WindowGap, threshold: float, size: str, baseline: TrainConfig) -> str:
    """The one line a user reads; ``baseline``: the baseline run's config (named by ``baseline_name``)."""
    name = (f"{OTHER_VARIANTS[recipe]} vs {baseline_name(baseline, True)}" if recipe in OTHER_VARIANTS
            else f"FP8 ({recipe}) vs {baseline_name(baseline, False)}")
    return (f"{name} at {size}: gap {gap.mean * 100:+.3f}% +- {gap.half_width * 100:.3f}% "
            f"(95% t-interval) over {gap.n} seeds, steps {gap.start}-{gap.end - 1}: "
            f"{verdict(gap, threshold)} {threshold * 100:g}%")


# ---------------------------------------------------------------- the runs


def losses(config: str, nproc: int, overrides: list[str], run_dir: Path, steps: int) -> list[float]:
    """The per-step training losses of one run: read when ``run_dir`` holds that run complete, else trained."""
    metrics = run_dir / "metrics.jsonl"
    if (run_dir / "summary.json").is_file() and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short: it starts again
        records = run_training(config, nproc, overrides, run_dir)
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}  # a replayed step: last
    curve = [by_step[k] for k in sorted(by_step)]
    if len(curve) != steps:
        raise SystemExit(f"{run_dir}: {len(curve)} logged steps, expected {steps} (a folder of another study? "
                         "choose another --out)")
    return curve


def check_inputs(ns: argparse.Namespace) -> None:
    """Every run's config, world size, data and the output folder, before any run starts (ValueError)."""
    check_output_dir(ns.out, "--out")
    ns.recipes = parse_recipes(ns.recipes)
    if ns.window > ns.steps:
        raise ValueError(f"--window ({ns.window}) must be <= --steps ({ns.steps})")
    if not 0 < ns.threshold < 100:
        raise ValueError(f"--threshold must be a percentage in (0, 100), got {ns.threshold}")
    for recipe in [BASELINE, *ns.recipes]:
        check_static(load_config(ns.config, variant(ns.nproc, ns.steps, ns.seed, recipe, ns.overrides, ns.config)),
                     ns.nproc)


def size_text(ns: argparse.Namespace) -> str:
    """Model and token counts of one run, for the verdict line."""
    cfg = load_config(ns.config, variant(ns.nproc, ns.steps, ns.seed, BASELINE, ns.overrides))
    args, _ = check_static(cfg, ns.nproc)
    params = args.param_counts()
    tokens = sum(cfg.global_batch_at(s) for s in range(ns.steps)) * cfg.data.seq_len
    return (f"{cfg.model.preset} {args.n_layers} layers dim {args.dim} ({params['total'] / 1e6:.2f}M params, "
            f"{params['activated'] / 1e6:.2f}M active), {ns.steps} steps x {tokens // ns.steps} tokens")


def plot(curves: dict[str, list[list[float]]], gaps: dict[str, list[WindowGap]], threshold: float,
         path: Path) -> None:
    """Left: mean loss per step over seeds with the seeds' min-max band. Right: gap per window, 95% interval."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, runs in curves.items():
        steps = min(len(r) for r in runs)
        xs = range(1, steps + 1)
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(steps)]
        ax.plot(xs, mean, label=name)
        ax.fill_between(xs, [min(r[i] for r in runs) for i in range(steps)],
                        [max(r[i] for r in runs) for i in range(steps)], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"mean over {len(next(iter(curves.values())))} seeds (band: min-max)")
    ax.grid(alpha=0.3)
    ax.legend()
    for k, (name, rows) in enumerate(gaps.items()):
        mid = [(g.start + g.end - 1) / 2 + k * 0.6 for g in rows]
        bx.errorbar(mid, [g.mean * 100 for g in rows], yerr=[g.half_width * 100 for g in rows], fmt="o-",
                    capsize=3, label=f"{name} vs {BASELINE}")
    for y in (-threshold * 100, threshold * 100):
        bx.axhline(y, color="red", ls="--", lw=1)
    bx.axhline(0, color="grey", lw=0.8)
    bx.set_xlabel("step (window centre)")
    bx.set_ylabel("relative loss gap (%)")
    bx.set_title(f"gap per window, 95% t-interval over seeds (red: +-{threshold * 100:g}%)")
    bx.grid(alpha=0.3)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.fp8_vs_bf16", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "tiny_cpu.toml"),
                    help="TOML training config of every run")
    ap.add_argument("--nproc", type=positive_int, default=1, help="processes per run")
    ap.add_argument("--steps", type=positive_int, default=60, help="training steps per run")
    ap.add_argument("--seeds", type=positive_int, default=3, help="seeds (each trains every variant)")
    ap.add_argument("--seed", type=int, default=1234, help="first seed (then seed+1, ...)")
    ap.add_argument("--window", type=positive_int, default=20, help="steps per gap window (the verdict: the last)")
    ap.add_argument("--threshold", type=float, default=0.25, help="verdict threshold, percent relative gap")
    ap.add_argument("--recipes", default=",".join(default_recipes()),
                    help=f"variants to compare with BF16 + AdamW, comma-separated from {', '.join(VARIANTS)} "
                         "(default: every FP8 recipe this checkout has)")
    ap.add_argument("--out", default="runs/fp8_vs_bf16", help="folder for the runs, the plot and the JSON")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key of every run (repeatable)")
    ns = ap.parse_args(argv)
    # the runs start in the checkout's root (benchutil.run_training): paths relative to here must not move
    ns.config, ns.out = str(Path(ns.config).absolute()), str(Path(ns.out).absolute())
    try:
        check_inputs(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    threshold = ns.threshold / 100
    names = [BASELINE, *ns.recipes]
    curves: dict[str, list[list[float]]] = {name: [] for name in names}
    for i in range(ns.seeds):
        seed = ns.seed + i
        for name in names:
            sets = variant(ns.nproc, ns.steps, seed, name, ns.overrides, ns.config)
            curves[name].append(losses(ns.config, ns.nproc, sets, out / f"seed{seed}" / name, ns.steps))
            print(f"seed {seed} {name}: final loss {curves[name][-1][-1]:.4f}", flush=True)
    gaps = {name: window_gaps(curves[name], curves[BASELINE], ns.window) for name in ns.recipes}
    plot(curves, gaps, threshold, out / "fp8_vs_bf16.png")
    size = size_text(ns)
    base = load_config(ns.config, variant(ns.nproc, ns.steps, ns.seed, BASELINE, ns.overrides, ns.config))
    lines = [verdict_line(name, rows[-1], threshold, size, base) for name, rows in gaps.items()]
    print(f"== {', '.join(ns.recipes)} vs {baseline_name(base, True)}: relative training-loss gap per window, mean "
          "over seeds +- 95% t-interval ==")
    print(", ".join(f"{k}={v}" for k, v in context().items()))
    for name, rows in gaps.items():
        for g in rows:
            print(f"  {name:9s} steps {g.start:4d}-{g.end - 1:4d}: {g.mean * 100:+.3f}% +- {g.half_width * 100:.3f}%"
                  f"  (per seed: {', '.join(f'{x * 100:+.3f}' for x in g.per_seed)})")
    print(f"note: baseline '{BASELINE}' is bf16 autocast on a GPU, fp32 on a CPU; "
          f"seeds {ns.seed}..{ns.seed + ns.seeds - 1}")
    print(f"plot: {out / 'fp8_vs_bf16.png'}")
    for line in lines:
        print(line)
    (out / "fp8_vs_bf16.json").write_text(json.dumps({
        "context": context(), "size": size, "seeds": list(range(ns.seed, ns.seed + ns.seeds)), "window": ns.window,
        "threshold": threshold, "verdicts": lines, "curves": curves,
        "gaps": {name: [dataclasses.asdict(g) for g in rows] for name, rows in gaps.items()}}, indent=1))
    return OK


if __name__ == "__main__":
    sys.exit(main())
