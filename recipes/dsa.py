"""DeepSeek-V3 -> V3.2: both DSA stages from a V3 checkpoint, with the indexer's loss and recall plotted.

    python -m recipes.dsa [--v3 HF_FOLDER] [--out runs/dsa] [--warmup-steps 60] [--sparse-steps 60] [--set k=v ...]

Without ``--v3`` it first trains the V3 model of ``recipes/configs/dsa_base_cpu.toml`` and exports it
(``recipes.export_hf``). Then, each through the real CLI (``recipes.train``) and each exported for the next:

1. the dense warm-up (``dsa_warmup_cpu.toml``): a fresh indexer per layer learns the main attention's
   distribution, everything else frozen;
2. the sparse stage (``dsa_sparse_cpu.toml``): attention reads each query's top-k keys, the whole model trains;
3. for comparison, the V3 model continued densely from the same weights with the sparse stage's
   optimizer settings, steps and data.

Reports the warm-up's indexer KL and top-k recall (first and last 5 steps), and the sparse stage's training
loss (mean of the last 10 steps) and validation loss against dense continuation; writes ``dsa.png`` (indexer
KL and recall over the warm-up, both stages' losses) and ``dsa.json`` into ``--out``. ``--set`` overrides
apply to every run (``--set parallel.pp=2`` ...: the configs' layout keys).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_dir, positive_int
from recipes.benchutil import export_hf, load_option, print_report, run_training
from training.config import load_config
from training.trainer import check_static

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "recipes" / "configs"
QUIET = ["logging.progress=false", "logging.wandb=disabled", "run.sample_tokens=0"]


def valid_loss(run_dir: Path) -> float:
    """The run's final validation loss (``summary.json``: ``logging.eval_batches`` held-out batches)."""
    return json.loads((run_dir / "summary.json").read_text())["valid_loss"]


