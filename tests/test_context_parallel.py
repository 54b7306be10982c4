"""Context parallelism at run time (docs/context_parallel.md): the load-balanced split, MLA's differentiable latent
all-gather and global causal attention against float64 one-process attention, and whole training runs with
CP = 2 and 4 (dense MLA + MTP, DualPipeV x EP x FP8, ZB-V, DSA's warm-up and sparse stages) against one process,
through ``recipes.train`` and in-process; resume across a change of CP size; the one-line errors.

Tolerances. The float64 check is exact up to float64 rounding (1e-12). The fp32 training runs differ from one
process only in summation order: attention over gathered keys (SDPA against the blocked reference), the loss as a
sum of per-rank shares, gradients summed over CP ranks. The CLI comparison takes REL = 512 x 2^-24 per value, as
``tests/test_training_recompute`` does for its reordered fp32 sums (the longest reductions here are 256-term
vocabulary sums and <= 512-term GEMM dots); the in-process layouts use ``tests/test_combinations``' derived
bounds on losses, gradient norms and every final weight (its AdamW with eps = 1 keeps updates linear in the
gradient, so reordering moves weights proportionally).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.deepseek_v3.context_parallel import ContextParallel, chunk_positions
from recipes.train import main as train_main
from tests import matrix
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
DEMO = "recipes/configs/tiny_cpu.toml"
REL = 512 * 2.0**-24
# the demo model (MTP depth 1, MoE, aux-free + sequence-wise balancing) on one pipeline rank, no FP8
CLI = ["run.steps=3", "model.fp8=false", "checkpoint.final=false", "checkpoint.interval=0", "optim.warmup_steps=2",
       "data.global_batch=4", "data.micro_batch=2", "data.seq_len=32", "run.sample_tokens=6", "logging.progress=false",
       "logging.eval_batches=1", "logging.eval_every=1", "logging.wandb=disabled", "run.threads=1", "parallel.pp=1",
       "parallel.schedule=none", "parallel.dp=1", "balance.strategy=aux_free+seq_aux", "balance.alpha=0.01",
       "checkpoint.async_save=false"]
# the CLI runs of CP, each several trainings (in-process tests check CP = 2 and 4 at every push)
CP_CLI = pytest.mark.skipif(os.environ.get("DSV3_CP_CLI") != "1",
                            reason="opt-in (DSV3_CP_CLI=1): CLI trainings under CP, ~1.5-2 min each on 2 cores")


def test_chunks_cover_the_sequence_once_with_equal_causal_work():
    for cp in (1, 2, 4, 8):
        ranks = [chunk_positions(64, cp, r) for r in range(cp)]
        assert sorted(p for r in ranks for p in r) == list(range(64))
        # causal work of a rank: each query scores the keys up to itself
        work = {sum(p + 1 for p in r) for r in ranks}
        assert len(work) == 1, (cp, work)
    assert chunk_positions(16, 2, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="divisible by 2 x cp = 8"):
        chunk_positions(36, 4, 0)


def _gathered_attention(rank: int, world: int, seed: int) -> dict:
    """Per rank: its queries' attention over the all-gathered keys/values in float64, and the gradients of a
    random linear function of the outputs (summed over ranks) with respect to every rank's inputs."""
    import torch.distributed as dist

    s, b, h, d, dv = 24, 2, 3, 8, 5
    cp = ContextParallel(dist.group.WORLD, world, rank, s)
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(b, s, h, n, generator=g, dtype=torch.float64) for n in (d, d, dv, dv))
    rows = 2 * s // (2 * world) - (1 if rank == 0 else 0)  # rank 0 drops its last row, as MTP does
    q_l, k_l, v_l = (cp.split(t)[:, :rows].clone().requires_grad_() for t in (q, k, v))
    posted = cp.post_gather(k_l)  # (MLA's overlapped form for k, the blocking one for v)
    out = cp.attention(q_l, cp.landed(*posted), cp.gather(v_l), scale=0.3)
    (out * cp.split(w)[:, :rows]).sum().backward()
    return {"pos": cp.positions("cpu", rows), "out": out.detach(), "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_gathered_attention_equals_float64_attention_and_its_gradients(world):
    """Local queries over the gathered keys equal causal attention over the whole sequence, and the gathered
    tensors' gradients come back reduce-scattered to the rank holding each position (float64, 1e-12). The last
    position is dropped (MTP's tail): every other position's output and gradient are unchanged by it."""
    seed = 7
    got = run_distributed(_gathered_attention, world, seed, timeout=120.0)
    s, b, h, d, dv = 24, 2, 3, 8, 5
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(b, s, h, n, generator=g, dtype=torch.float64) for n in (d, d, dv, dv))
    n = s - 1
    q, k, v = (t[:, :n].clone().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    (want * w[:, :n]).sum().backward()
    for r in got:
        pos = r["pos"]
        torch.testing.assert_close(r["out"], want.detach()[:, pos], rtol=0, atol=1e-12)
        for name, ref in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(r[name], ref[:, pos], rtol=0, atol=1e-12, msg=name)


def _train(tmp_path: Path, name: str, nproc: int, overrides: list[str], extra: list[str] = ()) -> tuple[list, str]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "recipes.train", "--config", DEMO, "--nproc", str(nproc), "--run-dir", str(run_dir),
           *extra]
    for o in CLI + overrides:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], out


