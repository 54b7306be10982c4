"""Plan a DeepSeek-V3 or V4 training layout: ``python -m recipes.plan --gpu H800 --gpus 2048 ...`` (``dsv3-plan``).

    python -m recipes.plan --model deepseek_v3_671b --gpu H800 --gpus 2048 --gpus-per-node 8 \\
        --seq-len 4096 --global-batch 15360 --write-config best.toml
    python -m recipes.plan --model recipes/configs/tiny_cpu.toml --gpu H100 --gpus 8 \\
        --fix pp=1,dp=8,ep=8,schedule=none,micro_batch=1,microbatches=4,fp8=false
    python -m recipes.plan calibrate --out system.json      # on a GPU machine

Enumerates the legal layouts (PP, DP, EP over DP, micro-batch size and count, schedule, recompute,
FP8, EPLB slots), drops those that do not fit (memory from ``planner.memory``, as ``recipes.train
--dry-run``), times the rest with the per-operation model and ``dualpipe.simulator``, and prints them
ranked. ``--model`` is a preset (``deepseek_v4_flash`` plans V4: ``planner.memory_v4``, ``planner.costs_v4``), a
Hugging Face ``config.json`` (V3 or V4) or a training TOML (whose other settings the written config keeps); ``--set``
changes it as ``recipes.train --set`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from accel.cli import (
    BAD_INPUT,
    ArgumentParser,
    check_output_file,
    nonnegative_float,
    positive_float,
    positive_int,
)
from dualpipe.timeline import chrome_trace
from models.deepseek_v3 import ModelArgs
from models.deepseek_v4 import ModelArgs as V4ModelArgs
from models.deepseek_v4.args import hf_model_type
from planner.band import band_for, load_residuals
from planner.calibrate import main as calibrate_main
from planner.costs import RECOMPUTE_POLICIES
from planner.search import (
    LAYOUT_KEYS,
    SEARCH_SCHEDULES,
    Evaluation,
    Request,
    Space,
    evaluate,
    nearest_misses,
    search,
    to_config,
    tokens_per_step,
)
from planner.system import System, known_systems, load_system
from recipes.benchutil import load_option
from training.config import TrainConfig, load_config
from training.trainer import model_args

# 2^20 GPUs: far beyond any cluster built, and a search the planner completes; the layout enumeration walks the
# GPU count's divisors, which for counts like 2^40 would not finish
MAX_GPUS = 1 << 20
_INT_KEYS = ("pp", "dp", "ep", "micro_batch", "microbatches", "eplb", "vpp")
_BOOL_KEYS = ("fp8", "zero1")
_STR_KEYS = {"schedule": ("none", *SEARCH_SCHEDULES), "recompute": tuple(RECOMPUTE_POLICIES),
             "moments": ("bfloat16", "param")}


def parse_fix(text: str | None) -> dict:
    """``"pp=1,dp=8,fp8=false"`` -> {"pp": 1, "dp": 8, "fp8": False}; ValueError naming a bad key or value."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        if "=" not in item:
            raise ValueError(f"--fix expects key=value pairs separated by commas, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in LAYOUT_KEYS:
            raise ValueError(f"--fix: unknown layout key {key!r}; expected some of {', '.join(LAYOUT_KEYS)}")
        if key in _INT_KEYS:
            if not value.isdigit() or (int(value) < 1 and key != "eplb"):
                raise ValueError(f"--fix {key}: expected a positive integer, got {value!r}")
            out[key] = int(value)
        elif key in _BOOL_KEYS:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--fix {key}: expected true or false, got {value!r}")
            out[key] = value.lower() == "true"
        else:
            choices = _STR_KEYS[key]
            if value not in choices:
                raise ValueError(f"--fix {key}: expected one of {', '.join(choices)}, got {value!r}")
            out[key] = value
    return out


def _int_list(text: str) -> list[int]:
    """argparse type of ``--micro-batches`` / ``--eplb-slots``: comma-separated integers >= 0."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def _schedule_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in SEARCH_SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {bad or text!r}; expected some of "
                                         f"{', '.join(SEARCH_SCHEDULES)}")
    return names


def base_config(model: str, overrides: list[str]) -> TrainConfig:
    """The training config the plan starts from: a TOML as given, else defaults with the preset / HF model."""
    path = Path(model)
    if path.is_file() and path.suffix not in (".toml", ".json"):
        raise ValueError(f"--model {model!r}: expected a preset name, a Hugging Face config.json (or its folder) "
                         "or a training .toml")
    if path.suffix == ".toml":
        return load_option("--model", path, overrides)  # the file is --model here, not --config
    if (path.suffix == ".json" or path.is_dir()) and _model_type(path) == "deepseek_v4":
        return _v4_base(path, overrides)
    if path.suffix == ".json" or path.is_dir():
        args = ModelArgs.from_hf_config(path)
        ref = ModelArgs()
        changed = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs)
                   if f.name not in ("extra", "fp8", "recompute", "recompute_layers")
                   and getattr(args, f.name) != getattr(ref, f.name)}
        table_sets = [f"model.overrides.{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in changed.items()]
        return load_config(None, ["model.preset=deepseek_v3_671b", *_CLUSTER_DATA, *table_sets, *overrides])
    return load_config(None, [f"model.preset={model}", *_CLUSTER_DATA, *overrides])


def _model_type(path: Path) -> str | None:
    """``model_type`` of an HF config (a ``.json`` file or a folder holding ``config.json``), None when unreadable
    (``from_hf_config`` then names why)."""
    if path.is_dir():
        return hf_model_type(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def _v4_base(path: Path, overrides: list[str]) -> TrainConfig:
    """A DeepSeek-V4 ``config.json``: the ``deepseek_v4_flash`` preset with every architecture field it changes."""
    args = V4ModelArgs.from_hf_config(path)
    ref = V4ModelArgs.preset("deepseek_v4_flash")
    skip = ("extra", "fp8", "fused_ops", "expert_weight_format", "recompute", "recompute_layers")
    sets = []
    for f in dataclasses.fields(V4ModelArgs):
        value = getattr(args, f.name)
        if f.name in skip or value == getattr(ref, f.name) or value is None:
            continue
        if isinstance(value, bool):
            text = str(value).lower()
        else:
            text = json.dumps(list(value) if isinstance(value, tuple) else value)  # TOML's int, float, list, string
        sets.append(f"model.overrides.{f.name}={text}")
    return load_config(None, ["model.preset=deepseek_v4_flash", *_CLUSTER_DATA, *sets, *overrides])


# A preset or HF model plans a cluster job: its written config points at shards to be filled in (the dry run
# reports them missing, a launch refuses until they exist) instead of the small bundled corpus, and trains in
# V3's precision: BF16 working weights with FP32 master weights in the (ZeRO-1 sharded) optimizer.
_CLUSTER_DATA = ["data.source=data/shards/*.bin", "data.bin_dtype=uint32", "run.dtype=bfloat16",
                 "optim.master_dtype=float32"]


def _system(ns: argparse.Namespace) -> System:
    system = load_system(ns.system or ns.gpu)
    if ns.gpus_per_node is not None:  # >= 1: checked by its argparse type
        system = dataclasses.replace(system, gpus_per_node=ns.gpus_per_node)
    for link in ("intra", "inter"):
        cur = getattr(system, f"{link}_node")
        bw, lat = getattr(ns, f"{link}_bw"), getattr(ns, f"{link}_latency_us")
        if bw is not None or lat is not None:
            system = dataclasses.replace(system, **{f"{link}_node": dataclasses.replace(
                cur, bandwidth_gb_s=cur.bandwidth_gb_s if bw is None else bw,
                latency_us=cur.latency_us if lat is None else lat)})
    return system


def format_table(evals: list[Evaluation], top: int) -> str:
    head = (f"{'#':>3} {'layout':<52} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'bubble':>7} {'exp.comm ms':>11} "
            f"{'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for i, e in enumerate([e for e in evals if e.status == "ok"][:top], 1):
        lines.append(f"{i:>3} {str(e.layout):<52} {e.step_time_s * 1e3:>9.1f} {e.tokens_per_s:>10.4g} "
                     f"{100 * e.mfu:>5.1f}% {100 * e.bubble_fraction:>6.1f}% {e.exposed_comm_s * 1e3:>11.1f} "
                     f"{e.peak_bytes / 1024**3:>8.1f}")
    return "\n".join(lines)


def print_band(req: Request, evals: list[Evaluation]) -> None:
    """Each row's step time and tokens/s per GPU calibrated on the public runs, with the band their leave-one-out
    residuals give (``planner.band``), and a warning when the question lies outside every run seen."""
    best = evals[0]
    flops_per_token = best.mfu * best.step_time_s * req.gpus * req.system.bf16_tflops * 1e12 / tokens_per_step(req)
    band = band_for(load_residuals(), req.system.name, req.gpus, flops_per_token)
    names = ", ".join(band.nearest[:3]) + (f" and {len(band.nearest) - 3} more" if len(band.nearest) > 3 else "")
    print(f"calibrated on the public runs (compute scale {band.scale:.3f} of {band.scale_of}, "
          f"{1e3 * band.step_overhead_s:.0f} ms per step), band from "
          f"the leave-one-out residuals of the {len(band.nearest)} nearest ({names})"
          + (", widened to every run's as they are few" if band.widened else "") + ":")
    for i, e in enumerate(evals, 1):
        cal, lo, hi = band.step(e, req)
        tok, tok_lo, tok_hi = band.tokens_per_gpu(e, req)
        print(f"{i:>3} {str(e.layout):<52} step {cal:.4g} s (band {lo:.4g} to {hi:.4g})   tokens/s/GPU {tok:.4g} "
              f"(band {tok_lo:.4g} to {tok_hi:.4g})")
    if band.outside:
        print(f"warning: this question lies outside every public run the planner has seen: {band.outside}")


def check_outputs(ns: argparse.Namespace) -> None:
    """Every output path, before the search runs (a folder or a missing parent is refused by name)."""
    for option, path in (("--json", ns.json), ("--write-config", ns.write_config), ("--trace", ns.trace)):
        if path and not (option == "--json" and path == "-"):
            check_output_file(path, option)


def run_plan(ns: argparse.Namespace) -> int:
    check_outputs(ns)
    system = _system(ns)
    fixed = parse_fix(ns.fix)
    base = base_config(ns.model, ns.overrides)
    gpus = ns.gpus if ns.gpus is not None else (fixed["pp"] * fixed.get("cp", 1) * fixed["dp"]
                                                if {"pp", "dp"} <= set(fixed) else None)
    if gpus is None:
        raise ValueError("--gpus is required (or --fix both pp and dp)")
    if gpus > MAX_GPUS:
        raise ValueError(f"--gpus {gpus}: the planner searches clusters of up to {MAX_GPUS:,} GPUs (its layout "
                         "enumeration grows with the GPU count's divisors); plan a share of the cluster")
    seq_len = ns.seq_len if ns.seq_len is not None else base.data.seq_len
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (a sequence predicts its next token), got {seq_len}")
    global_batch = ns.global_batch
    if {"dp", "micro_batch", "microbatches"} <= set(fixed):
        implied = fixed["dp"] * fixed["micro_batch"] * fixed["microbatches"]
        if global_batch is not None and global_batch != implied:
            raise ValueError(f"--global-batch {global_batch} != dp x micro_batch x microbatches = {implied} of --fix")
        global_batch = implied
    req = Request(base, system, gpus, seq_len, global_batch or base.data.global_batch, ns.expert_imbalance,
                  ns.fp8_recipe or getattr(base.model, "fp8_recipe", "blockwise"))
    args = model_args(base)
    if seq_len > args.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    space = Space(micro_batch=tuple(ns.micro_batches), schedules=tuple(ns.schedules), eplb=tuple(ns.eplb_slots),
                  fixed=fixed)
    if 0 in ns.micro_batches:
        raise ValueError("--micro-batches: sizes must be >= 1, got 0")
    evals = search(req, args, space)
    if not evals:
        raise ValueError(f"no layout of {gpus} GPUs matches: global batch {req.global_batch} must be dp x "
                         f"micro_batch x microbatches with dp = GPUs / pp, micro_batch in {list(space.micro_batch)}, "
                         f"ep dividing dp and the {args.n_routed_experts} routed experts, "
                         f"pp <= {args.n_layers + args.n_mtp_layers} (layers + MTP)"
                         + (f", and --fix {ns.fix}" if ns.fix else ""))
    fit = [e for e in evals if e.status == "ok"]
    counts = {s: sum(e.status == s for e in evals) for s in ("ok", "oom", "dominated", "illegal")}
    print(f"{base.model.preset} on {gpus} x {system.name} ({system.gpus_per_node} per node, system file "
          f"{'calibrated' if system.calibrated else 'uncalibrated: public kernel measurements, see its sources'}); "
          f"seq {seq_len}, global batch {req.global_batch} ({tokens_per_step(req):,} tokens/step)")
    print(f"{len(evals)} layouts: {counts['ok']} fit and were timed, {counts['oom']} out of memory, "
          f"{counts['dominated']} dominated (a fitting twin with less recompute or BF16 moments is faster), "
          f"{counts['illegal']} illegal")
    if ns.json:
        text = json.dumps([e.row() for e in evals], indent=1)
        if ns.json == "-":
            print(text)
        else:
            Path(ns.json).write_text(text)
    if not fit:
        misses = nearest_misses(evals)
        lines = [f"  {e.layout}: {e.peak_bytes / 1024**3:.1f} GiB per rank" for e in misses]
        if not misses:
            lines = [f"  {e.layout}: {e.reason}" for e in evals[:5]]
        print("nearest misses:\n" + "\n".join(lines))
        raise ValueError(f"no layout fits {system.name} ({system.memory_gib:.1f} GiB per GPU, margin included); "
                         "the nearest misses are listed above")
    print(format_table(evals, ns.top))
    best = fit[0]
    print_band(req, fit[:min(ns.top, 5)])
    if ns.tokens:
        steps = ns.tokens / tokens_per_step(req)
        print(f"{ns.tokens:.3g} training tokens = {steps:,.0f} steps: {steps * best.step_time_s / 86400:.1f} days "
              f"({steps * best.step_time_s * gpus / 3600 / 1e6:.2f}M GPU hours) with the best layout")
    if ns.write_config:
        Path(ns.write_config).write_text(f"# written by recipes.plan: {best.layout}, predicted "
                                         f"{best.step_time_s * 1e3:.1f} ms/step, MFU {100 * best.mfu:.1f}% on "
                                         f"{system.name}\n" + to_config(req, best.layout).to_toml())
        print(f"wrote {ns.write_config}")
    if ns.trace:
        timed = evaluate(req, best.layout)
        Path(ns.trace).write_text(json.dumps(chrome_trace(timed.sim, time_unit_us=1e6)))
        print(f"wrote {ns.trace} (one pipeline of {best.layout})")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m recipes.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek_v3_671b", help="preset name, HF config.json, or training TOML")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="change the model/config as recipes.train does, e.g. model.overrides.n_layers=4")
    ap.add_argument("--gpu", default="H800", help="shipped system: " + ", ".join(known_systems()))
    ap.add_argument("--system", default=None, help="a system file (JSON) instead of --gpu")
    ap.add_argument("--gpus", type=positive_int, default=None, help="total GPUs")
    ap.add_argument("--gpus-per-node", type=positive_int, default=None,
                    help="GPUs per node (default: the system file's)")
    ap.add_argument("--intra-bw", type=positive_float, default=None,
                    help="intra-node GB/s per GPU and direction (default: the system file's)")
    ap.add_argument("--intra-latency-us", type=nonnegative_float, default=None,
                    help="intra-node latency per message, microseconds (default: the system file's)")
    ap.add_argument("--inter-bw", type=positive_float, default=None,
                    help="inter-node GB/s per GPU and direction (default: the system file's)")
    ap.add_argument("--inter-latency-us", type=nonnegative_float, default=None,
                    help="inter-node latency per message, microseconds (default: the system file's)")
    ap.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the config's)")
    ap.add_argument("--global-batch", type=positive_int, default=None,
                    help="sequences per optimizer step (default: the config's)")
    ap.add_argument("--tokens", type=positive_float, default=None,
                    help="training tokens, for the predicted run length")
    ap.add_argument("--fp8-recipe", choices=("blockwise", "mxfp8"), default=None,
                    help="FP8 GEMM recipe of fp8 layouts (default: the config's model.fp8_recipe, else blockwise)")
    ap.add_argument("--expert-imbalance", type=positive_float, default=1.0,
                    help="expert load max/mean without EPLB (1.0 = balanced routing)")
    ap.add_argument("--micro-batches", type=_int_list, default=[1, 2, 4],
                    help="micro-batch sizes to search (comma-separated)")
    ap.add_argument("--schedules", type=_schedule_list, default=list(SEARCH_SCHEDULES),
                    help="schedules to search at pp > 1 (comma-separated)")
    ap.add_argument("--eplb-slots", type=_int_list, default=[0],
                    help="EPLB redundant expert slots to search (0 = off), e.g. 0,32")
    ap.add_argument("--fix", default=None, help=f"fix layout keys, e.g. pp=16,ep=64 (keys: {', '.join(LAYOUT_KEYS)})")
    ap.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table")
    ap.add_argument("--write-config", default=None, help="write the best layout as a recipes.train TOML")
    ap.add_argument("--json", default=None, help="write every evaluated layout as JSON ('-' = stdout)")
    ap.add_argument("--trace", default=None, help="write the best layout's predicted step as a Chrome/Perfetto trace")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["calibrate"]:
            return calibrate_main(argv[1:])
        return run_plan(parser().parse_args(argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
