"""A/B of two source trees' overlapped forward-and-backward, in one run: the delay-wire benchmark and host time.

    python benchmarks/ab_overlap_engine.py --old /work/wt/old --new . [--rounds 3] [--steps 2]
        [--comm-ratio 0.5 1.0] [--host-rounds 3] [--host-steps 4] [--host-layers 4] [--host-dim 32]
        [--tree NAME=PATH ...] [--nice N] [--out DIR] [--skip-delay] [--skip-host]
    python benchmarks/ab_overlap_engine.py --from-summary DIR1/summary.json DIR2/summary.json   (pool runs)

Written for issue 26 (the per-layer plan, ``models/deepseek_v3/plan.py``, replacing the autograd-walking
engine, ``models/deepseek_v3/steps.py`` at 40c490a), but it compares any two checkouts: each measurement
runs in a fresh process with ``PYTHONPATH`` and the working directory set to the tree being measured, the
trees taking turns (old, new, old, new, ...) so that drift in the machine's load hits both alike. Medians
over the rounds, with the spread (min-max) beside them.

1. **Delay wire**: ``python -m recipes.bench_a2a_delay --steps S --comm-ratio ... --json`` in each tree
   (DualPipeV, EP 2 on 2 gloo ranks, every ``all_to_all_single`` held on a simulated serial wire; each run
   sizes its wire from its own compute). Per comm ratio: the overlapped step and the overlapped F&B chunks as
   multiples of max(comm, compute) (and the chunks of comm + compute), F then B's step as the control, and
   the overlapped step's time without the wire (``compute_s``).
2. **Host time per layer per micro-batch** of the overlapped chunk: a tiny model where Python dominates
   (``debug_tiny``, dim ``--host-dim``, ``--host-layers`` layers all expert-parallel, MTP on, seq 32 x 2), EP 2
   on 2 gloo ranks, no wire, DualPipeV with the overlap on and off, steps interleaved. Each F&B chunk (the
   runtime's ``last_step_timeline`` items that are ``Overlap``s) is divided by the layers it runs (the forward
   stage's plus the backward stage's, an MTP module counting as one: that is, by the layers and by the chunk's
   two micro-batches); the overlap-off chunks (the same pairs run F then B) are the reference. Rank 0's chunks
   of every timed step, median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


# ---- the driver ---------------------------------------------------------------------------------------------
def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", DSV3_KERNEL_IMPL="reference")
    return env


def _run(cmd: list[str], tree: Path, log: Path, nice: int | None = None) -> None:
    t0 = time.time()
    if nice is not None:
        cmd = ["nice", "-n", str(nice), *cmd]
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=tree, env=_env(tree), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} in {tree} failed (exit {rc}); see {log}")
    print(f"  {log.name}: {time.time() - t0:.0f} s", flush=True)


def _stats(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def delay_table(results: dict[str, list[dict]], ratios: list[float], tolerance: float | None = None) -> str:
    """``results[engine]``: one bench_a2a_delay JSON per round. Rows in the order of ``ratios``. With
    ``tolerance``, only the rounds whose measured comm / compute lies within that fraction of the ratio asked
    (a load change between the run's sizing steps and its timed steps moves it; so does it every multiple)."""
    header = ["comm ratio asked (measured)", "engine", "rounds", "overlapped step x max", "F&B chunks x max",
              "F&B chunks x sum", "F then B step x max", "overlapped compute s (no wire)", "overlapped step s"]
    rows = []
    for i, ratio in enumerate(ratios):
        for engine, runs in results.items():
            if tolerance is not None:
                runs = [r for r in runs if abs(float(r["rows"][2 * i]["comm/compute"]) / ratio - 1) <= tolerance]
                if not runs:
                    rows.append([f"{ratio:g}", engine, "0"] + ["-"] * 6)
                    continue
            ov = [r["rows"][2 * i] for r in runs]
            fb = [r["rows"][2 * i + 1] for r in runs]
            assert all(o["mode"] == "overlapped F&B" and f["mode"] == "F then B" for o, f in zip(ov, fb))
            measured = statistics.median(float(o["comm/compute"]) for o in ov)
            rows.append([f"{ratio:g} ({measured:.2f})", engine, str(len(runs)),
                         _stats([o["x_max"] for o in ov]), _stats([o["chunks_x_max"] for o in ov]),
                         _stats([o["chunks_x_sum"] for o in ov]), _stats([f["x_max"] for f in fb]),
                         _stats([o["compute_s"] for o in ov]), _stats([o["step_s"] for o in ov])])
    return _markdown(header, rows)


def host_table(results: dict[str, list[dict]]) -> str:
    header = ["engine", "overlapped chunk, wall ms per layer per micro-batch", "its main-thread CPU ms",
              "its process CPU ms", "F then B chunk, wall ms per layer per mb", "its main-thread CPU ms",
              "overlapped / F then B (wall)", "overlapped chunk wall ms", "layers per chunk", "chunks per round"]
    rows = []
    for engine, runs in results.items():
        ov = [r["overlap_ms_per_layer_mb"] for r in runs]
        fb = [r["plain_ms_per_layer_mb"] for r in runs]
        rows.append([engine, _stats(ov, 2), _stats([r["overlap_thread_cpu_ms_per_layer_mb"] for r in runs], 2),
                     _stats([r["overlap_process_cpu_ms_per_layer_mb"] for r in runs], 2), _stats(fb, 2),
                     _stats([r["plain_thread_cpu_ms_per_layer_mb"] for r in runs], 2),
                     _stats([o / f for o, f in zip(ov, fb)], 3),
                     _stats([r["overlap_chunk_ms"] for r in runs], 1),
                     "/".join(str(n) for n in sorted({n for r in runs for n in r["layers_per_chunk"]})),
                     str(runs[0]["chunks"])])
    return _markdown(header, rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, help="the tree measured as 'old'")
    ap.add_argument("--new", type=Path, help="the tree measured as 'new'")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a further tree to measure in the same rotation (e.g. a candidate patch)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=3, help="delay-wire runs per tree")
    ap.add_argument("--steps", type=int, default=2, help="bench_a2a_delay --steps")
    ap.add_argument("--comm-ratio", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--host-rounds", type=int, default=3, help="host-time runs per tree")
    ap.add_argument("--host-steps", type=int, default=4, help="timed steps per setting in each host-time run")
    ap.add_argument("--host-layers", type=int, default=4)
    ap.add_argument("--host-dim", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None, help="where the per-run JSON and logs go (default: a temp dir)")
    ap.add_argument("--nice", type=int, default=None,
                    help="run every measurement under `nice -n N` (a negative N needs root: the other jobs yield)")
    ap.add_argument("--tolerance", type=float, default=0.15,
                    help="also tabulate only the delay rounds whose measured comm / compute is within this "
                         "fraction of the ratio asked")
    ap.add_argument("--from-summary", type=Path, nargs="+", default=None,
                    help="print the tables of earlier runs' summary.json (their rounds pooled) instead of measuring")
    ap.add_argument("--skip-delay", action="store_true")
    ap.add_argument("--skip-host", action="store_true")
    ns = ap.parse_args(argv)
    if ns.from_summary is not None:
        pooled: dict[str, dict[str, list[dict]]] = {"delay": {}, "host": {}}
        for path in ns.from_summary:
            for kind, by_engine in json.loads(path.read_text()).items():
                for engine, runs in by_engine.items():
                    pooled[kind].setdefault(engine, []).extend(runs)
        _print_tables(ns, pooled["delay"], pooled["host"])
        return 0
    if ns.old is None or ns.new is None:
        ap.error("--old and --new are required (unless --from-summary)")
    out = ns.out or Path(tempfile.mkdtemp(prefix="ab_overlap_"))
    out.mkdir(parents=True, exist_ok=True)
    trees = {"old": ns.old.resolve(), "new": ns.new.resolve()}
    for item in ns.tree:
        name, _, path = item.partition("=")
        trees[name] = Path(path).resolve()
    for name, tree in trees.items():
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"{name}: {tree} at {rev.stdout.strip() or '?'}", flush=True)
    print(f"outputs: {out}", flush=True)

    delay: dict[str, list[dict]] = {k: [] for k in trees}
    if not ns.skip_delay:
        for r in range(ns.rounds):
            for name, tree in trees.items():
                path = out / f"delay_{name}_{r}.json"
                path.unlink(missing_ok=True)
                _run([ns.python, "-m", "recipes.bench_a2a_delay", "--steps", str(ns.steps), "--comm-ratio",
                      *map(str, ns.comm_ratio), "--json", str(path)], tree, out / f"delay_{name}_{r}.log", ns.nice)
                delay[name].append(json.loads(path.read_text()))
    host: dict[str, list[dict]] = {k: [] for k in trees}
    if not ns.skip_host:
        for r in range(ns.host_rounds):
            for name, tree in trees.items():
                path = out / f"host_{name}_{r}.json"
                _run([ns.python, str(HERE), "--host-worker", str(path), "--steps", str(ns.host_steps),
                      "--layers", str(ns.host_layers), "--dim", str(ns.host_dim)], tree, out / f"host_{name}_{r}.log",
                     ns.nice)
                host[name].append(json.loads(path.read_text()))

    _print_tables(ns, delay, host)
    (out / "summary.json").write_text(json.dumps({"delay": delay, "host": host}, indent=1))
    return 0