def mean(records: list[dict], key: str, part: slice) -> float:
    values = [m[key] for m in records if key in m][part]
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.dsa", description=__doc__.split("\n")[0])
    ap.add_argument("--v3", default=None, help="HF folder of the DeepSeek-V3 model to start from (default: train "
                                               "dsa_base_cpu.toml first)")
    ap.add_argument("--base-steps", type=positive_int, default=150, help="steps of the V3 run (without --v3)")
    ap.add_argument("--warmup-steps", type=positive_int, default=60, help="steps of the dense warm-up")
    ap.add_argument("--sparse-steps", type=positive_int, default=60, help="steps of the sparse stage (and of the "
                                                                          "dense continuation it is compared with)")
    ap.add_argument("--warmup-config", default=str(CONFIGS / "dsa_warmup_cpu.toml"))
    ap.add_argument("--sparse-config", default=str(CONFIGS / "dsa_sparse_cpu.toml"))
    ap.add_argument("--base-config", default=str(CONFIGS / "dsa_base_cpu.toml"),
                    help="the V3 model's config: trains it without --v3, and runs the dense continuation")
    ap.add_argument("--out", default="runs/dsa", help="folder (new or empty) for the runs, exports, plot and JSON")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key of every run (repeatable)")
    ns = ap.parse_args(argv)
    out = Path(ns.out).absolute()
    sets = QUIET + ns.overrides
    try:
        sparse_optim = {k: v for k, v in vars(load_option("--sparse-config", ns.sparse_config).optim).items()
                        if k in ("lr", "min_lr", "warmup_steps")}
        dense_sets = sets + [f"run.steps={ns.sparse_steps}"] + [f"optim.{k}={v}" for k, v in sparse_optim.items()]
        check_output_dir(str(out), "--out", must_be_empty=True)
        if ns.v3 is not None and not (Path(ns.v3) / "config.json").is_file():
            raise ValueError(f"--v3 {ns.v3}: no config.json there; expected an HF checkpoint folder")
        for option, config, extra in (("--warmup-config", ns.warmup_config, [f"run.steps={ns.warmup_steps}"]),
                                      ("--sparse-config", ns.sparse_config, [f"run.steps={ns.sparse_steps}"]),
                                      ("--base-config", ns.base_config, dense_sets)):
            cfg = load_option(option, config, sets + extra)
            check_static(cfg, cfg.run.nproc)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    out.mkdir(parents=True, exist_ok=True)

    def train(config: str, name: str, extra: list[str]) -> list[dict]:
        cfg = load_config(config, sets + extra)
        print(f"== {name}: {Path(config).name}, {cfg.run.steps} steps", flush=True)
        return run_training(str(Path(config).absolute()), cfg.run.nproc, sets + extra, out / name)

    v3 = Path(ns.v3).absolute() if ns.v3 else None
    if v3 is None:
        train(ns.base_config, "v3", [f"run.steps={ns.base_steps}"])
        v3 = export_hf(out / "v3", out / "v3_hf")
    warm = train(ns.warmup_config, "warmup", [f"run.steps={ns.warmup_steps}", f"model.init_from={v3}"])
    warm_hf = export_hf(out / "warmup", out / "warmup_hf")
    sparse = train(ns.sparse_config, "sparse", [f"run.steps={ns.sparse_steps}", f"model.init_from={warm_hf}"])
    dense = train(ns.base_config, "dense", [*dense_sets[len(sets):], f"model.init_from={v3}"])

    first, last = slice(0, 5), slice(-5, None)
    tail = slice(-min(10, ns.sparse_steps), None)
    result = {
        "warmup_kl_first": mean(warm, "indexer_kl", first), "warmup_kl_last": mean(warm, "indexer_kl", last),
        "warmup_recall_first": mean(warm, "indexer_recall", first),
        "warmup_recall_last": mean(warm, "indexer_recall", last),
        "sparse_loss": mean(sparse, "loss", tail), "dense_loss": mean(dense, "loss", tail),
        "sparse_valid_loss": valid_loss(out / "sparse"), "dense_valid_loss": valid_loss(out / "dense"),
        "sparse_kl_last": mean(sparse, "indexer_kl", last),
    }
    result["sparse_vs_dense"] = (result["sparse_loss"] - result["dense_loss"]) / result["dense_loss"]
    result["sparse_vs_dense_valid"] = ((result["sparse_valid_loss"] - result["dense_valid_loss"])
                                       / result["dense_valid_loss"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_rec, ax_loss) = plt.subplots(1, 3, figsize=(14, 4))
    ax_kl.plot([m["step"] for m in warm], [m["indexer_kl"] for m in warm], label="warm-up (all causal keys)")
    ax_kl.plot([m["step"] for m in sparse], [m["indexer_kl"] for m in sparse], label="sparse (selected keys)")
    ax_kl.set_yscale("log")
    ax_kl.set_title("indexer loss KL(p || softmax(I))")
    ax_rec.plot([m["step"] for m in warm], [m["indexer_recall"] for m in warm])
    ax_rec.set_title("warm-up: recall of the main attention's top-k")
    ax_loss.plot([m["step"] for m in sparse], [m["loss"] for m in sparse], label="sparse (top-k)")
    ax_loss.plot([m["step"] for m in dense], [m["loss"] for m in dense], label="dense continuation")
    ax_loss.set_title(f"training loss: sparse vs dense {result['sparse_vs_dense'] * 100:+.2f}%")
    for ax in (ax_kl, ax_rec, ax_loss):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_kl.legend()
    ax_loss.legend()
    fig.tight_layout()
    fig.savefig(out / "dsa.png", dpi=110)
    rows = [{"stage": "warm-up", "what": "indexer KL", "first": result["warmup_kl_first"],
             "last": result["warmup_kl_last"]},
            {"stage": "warm-up", "what": "top-k recall", "first": result["warmup_recall_first"],
             "last": result["warmup_recall_last"]},
            {"stage": "sparse", "what": "train loss (last 10)", "first": result["dense_loss"],
             "last": result["sparse_loss"]},
            {"stage": "sparse", "what": "valid loss", "first": result["dense_valid_loss"],
             "last": result["sparse_valid_loss"]}]
    (out / "dsa.json").write_text(json.dumps({"result": result, "rows": rows}, indent=2) + "\n")
    print_report("DeepSeek-V3 -> V3.2 (DSA): warm-up then sparse training", rows,
                 notes=["warm-up rows: first = mean of the first 5 steps, last = of the last 5",
                        "sparse rows: first = dense continuation, last = sparse stage (same start, steps, data)",
                        f"sparse vs dense: training loss {result['sparse_vs_dense'] * 100:+.2f}%, validation loss "
                        f"{result['sparse_vs_dense_valid'] * 100:+.2f}%",
                        f"plot: {out / 'dsa.png'}"])
    return OK


if __name__ == "__main__":
    sys.exit(main())
