"""The combination matrix of issue 13: options, the all-pairs design, and one combination's training run.

A combination picks one value per option (``OPTIONS``). Every runnable combination trains on 4 gloo
processes (``schedule none``: dp 4; pipelines: pp 2 x dp 2) and is compared with one process
training the same model on the same data (``reference_key``: FP8 and MTP change the model; the
layout, recompute, overlap, EPLB and ZeRO-1 must not change the numbers). Several combinations run
one after another inside one launch of the 4 processes (``run_combinations``), each with its own
process groups, so the cost of starting processes is paid once.

The all-pairs design (``all_pairs``) is generated greedily and deterministically: starting from
nothing, repeatedly take the first runnable combination (in product order) that covers the most
value pairs not yet covered, until every pair that some runnable combination contains is covered.
Pairs that only impossible combinations contain are covered by refusal checks instead.

``train_cli`` is the other way to train in a test: a whole ``python -m recipes.train`` launch of a config,
read back from its ``metrics.jsonl``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

OPTIONS: dict[str, tuple[Any, ...]] = {
    "schedule": ("none", "1f1b", "zb1p", "zbv", "dualpipe", "dualpipev"),
    "ep": (1, 2),
    "fp8": (False, True),
    "mtp": (0, 1),
    "recompute": ("none", "v3", "swiglu", "block"),
    "overlap": (True, False),
    "eplb": (False, True),
    "zero1": (False, True),
}
# V3 recomputes every RMSNorm and the MLA up-projections (report 3.2.3).
RECOMPUTE = {"none": [], "v3": ["norm", "mla_up"], "swiglu": ["swiglu"], "block": ["block"]}
WORLD = 4
STEPS = 2
GAMMA = 1e-2  # aux-loss-free bias step
# The shared small run: debug_tiny widths, 4 pipeline units (layers + MTP, 1 dense layer) so that
# ZB-V / DualPipeV have 4 stages, 8 experts (EP 2 -> 4 per rank; EPLB +2 slots -> 5), 8 sequences
# of 16 tokens per step, one sequence per micro-batch (every data-parallel rank's micro-batch is one
# of the reference's). AdamW with eps = 1 far above |g| (<= 1 after clipping, ~1e-2 per element):
# its update lr m / (sqrt(v) + eps) is then linear in the gradient, so a summation-order change
# moves it proportionally instead of flipping the sign of near-zero-gradient elements (eps << |g|
# makes every element's first update lr x sign(g)); the same optimizer code and sharding run.
BASE = ["model.preset=debug_tiny", "model.overrides.n_dense_layers=1",
        "data.seq_len=16", "data.global_batch=8", "data.micro_batch=1", f"run.steps={STEPS}",
        "optim.warmup_steps=0", "optim.lr=0.5", "optim.min_lr=0.5", "optim.eps=1.0",
        "balance.strategy=aux_free+seq_aux", f"balance.gamma={GAMMA}",
        "logging.progress=false", "logging.wandb=disabled", "logging.plot=false", "run.threads=1",
        "checkpoint.final=false", "checkpoint.interval=0", "run.sample_tokens=0", "run.timeout_s=120"]
CONFIG = "recipes/configs/tiny_cpu.toml"
ROOT = Path(__file__).resolve().parent.parent

Combo = dict[str, Any]


def product() -> Iterator[Combo]:
    """Every combination, in product order."""
    for values in itertools.product(*OPTIONS.values()):
        yield dict(zip(OPTIONS, values))


def impossible(c: Combo) -> str | None:
    """Why ``c`` cannot exist by construction (independently of the code), else None."""
    if c["mtp"] and c["schedule"] in ("1f1b", "zb1p"):
        return "MTP shares the embedding, which 1F1B / ZB1P at pp 2 keep on the other rank than the head"
    if c["eplb"] and c["ep"] == 1:
        return "EPLB balances expert load between EP ranks; with ep 1 there is one"
    return None


def overrides(c: Combo) -> list[str]:
    """``--set`` items of combination ``c`` (on top of ``BASE``)."""
    pipe = c["schedule"] != "none"
    out = [f"parallel.schedule={c['schedule']}", f"parallel.pp={2 if pipe else 1}",
           f"parallel.dp={WORLD // 2 if pipe else WORLD}", f"parallel.ep={c['ep']}",
           f"model.fp8={str(c['fp8']).lower()}", *model_overrides(c["mtp"]),
           f"model.overrides.recompute={RECOMPUTE[c['recompute']]!r}", f"parallel.overlap={str(c['overlap']).lower()}",
           f"parallel.zero1={str(c['zero1']).lower()}"]
    if c["eplb"]:
        out += ["eplb.enabled=true", "eplb.redundant_experts=2", "eplb.interval=1"]
    return out


def model_overrides(mtp: int) -> list[str]:
    return [f"model.overrides.n_mtp_layers={mtp}", f"model.overrides.n_layers={4 - mtp}"]


def reference_key(c: Combo) -> tuple[bool, int]:
    return c["fp8"], c["mtp"]


def reference_overrides(key: tuple[bool, int]) -> list[str]:
    fp8, mtp = key
    return ["parallel.schedule=none", "parallel.pp=1", "parallel.dp=1", "parallel.ep=1",
            f"model.fp8={str(fp8).lower()}", *model_overrides(mtp)]


def config(items: Iterable[str]):
    from training.config import load_config

    return load_config(CONFIG, BASE + list(items))


def pairs(c: Combo) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    """The value pairs combination ``c`` covers (option names in ``OPTIONS`` order)."""
    items = list(c.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def all_pairs(runnable) -> list[Combo]:
    """A deterministic all-pairs design over the combinations for which ``runnable(c)`` is true."""
    pool = [c for c in product() if runnable(c)]
    uncovered = set().union(*(pairs(c) for c in pool))
    design = []
    while uncovered:
        best = max(pool, key=lambda c: len(pairs(c) & uncovered))  # max keeps the first of equals
        design.append(best)
        uncovered -= pairs(best)
    return design


def name(c: Combo) -> str:
    return "-".join(f"{k}={v}" for k, v in c.items())


# ---- running ---------------------------------------------------------------------------------

def train_cli(config: str, quick: list[str], run_dir: Path, nproc: int, overrides: list[str]) -> list[dict]:
    """Train ``config`` with ``quick + overrides`` as ``--set`` items through ``python -m recipes.train`` on
    ``nproc`` processes (the CLI a user runs, PyTorch reference kernels) into ``run_dir``; its per-step rows of
    ``metrics.jsonl``. A failed run fails the test with the end of its output."""
    cmd = [sys.executable, "-m", "recipes.train", "--config", config, "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for o in quick + overrides:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(cfg, ps, run_dir: Path, keep_initial: bool = False) -> dict[str, Any]:
    """Train ``cfg`` for ``run.steps`` steps in process groups ``ps``; per-step losses (main and MTP)
    and this rank's final weights (logical expert layout, with each routed-expert tensor's expert range)."""
    from training.optim import is_expert_param
    from training.stages import expert_range
    from training.trainer import Trainer, check_static

    trainer = Trainer(cfg, ps, run_dir, "disabled", check_static(cfg, ps.world_size))
    initial = {k: v.detach().clone() for k, v in trainer.model_state_dict().items()} if keep_initial else None
    losses, mtp, norms = [], [], []
    for _ in range(cfg.run.steps):
        m = trainer.train_step()
        losses.append(m["loss"])
        mtp.append(m.get("mtp_loss"))
        norms.append(m["grad_norm"])
    state = {k: v.detach().clone() for k, v in trainer.model_state_dict().items()}
    rows = expert_range(trainer.args, ps.coords.ep_rank, cfg.parallel.ep) if trainer.args.n_routed_experts else None
    experts = {k: (rows.start, rows.stop) for k in state if is_expert_param(k)}
    return {"loss": losses, "mtp": mtp, "grad_norm": norms, "state": state, "expert_rows": experts, "initial": initial}


def run_reference(key: tuple[bool, int], run_dir: Path) -> dict[str, Any]:
    """The one-process run a combination with this ``reference_key`` is compared with."""
    from training.parallel import single_process

    cfg = config(reference_overrides(key))
    return train(cfg, single_process(cfg.parallel), run_dir, keep_initial=True)


def run_combinations(rank: int, world: int, combos: list[Combo], run_dir: str) -> list[dict[str, Any]]:
    """Inside a ``tests.dist_utils.run_distributed`` launch: train every combination in turn (fresh
    process groups each); this rank's result or error per combination."""
    import torch.distributed as dist

    from training.parallel import init_parallel

    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    out = []
    for i, c in enumerate(combos):
        cfg = config(overrides(c))
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        try:
            out.append(train(cfg, ps, Path(run_dir) / f"c{i}"))
        except Exception as exc:  # noqa: BLE001 - reported per combination; the peers time out likewise
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        for g in {id(g): g for g in ps.groups.values() if g is not None}.values():
            dist.destroy_process_group(g)
    return out


def run_matrix(combos: list[Combo], run_dir: Path, timeout: float) -> tuple[list[list[dict]], dict]:
    """The combinations on ``WORLD`` gloo processes and, meanwhile in this process, their one-process
    references: (per rank, per combination results; reference key -> result)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.dist_utils import run_distributed

    with ThreadPoolExecutor(1) as pool:
        launch = pool.submit(run_distributed, run_combinations, WORLD, combos, str(run_dir), timeout=timeout)
        refs = {k: run_reference(k, run_dir / f"ref-{k[0]}-{k[1]}") for k in sorted({reference_key(c) for c in combos})}
        return launch.result(), refs
