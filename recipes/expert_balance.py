"""Expert-balancing experiment: train the same model under several strategies and compare load and loss.

    python -m recipes.expert_balance                                   # CPU, debug model, a few minutes
    python -m recipes.expert_balance --steps 20 --strategies none,aux_free --out runs/eb
    python -m recipes.expert_balance --text my.txt                     # another corpus (plain text)
    torchrun --nproc-per-node 8 -m recipes.expert_balance --config recipes/configs/debug_gpu.toml \\
        --set parallel.dp=8 --set parallel.ep=8 --steps 2000           # GPUs, larger sizes
    torchrun --nproc-per-node 2 -m recipes.expert_balance --strategies aux_free --eplb 2 \\
        --set parallel.dp=2 --set parallel.ep=2 --set data.micro_batch=4  # per-GPU load with and without EPLB

Every strategy starts from the same seed, data order and initial weights (``training.Trainer``
with ``[balance]`` changed, nothing else), so differences come from the strategy alone. The
report folder gets ``max_vio.png`` (MaxVio per step, one line per strategy), ``load_heatmap.png``
(share of tokens per layer x expert over the run, one panel per strategy), ``results.md`` and
``results.csv`` (final train / validation loss, MaxVio of the last steps and of the whole run) and
``<strategy>.jsonl`` (every step's metrics).

With expert parallelism (``parallel.ep > 1``) the table also has ``ep_imbalance_last``: max / mean
rows received per EP rank (the per-GPU load; 1 = even), with ``ep_imbalance.png``. ``--eplb N``
trains every strategy a second time as ``<strategy>@eplb``, with EPLB on (N redundant expert slots
per layer, re-planned every ``--eplb-interval`` steps), so the table shows what EPLB does to the
per-GPU load on top of each balancing strategy (it leaves the per-expert MaxVio and the loss alone).

Coefficients default to values that act within a short run: loss-based strategies alone use
``--alpha`` (GShard/Switch's 1e-2); ``aux_free+seq_aux`` uses V3's complementary 1e-4; the bias
speed ``--gamma`` is 1e-2 (V3 uses 1e-3 over its 14.8T tokens).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from accel.cli import (
    BAD_INPUT,
    ArgumentParser,
    check_output_dir,
    nonnegative_float,
    nonnegative_int,
    positive_int,
)

DEFAULT_STRATEGIES = ("none", "aux", "seq_aux", "aux_free", "aux_free+seq_aux")
# the CPU default: the debug model on the bundled corpus, one process, plain gradient accumulation
CPU_DEFAULTS = [
    "model.preset=debug", "model.fp8=false", "model.overrides.n_layers=3", "model.overrides.n_dense_layers=1",
    "parallel.schedule=none", "data.seq_len=64", "data.global_batch=8", "data.micro_batch=8",
    "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=10", "logging.wandb=disabled",
    "logging.progress=false", "run.sample_prompt=''",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.expert_balance", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="TOML training config (default: the CPU debug setup)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable), e.g. --set model.preset=bench_cpu")
    ap.add_argument("--steps", type=positive_int, default=40, help="optimizer steps per strategy")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help="comma-separated BalanceConfig strategies")
    ap.add_argument("--alpha", type=nonnegative_float, default=1e-2,
                    help="balance-loss coefficient of 'aux' / 'seq_aux' alone")
    ap.add_argument("--alpha-complementary", type=nonnegative_float, default=1e-4,
                    help="balance-loss coefficient when combined with aux_free (V3: 1e-4)")
    ap.add_argument("--gamma", type=nonnegative_float, default=1e-2, help="aux-loss-free bias update speed")
    ap.add_argument("--text", default=None, help="train on this text file instead of the bundled corpus")
    ap.add_argument("--eval-batches", type=positive_int, default=4, help="validation batches for the final loss")
    ap.add_argument("--out", default=None, help="report folder (default runs/expert_balance-<time>)")
    ap.add_argument("--eplb", type=nonnegative_int, default=None, metavar="REDUNDANT",
                    help="also train every strategy with EPLB on, this many redundant expert slots per layer "
                         "(needs parallel.ep > 1)")
    ap.add_argument("--eplb-interval", type=positive_int, default=5, help="steps between EPLB re-plans (with --eplb)")
    return ap.parse_args(argv)


def strategy_overrides(strategy: str, ns: argparse.Namespace) -> list[str]:
    parts = set(strategy.split("+"))
    alpha = ns.alpha_complementary if "aux_free" in parts else ns.alpha
    return [f"balance.strategy='{strategy}'", f"balance.alpha={alpha}", f"balance.gamma={ns.gamma}"]


def build_config(ns: argparse.Namespace, strategy: str, eplb: bool = False):
    from training.config import load_config

    base = [] if ns.config else list(CPU_DEFAULTS)
    if ns.text:
        base.append(f"data.source='{Path(ns.text).resolve()}'")
    extra = ["eplb.enabled=true", f"eplb.redundant_experts={ns.eplb}", f"eplb.interval={ns.eplb_interval}"] \
        if eplb else []
    return load_config(ns.config, base + list(ns.overrides) + strategy_overrides(strategy, ns) + extra +
                       [f"run.steps={ns.steps}", f"logging.eval_batches={ns.eval_batches}", "checkpoint.interval=0",
                        "checkpoint.final=false"])


def build_configs(ns: argparse.Namespace, strategies: list[str]) -> dict[str, Any]:
    """Run name -> validated config: each strategy, and ``<strategy>@eplb`` with ``--eplb``."""
    from training.eplb import check_eplb
    from training.trainer import check_static, model_args

    if ns.text and not Path(ns.text).is_file():
        raise ValueError(f"--text {ns.text!r}: no such file (expected a plain text file)")
    if ns.out:
        check_output_dir(ns.out, "--out")
    configs = {}
    for s in strategies:
        configs[s] = build_config(ns, s)
        if ns.eplb is not None:
            configs[f"{s}@eplb"] = build_config(ns, s, eplb=True)
    for cfg in configs.values():
        check_eplb(cfg, model_args(cfg))
    # world size (torchrun's, else 1), data files and corpus size: the same for every strategy
    check_static(next(iter(configs.values())), int(os.environ.get("WORLD_SIZE", "1")))
    return configs


def run_strategy(cfg, ps, out: Path) -> dict[str, Any]:
    """Train one strategy; return its per-step history and final figures (every rank)."""
    from training.trainer import Trainer, check_static

    trainer = Trainer(cfg, ps, out, "disabled", check_static(cfg))
    steps, t0 = [], time.perf_counter()
    for _ in range(cfg.run.steps):
        m = trainer.train_step()
        steps.append({"step": trainer.step, "loss": m["loss"], "max_vio": m.get("max_vio", float("nan")),
                      "ep_imbalance": m.get("ep_imbalance", float("nan")),
                      **{k: v for k, v in m.items() if k.startswith("balance_")},
                      "expert_load": m.get("expert_load")})
    tail = steps[-min(10, len(steps)):]
    loads = [s["expert_load"] for s in steps if s["expert_load"] is not None]
    total = torch.tensor(loads, dtype=torch.float64).sum(0) if loads else None  # [layers, experts]
    return {
        "steps": steps,
        "final_loss": sum(s["loss"] for s in tail) / len(tail),
        "valid_loss": trainer.evaluate(cfg.logging.eval_batches) if trainer.corpus.num_valid else float("nan"),
        "max_vio_last": sum(s["max_vio"] for s in tail) / len(tail),
        "ep_imbalance_last": sum(s["ep_imbalance"] for s in tail) / len(tail),
        "max_vio_global": (float((total.amax(-1) / total.mean(-1) - 1).mean()) if total is not None
                           else float("nan")),
        "load_total": total,
        "seconds": time.perf_counter() - t0,
    }


def _plot_per_step(plt, results: dict[str, dict[str, Any]], key: str, ylabel: str, path: Path) -> None:
    """One line per run of ``key`` over the steps."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        ax.plot([s["step"] for s in r["steps"]], [s[key] for s in r["steps"]], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict[str, dict[str, Any]], out: Path) -> None:
    """PNGs, Markdown and CSV tables, per-strategy JSONL (rank 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    _plot_per_step(plt, results, "max_vio", "MaxVio (batch, mean over MoE layers)", out / "max_vio.png")
    if any(math.isfinite(s["ep_imbalance"]) for r in results.values() for s in r["steps"]):
        _plot_per_step(plt, results, "ep_imbalance", "max / mean rows per EP rank (mean over MoE layers)",
                       out / "ep_imbalance.png")

    names = [n for n, r in results.items() if r["load_total"] is not None]
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names) + 1.2, 2.8), squeeze=False,
                                 layout="constrained")
        shares = {n: results[n]["load_total"] / results[n]["load_total"].sum(-1, keepdim=True) for n in names}
        vmax = max(float(s.max()) for s in shares.values())
        for k, (ax, n) in enumerate(zip(axes[0], names)):
            layers, experts = shares[n].shape
            im = ax.imshow(shares[n].numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=vmax,
                           interpolation="nearest")
            ax.set_title(n, fontsize=9)
            ax.set_xlabel("expert")
            ax.set_yticks(range(layers))
            ax.set_xticks(range(0, experts, max(1, experts // 8)))
            if k == 0:
                ax.set_ylabel("MoE layer (MTP last)")
        fig.colorbar(im, ax=axes[0].tolist(), label="share of the layer's tokens", shrink=0.9)
        fig.savefig(out / "load_heatmap.png", dpi=120)
        plt.close(fig)

    columns = ["strategy", "final_loss", "valid_loss", "max_vio_last", "max_vio_global", "ep_imbalance_last", "seconds"]
    rows = [{"strategy": n, **{c: r[c] for c in columns[1:]}} for n, r in results.items()]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r["strategy"] if c == "strategy" else f"{r[c]:.4g}" for c in columns) + " |"
              for r in rows]
    notes = ("final_loss: mean train loss of the last 10 steps; valid_loss: held-out batches at the end; "
             "max_vio_last: mean batch MaxVio (max load / mean load - 1, averaged over MoE layers) of the last "
             "10 steps; max_vio_global: MaxVio of the loads summed over the whole run; ep_imbalance_last: max / "
             "mean rows received per expert-parallel rank (the per-GPU load EPLB balances; nan without EP), last "
             "10 steps.")
    (out / "results.md").write_text("# Expert-balancing experiment\n\n" + "\n".join(lines) + f"\n\n{notes}\n")
    for n, r in results.items():
        with open(out / f"{n.replace('+', '_plus_').replace('@', '_')}.jsonl", "w") as f:
            for s in r["steps"]:
                f.write(json.dumps(s) + "\n")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    strategies = [s.strip() for s in ns.strategies.split(",") if s.strip()]
    try:
        if not strategies:
            raise ValueError("--strategies: give at least one strategy")
        configs = build_configs(ns, strategies)  # every config validated before training
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT

    from training.parallel import init_parallel, shutdown

    first = next(iter(configs.values()))
    ps = init_parallel(first.parallel, first.run.timeout_s)
    out = Path(ns.out or f"{first.run.runs_root}/expert_balance-{time.strftime('%Y%m%d-%H%M%S')}")
    results = {}
    for name, cfg in configs.items():
        if ps.rank == 0:
            print(f"[{name}] training {cfg.run.steps} steps ...", flush=True)
        results[name] = run_strategy(cfg, ps, out)
        if ps.rank == 0:
            r = results[name]
            print(f"[{name}] loss {r['final_loss']:.4f}  valid {r['valid_loss']:.4f}  MaxVio last "
                  f"{r['max_vio_last']:.3f}  global {r['max_vio_global']:.3f}  EP rank imbalance "
                  f"{r['ep_imbalance_last']:.3f}  ({r['seconds']:.0f} s)", flush=True)
    if ps.rank == 0:
        write_report(results, out)
        print((out / "results.md").read_text())
        print(f"report: {out}")
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