def _print_tables(ns: argparse.Namespace, delay: dict[str, list[dict]], host: dict[str, list[dict]]) -> None:
    if any(delay.values()):
        rounds = max(map(len, delay.values()))
        print(f"\n## delay wire: recipes.bench_a2a_delay, median [min-max] of {rounds} rounds\n")
        print(delay_table(delay, ns.comm_ratio))
        print(f"\nthe same, rounds whose measured comm / compute is within {ns.tolerance:.0%} of the ratio asked\n")
        print(delay_table(delay, ns.comm_ratio, ns.tolerance))
    if any(host.values()):
        print(f"\n## host time: debug_tiny dim {ns.host_dim}, {ns.host_layers} layers + MTP, no wire; "
              f"median [min-max] of {max(map(len, host.values()))} rounds (each the median of rank 0's chunks "
              f"over its timed steps)\n")
        print(host_table(host))


# ---- the host-time worker (runs inside the tree being measured) ----------------------------------------------
def _stage_units(stage, n_mtp: int) -> int:
    """Blocks a stage runs: its trunk layers, plus the MTP modules on the last stage (run by its criterion)."""
    return (stage.end - stage.start) + (n_mtp if stage.is_last else 0)


def _time_cpu(pipe, out: list[tuple[float, float]]) -> None:
    """Record each ``Overlap`` item's CPU time (the calling thread's, the whole process's: the comm thread and
    gloo's threads too) next to the runtime's wall-clock timeline: host work, whatever the machine's load."""
    import time as _time

    run_item = pipe._run_item

    def timed(item) -> None:
        if "OVERLAP" not in str(item):
            return run_item(item)
        t0, p0 = _time.thread_time(), _time.process_time()
        try:
            return run_item(item)
        finally:
            out.append((_time.thread_time() - t0, _time.process_time() - p0))

    pipe._run_item = timed