def _sample(out: str) -> str:
    return out.split("sample      :", 1)[1].strip()


def _assert_equal_runs(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for key in ("loss", "total_loss", "mtp_loss", "grad_norm", "max_vio", "valid_loss"):
        assert [key in r for r in got] == [key in r for r in want], key
        assert [r[key] for r in got if key in r] == pytest.approx([r[key] for r in want if key in r], rel=REL), key
    assert [r["expert_load"] for r in got] == [r["expert_load"] for r in want]  # every token routed alike


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_ep_over_cp_ranks_equals_one_process_through_the_cli(tmp_path):
    """CP = 2 with EP = 2 spanning the two CP ranks (4 experts each), MTP depth 1, sequence-wise balance loss:
    per-step losses, MTP loss, gradient norm, balance violation, validation loss and every layer's expert loads
    equal one process; the greedy sample is the same text; the trace shows the exchanges inside compute."""
    trace = tmp_path / "trace.json"
    one, out1 = _train(tmp_path, "one", 1, ["parallel.ep=1"])
    two, out2 = _train(tmp_path, "two", 2, ["parallel.cp=2", "parallel.ep=2"], ["--trace", str(trace)])
    _assert_equal_runs(two, one)
    assert _sample(out2) == _sample(out1)
    _assert_exchanges_inside_compute(json.loads(trace.read_text())["traceEvents"], steps=3)


def _assert_exchanges_inside_compute(events: list[dict], steps: int) -> None:
    """The ``--trace`` of a CP = 2 run (schedule none, 2 micro-batches a step): every layer's latent all-gather
    (the demo's 4 layers and MTP's block) is a comm span inside a micro-batch's forward compute span, and its
    reduce-scatter inside the backward's, on both ranks (validation's forwards gather outside any action)."""
    events = [e for e in events if e["ph"] == "X"]
    layers = 4 + 1
    for rank in range(2):
        compute = [e for e in events if e["pid"] == rank and e["cat"] == "compute"]
        comm = [e for e in events if e["pid"] == rank and e["cat"] == "comm"]
        assert len([a for a in compute if a["name"].startswith("0F")]) == 2 * steps
        for name, action in (("cp all-gather", "0F"), ("backward cp reduce-scatter", "0B")):
            held = [c for c in comm if c["name"] == name for a in compute if a["name"].startswith(action)
                    and a["ts"] <= c["ts"] and c["ts"] + c["dur"] <= a["ts"] + a["dur"] + 1.0]  # 1 us: rounding
            assert len(held) == layers * 2 * steps, (rank, name, len(held))


@pytest.mark.dist
@pytest.mark.slow
@CP_CLI
@pytest.mark.timeout(600)
def test_cp4_equals_one_process_through_the_cli(tmp_path):
    """CP = 4 (chunks of 4 tokens: MTP's roll crosses a chunk border on every rank)."""
    one, out1 = _train(tmp_path, "one", 1, ["parallel.ep=1"])
    four, out4 = _train(tmp_path, "four", 4, ["parallel.cp=4", "parallel.ep=1"])
    _assert_equal_runs(four, one)
    assert _sample(out4) == _sample(out1)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@CP_CLI
def test_resume_across_a_change_of_cp_size(tmp_path):
    """A checkpoint written at CP = 2 resumes at CP = 1, and one written at CP = 1 resumes at CP = 2: the resumed
    step equals the uninterrupted one-process run's (checkpoints are CP-agnostic: CP ranks hold replicas)."""
    save = ["run.steps=2", "checkpoint.final=true"]
    ref, _ = _train(tmp_path, "ref", 1, ["parallel.ep=1"])
    _train(tmp_path, "cp2", 2, ["parallel.cp=2", "parallel.ep=1", *save])
    _train(tmp_path, "cp1", 1, ["parallel.ep=1", *save])
    ckpt = "checkpoints/step_000000002"
    to_one, _ = _train(tmp_path, "to_one", 1, ["parallel.ep=1"], ["--resume", str(tmp_path / "cp2" / ckpt)])
    to_two, _ = _train(tmp_path, "to_two", 2, ["parallel.cp=2", "parallel.ep=1"],
                       ["--resume", str(tmp_path / "cp1" / ckpt)])
    for resumed in (to_one, to_two):
        _assert_equal_runs(resumed, ref[2:])


@pytest.mark.dist
@pytest.mark.slow
@CP_CLI
@pytest.mark.timeout(1800)
def test_pipelines_with_cp2_equal_one_process_through_the_cli(tmp_path):
    """DualPipeV x CP = 2 x EP = 2 (over the CP ranks) x FP8, and ZB-V x CP = 2, through ``recipes.train`` on 4
    processes against one process (FP8 there too for the first). Losses, MTP loss and gradient norm: without
    FP8 within REL; with FP8 each step's values within ``test_combinations``' FP8 bounds (FP8_RTOL on the norm,
    FP8_LOSS_ATOL on the losses after the first step: FP8 rounding of a reordered sum can land on the other
    side of a scale boundary)."""
    from tests.test_combinations import FP8_LOSS_ATOL, FP8_RTOL, LOSS_ATOL

    batch = ["data.global_batch=8", "data.micro_batch=2"]  # 4 micro-batches: what ZB-V / DualPipeV at pp 2 need
    pipe = [*batch, "parallel.pp=2", "parallel.cp=2"]
    one, _ = _train(tmp_path, "one", 1, [*batch, "parallel.ep=1"])
    zbv, _ = _train(tmp_path, "zbv", 4, [*pipe, "parallel.schedule=zbv", "parallel.ep=1"])
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert [r[key] for r in zbv] == pytest.approx([r[key] for r in one], rel=REL), key
    one8, _ = _train(tmp_path, "one8", 1, [*batch, "parallel.ep=1", "model.fp8=true"])
    dpv, _ = _train(tmp_path, "dpv", 4, [*pipe, "parallel.schedule=dualpipev", "parallel.ep=2", "model.fp8=true"])
    assert len(dpv) == len(one8)
    for step, (a, b) in enumerate(zip(dpv, one8)):
        tol = LOSS_ATOL if step == 0 else FP8_LOSS_ATOL
        assert abs(a["loss"] - b["loss"]) <= tol and abs(a["mtp_loss"] - b["mtp_loss"]) <= tol, (step, a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=FP8_RTOL), (step, a, b)


# ---- in-process layouts against one process, final weights included (tests/test_combinations' bounds) ----

DSA = ["model.overrides.index_topk=4", "model.overrides.index_n_heads=4", "model.overrides.index_head_dim=16"]
LAYOUTS = [  # (name, --set items on top of matrix.BASE, the one-process reference's items, combination traits)
    ("cp4-ep2", ["parallel.schedule=none", "parallel.pp=1", "parallel.cp=4", "parallel.dp=1", "parallel.ep=2",
                 "model.fp8=false", *matrix.model_overrides(1)], dict(fp8=False, mtp=1)),
    ("dualpipev-cp2-ep2-fp8", ["parallel.schedule=dualpipev", "parallel.pp=2", "parallel.cp=2", "parallel.dp=1",
                               "parallel.ep=2", "model.fp8=true", *matrix.model_overrides(1),
                               "model.overrides.recompute=['norm', 'mla_up']"], dict(fp8=True, mtp=1)),
    ("dualpipe-cp2-ep2-eplb", ["parallel.schedule=dualpipe", "parallel.pp=2", "parallel.cp=2", "parallel.dp=1",
                               "parallel.ep=2", "model.fp8=false", *matrix.model_overrides(1), "eplb.enabled=true",
                               "eplb.redundant_experts=2", "eplb.interval=1"], dict(fp8=False, mtp=1)),
    ("zbv-cp2", ["parallel.schedule=zbv", "parallel.pp=2", "parallel.cp=2", "parallel.dp=1", "parallel.ep=1",
                 "model.fp8=false", *matrix.model_overrides(1)], dict(fp8=False, mtp=1)),
    ("dsa-warmup-cp2-dp2", ["parallel.schedule=none", "parallel.pp=1", "parallel.cp=2", "parallel.dp=2",
                            "parallel.ep=2", "model.fp8=false", *matrix.model_overrides(1), *DSA,
                            "model.overrides.dsa_warmup=true"], dict(fp8=False, mtp=1)),
    ("dsa-sparse-zbv-cp2", ["parallel.schedule=zbv", "parallel.pp=2", "parallel.cp=2", "parallel.dp=1",
                            "parallel.ep=1", "model.fp8=false", *matrix.model_overrides(1), *DSA],
     dict(fp8=False, mtp=1)),
]


def _reference_items(items: list[str]) -> list[str]:
    keep = [i for i in items if not i.startswith(("parallel.", "eplb."))]  # (EPLB moves experts, not the math)
    return ["parallel.schedule=none", "parallel.pp=1", "parallel.dp=1", "parallel.ep=1", *keep]


def _run_layouts(rank: int, world: int, layouts: list, run_dir: str) -> list[dict]:
    import torch.distributed as dist

    from training.parallel import init_parallel

    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    out = []
    for name, items, _ in layouts:
        cfg = matrix.config(items)
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        try:
            out.append(matrix.train(cfg, ps, Path(run_dir) / name))
        except Exception as exc:  # noqa: BLE001 - reported per layout
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        for g in {id(g): g for g in ps.groups.values() if g is not None}.values():
            dist.destroy_process_group(g)
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cp_layouts_equal_one_process(tmp_path):
    """CP = 4 x EP = 2; DualPipeV x CP = 2 x EP = 2 x FP8 with V3's recompute; DualPipe x CP = 2 x EP = 2 with EPLB
    re-planning every step; ZB-V x CP = 2; DSA's dense warm-up
    at CP = 2 x DP = 2 x EP = 2 and its sparse stage under ZB-V x CP = 2 (4 gloo processes each): per-step losses
    (main and MTP), gradient norms and every rank's final weights against one process."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_combinations import _compare
    from training.parallel import single_process

    with ThreadPoolExecutor(1) as pool:
        launch = pool.submit(run_distributed, _run_layouts, matrix.WORLD, LAYOUTS, str(tmp_path), timeout=1500.0)
        refs = {}
        for name, items, _ in LAYOUTS:
            cfg = matrix.config(_reference_items(items))
            refs[name] = matrix.train(cfg, single_process(cfg.parallel), tmp_path / f"ref-{name}", keep_initial=True)
        results = launch.result()
    failures = []
    for i, (name, _, traits) in enumerate(LAYOUTS):
        got = [results[rank][i] for rank in range(matrix.WORLD)]
        try:
            errors = [g["error"] for g in got if "error" in g]
            assert not errors, errors[0]
            _compare(traits, got, refs[name])
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


# ---- one-line errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, needle", [
    (["parallel.cp=4", "data.seq_len=8"], "each of the 2 x cp chunks of data.seq_len=8 holds 1 tokens"),
    (["parallel.cp=2", "balance.capacity_factor=1.25"], "balance.capacity_factor=1.25 with parallel.cp=2"),
    (["parallel.cp=2", "data.seq_len=30"], "data.seq_len=30 must be divisible by 2 x parallel.cp = 4"),
])
def test_bad_cp_values_are_one_line_errors(sets, needle, capsys):
    argv = ["--config", DEMO, "--dry-run", "--nproc", str(2 if "parallel.cp=2" in sets else 4)]
    for s in [*CLI, "parallel.ep=1", *sets]:
        argv += ["--set", s]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err

