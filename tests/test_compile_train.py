"""``run.compile = true`` through the real CLI (``python -m recipes.train``) equals the eager run: per-step losses
(main, MTP), gradient norms and the final weights of every rank, on one process and on a 4-process gloo layout
(DualPipeV x EP 2 x FP8 x MTP, compiled per block and, around the all-to-alls, per plan piece). Settings the
compiled path cannot take are refused at launch in one line naming the keys.

Backend ``aot_eager`` (dynamo's capture and AOTAutograd's joint graph and partitioned backward, without Inductor's
code generation, which costs minutes of CPU per rank): the forward runs eager's aten ops in eager's order, the
compiled backward sums a tensor's gradient contributions inside its graph rather than node by node. The runs then
differ in fp32 summation order only, the case the combination matrix bounds (``tests/test_combinations.py``'s
docstring derives them for these sizes, ``tests/matrix.py``): losses within ``LOSS_ATOL``, gradient norms within
``GRAD_NORM_RTOL``, each weight tensor's update ``w - w0`` within ``UPDATE_RTOL`` of the eager update's largest
element; with FP8 a reordered sum may move a gradient tile across an e4m3 rounding boundary, so updates are compared
by direction (``FP8_UPDATE_DIFF``) as the matrix does. A module that silently ran eager would pass these numbers,
so the one-process test also counts the compiled graphs (and 0 graph breaks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from accel.numerics import calc_diff
from recipes.train import main as train_main
from tests import matrix
from tests.test_combinations import FP8_LOSS_ATOL, FP8_RTOL, FP8_UPDATE_DIFF, GRAD_NORM_RTOL, LOSS_ATOL, UPDATE_RTOL
from training.checkpoint.manager import read_checkpoint

STEPS = 3
LR = 0.5  # matrix.BASE's
# the matrix's shared small run (debug_tiny widths, lr 0.5 with AdamW eps 1, 8 x 16 tokens a step), 3 steps, final
# weights saved, nothing sampled
BASE = [s for s in matrix.BASE if not s.startswith(("run.steps=", "checkpoint.final="))] + [
    f"run.steps={STEPS}", "checkpoint.final=true", "logging.eval_batches=1", "run.compile_backend=aot_eager"]
ONE = ["model.fp8=false", "parallel.schedule=none", "parallel.pp=1", "parallel.dp=1", "parallel.ep=1",
       "model.overrides.n_layers=3", "model.overrides.n_mtp_layers=1"]
# FP8 compiles without the memory policy's SwiGLU cast and without health sampling (refused otherwise, below)
FOUR = ["parallel.schedule=dualpipev", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "model.fp8=true",
        "model.overrides.fp8_cache_activations=false", "logging.fp8_health_every=0", "model.overrides.n_layers=3",
        "model.overrides.n_mtp_layers=1"]


def _train(run_dir: Path, sets: list[str], nproc: int = 1) -> None:
    argv = ["--config", matrix.CONFIG, "--run-dir", str(run_dir), "--nproc", str(nproc)]
    for item in BASE + sets:
        argv += ["--set", item]
    assert train_main(argv) == 0


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "grad_norm" in r]


def _saved(run_dir: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank ``rank``'s final weights and AdamW first moments (``exp_avg``, by parameter name) from its checkpoint."""
    (folder,) = sorted((run_dir / "checkpoints").glob("step_*"))
    state = read_checkpoint(folder, rank, sections=["model", "optimizer"]).state
    moments = {name: s["exp_avg"] for opt in state["optimizer"] for name, s in opt["state"].items()}
    return state["model"], moments


def _close(got: torch.Tensor, want: torch.Tensor, fp8: bool, atol: float) -> bool:
    if fp8:  # by direction (see the module docstring); a tensor of zeros (a frozen or unused one) must stay zero
        return bool(torch.equal(got, want)) if not want.any() else calc_diff(got, want) <= FP8_UPDATE_DIFF
    return bool((got - want).abs().max() <= atol)