def _host_rank(rank: int, world: int, ns: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from recipes.bench_a2a_delay import BASE
    from training.config import load_config
    from training.parallel import init_parallel
    from training.trainer import Trainer, check_static

    torch.set_num_threads(1)
    config = Path("recipes/configs/tiny_cpu.toml")
    extra = ["model.preset=debug_tiny", f"model.overrides.n_layers={ns.layers}", "model.overrides.n_dense_layers=0",
             f"model.overrides.dim={ns.dim}", "data.seq_len=32", "data.global_batch=32", "data.micro_batch=2",
             f"run.steps={2 * ns.steps + 8}"]
    trainers = {}
    cpu: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # each chunk's (main thread, process) CPU s
    for overlap in (True, False):
        cfg = load_config(config, BASE + extra + [f"parallel.overlap={str(overlap).lower()}"])
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        trainers[overlap] = Trainer(cfg, ps, tempfile.mkdtemp(), "disabled", check_static(cfg, world), None)
        _time_cpu(trainers[overlap].pipeline.pipe, cpu[overlap])
    chunks: dict[bool, list[float]] = {True: [], False: []}  # ms per layer per micro-batch, one per chunk
    raw: dict[bool, list[float]] = {True: [], False: []}  # ms per chunk
    layers_seen: set[int] = set()
    cpu_ms: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    profiler = None
    if ns.profile and rank == 0:
        import cProfile
        profiler = cProfile.Profile()
    for i in range(ns.steps + 1):  # the first round warms up
        for overlap in (True, False):
            trainer = trainers[overlap]
            dist.barrier()
            if profiler is not None and i > 0 and overlap:
                profiler.enable()
            trainer.train_step()
            if profiler is not None:
                profiler.disable()
            if i == 0:
                cpu[overlap].clear()
                continue
            pipe = trainer.pipeline.pipe
            n_mtp = trainer.args.n_mtp_layers
            for item, start, end, _ in pipe.last_step_timeline:
                if "OVERLAP" not in str(item):
                    continue
                layers = (_stage_units(pipe._stage_module(item.forward.stage), n_mtp)
                          + _stage_units(pipe._stage_module(item.backward.stage), n_mtp))
                layers_seen.add(layers)
                raw[overlap].append((end - start) * 1e3)
                chunks[overlap].append((end - start) * 1e3 / layers)
                thread_s, process_s = cpu[overlap][len(raw[overlap]) - 1]
                cpu_ms[overlap].append((thread_s * 1e3 / layers, process_s * 1e3 / layers))
    if rank != 0:
        return None
    if profiler is not None:
        profiler.dump_stats(ns.profile)
    return {"overlap_ms_per_layer_mb": statistics.median(chunks[True]),
            "plain_ms_per_layer_mb": statistics.median(chunks[False]),
            "overlap_chunk_ms": statistics.median(raw[True]), "plain_chunk_ms": statistics.median(raw[False]),
            "overlap_thread_cpu_ms_per_layer_mb": statistics.median(t for t, _ in cpu_ms[True]),
            "overlap_process_cpu_ms_per_layer_mb": statistics.median(p for _, p in cpu_ms[True]),
            "plain_thread_cpu_ms_per_layer_mb": statistics.median(t for t, _ in cpu_ms[False]),
            "plain_process_cpu_ms_per_layer_mb": statistics.median(p for _, p in cpu_ms[False]),
            "layers_per_chunk": sorted(layers_seen), "chunks": len(chunks[True]) // ns.steps,
            "all_overlap_ms_per_layer_mb": chunks[True], "all_plain_ms_per_layer_mb": chunks[False]}


def host_worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host-worker", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--profile", default=None, help="cProfile rank 0's overlapped steps into this file")
    ns = ap.parse_args(argv)
    # import from the tree being measured (cwd, PYTHONPATH), never from this file's checkout
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]
    sys.path.insert(0, os.getcwd())
    import models.deepseek_v3
    from recipes.benchutil import spawn_gloo

    result = spawn_gloo(_host_rank, 2, ns)
    result["models_from"] = str(Path(models.deepseek_v3.__file__).resolve().parents[2])
    Path(ns.host_worker).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("all_")}))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(host_worker(args) if "--host-worker" in args else main(args))