def _compare(eager: Path, compiled: Path, world: int, fp8: bool) -> None:
    """The runs' metrics per step, and per rank the final weights and AdamW first moments. The moment
    ``m = (1 - b1) sum_t b1^(T - t) g_t`` mixes the three steps' gradients: a dropped or doubled contribution moves
    it by >= 10%, so it is compared at ``UPDATE_RTOL`` of its largest element. The weights: AdamW with eps 1 above
    every clipped |g| <= 1 moves an element by at most lr per step, so ``UPDATE_RTOL`` of each step's update is at
    most ``STEPS x lr x UPDATE_RTOL``."""
    want, got = _metrics(eager), _metrics(compiled)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    loss_atol, norm_rtol = (FP8_LOSS_ATOL, FP8_RTOL) if fp8 else (LOSS_ATOL, GRAD_NORM_RTOL)
    for w, g in zip(want, got):
        for key in ("loss", "total_loss", "mtp_loss")[:3 if "mtp_loss" in w else 2]:
            assert abs(g[key] - w[key]) <= (LOSS_ATOL if w["step"] == 1 else loss_atol), (w["step"], key, g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= norm_rtol * w["grad_norm"], (w["step"], g, w)
    for rank in range(world):
        (w_model, w_m), (g_model, g_m) = _saved(eager, rank), _saved(compiled, rank)
        assert sorted(g_model) == sorted(w_model) and sorted(g_m) == sorted(w_m) and w_m
        for name, w in w_model.items():
            g = g_model[name]
            assert torch.isfinite(g).all(), name
            if not w.is_floating_point():
                assert torch.equal(g, w), name
            else:
                assert _close(g, w, fp8, STEPS * LR * UPDATE_RTOL), (rank, name)
        for name, w in w_m.items():
            assert _close(g_m[name], w, fp8, UPDATE_RTOL * float(w.abs().max())), (rank, name)


@pytest.mark.parametrize("sets, refused", [
    (["model.overrides.recompute=['v3']"], "run.compile=true with model.overrides.recompute=['v3']: "),
    (["model.overrides.recompute=['block']"], "model.overrides.recompute=['block']: "),
    (["model.fp8=true"], "model.overrides.fp8_cache_activations=false"),
    (["model.fp8=true", "model.overrides.fp8_cache_activations=false"], "logging.fp8_health_every=10"),
    (["model.fp8=false", 'model.preset="debug_dsa"', "model.overrides.index_head_dim=32",
      'model.indexer_qk_format="mxfp4_hadamard"'], "FP8 / FP4 casts and logging.fp8_health_every=10"),
    (["run.compile_backend=tvm"], "run.compile_backend must be one of inductor, aot_eager, eager, got 'tvm'"),
])
def test_compile_refuses_what_cannot_compile(sets, refused, capsys, monkeypatch):
    monkeypatch.setattr("recipes.train.relaunch", lambda *a, **k: pytest.fail("a process started"))
    argv = ["--config", matrix.CONFIG, "--dry-run", "--set", "run.compile=true"]
    for item in sets:
        argv += ["--set", item]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and refused in err and len(err.splitlines()) == 1, err


def test_compile_key_is_a_bool(capsys):
    assert train_main(["--config", matrix.CONFIG, "--dry-run", "--set", "run.compile=1"]) == 2
    assert "config key 'run.compile': expected true or false, got 1" in capsys.readouterr().err


@pytest.mark.slow
def test_one_process_compiled_equals_eager(tmp_path):
    """MoE + dense layers, MLA, MTP: compiled per block equals eager."""
    _train(tmp_path / "eager", ONE)
    torch._dynamo.reset()
    counters.clear()
    _train(tmp_path / "compiled", ONE + ["run.compile=true"])
    # the dense block, the MoE blocks (the MTP block's too), the MTP and head norms, eh_proj: at least 4 graphs,
    # each traced whole
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 4
    _compare(tmp_path / "eager", tmp_path / "compiled", 1, fp8=False)


@pytest.mark.slow
@pytest.mark.dist
def test_dualpipev_ep_fp8_mtp_compiled_equals_eager(tmp_path):
    """4 gloo processes, DualPipeV with overlapped F&B (the plan's pieces), EP 2 (compiled between the all-to-alls),
    FP8, MTP: every rank's weights and the losses equal the eager run's."""
    _train(tmp_path / "eager", FOUR, nproc=4)
    _train(tmp_path / "compiled", FOUR + ["run.compile=true"], nproc=4)
    _compare(tmp_path / "eager", tmp_path / "compiled", 4, fp8=True)


# the other schedules on pp 2 x dp 2 (EP 2 where the layout allows it, MTP where the schedule puts the embedding
# beside the head): opt-in, ~2-5 minutes each on 2 cores
SCHEDULES = {
    "1f1b": ["parallel.schedule=1f1b", "parallel.ep=2", "model.overrides.n_layers=4", "model.overrides.n_mtp_layers=0"],
    "zb1p": ["parallel.schedule=zb1p", "parallel.ep=2", "model.overrides.n_layers=4", "model.overrides.n_mtp_layers=0"],
    "zbv": ["parallel.schedule=zbv", "parallel.ep=1", "model.overrides.n_layers=3", "model.overrides.n_mtp_layers=1"],
    "dualpipe": ["parallel.schedule=dualpipe", "parallel.ep=2", "model.overrides.n_layers=3",
                 "model.overrides.n_mtp_layers=1"],
    "interleaved1f1b": ["parallel.schedule=interleaved1f1b", "parallel.vpp=2", "parallel.ep=2",
                        "model.overrides.n_layers=4", "model.overrides.n_mtp_layers=0"],
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(os.environ.get("DSV3_COMPILE_ALL_SCHEDULES") != "1",
                    reason="opt-in: DSV3_COMPILE_ALL_SCHEDULES=1 (each schedule trains twice on 4 processes)")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_schedule_compiled_equals_eager(schedule, tmp_path):
    sets = ["parallel.pp=2", "parallel.dp=2", "model.fp8=false", *SCHEDULES[schedule]]
    _train(tmp_path / "eager", sets, nproc=4)
    _train(tmp_path / "compiled", sets + ["run.compile=true"], nproc=4)
    _compare(tmp_path / "eager", tmp_path / "compiled", 4, fp8=False)
