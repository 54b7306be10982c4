"""Interleaved 1F1B in the planner: the simulator's schedule with per-chunk durations, the layout key ``vpp``,
the search comparing it with DualPipe(V), and the written config the launch accepts."""

from __future__ import annotations

import math

from dualpipe.schedules import build
from dualpipe.simulator import Costs, simulate
from planner.costs import Durations
from planner.memory import estimate
from planner.search import Layout, Request, Space, assemble, evaluate, layouts, search
from planner.system import load_system
from recipes import plan
from training.config import load_config
from training.trainer import model_args


def test_assembly_is_the_simulator_with_uniform_chunks():
    d = Durations(f=1.0, i=1.2, w=0.8)
    for pp, vpp, n in ((2, 2, 4), (4, 2, 8), (4, 4, 12)):
        got = assemble("interleaved1f1b", pp, n, [d] * (pp * vpp), p2p=0.05, sm_fraction=0.0, vpp=vpp)
        ref = simulate(build("interleaved1f1b", pp, n, vpp=vpp), Costs(F=1.0, B=2.0, W=0.8, p2p=0.05))
        assert math.isclose(got.makespan, ref.makespan, rel_tol=1e-12), (pp, vpp, n)


def _request() -> Request:
    base = load_config("recipes/configs/tiny_cpu.toml", ["model.overrides.n_mtp_layers=0"])
    return Request(base, load_system("H100"), 8, base.data.seq_len, 32)


def test_search_compares_interleaved_with_dualpipe():
    req = _request()
    args = model_args(req.base)
    space = Space(micro_batch=(2,), recompute=("none",), fp8=(False,), moments=("bfloat16",))
    lays = list(layouts(req, args, space))
    # 4 layers: pp 2 takes vpp 2 only (pp x vpp chunks of at least one layer), pp 4 none
    assert {(x.pp, x.vpp) for x in lays if x.schedule == "interleaved1f1b"} == {(2, 2)}
    assert all(x.vpp == 1 for x in lays if x.schedule != "interleaved1f1b")
    evals = {(e.layout.pp, e.layout.ep, e.layout.schedule): e for e in search(req, args, space)}
    inter, dual = evals[(2, 4, "interleaved1f1b")], evals[(2, 4, "dualpipev")]
    assert inter.status == "ok" and dual.status == "ok"
    assert "interleaved1f1b vpp2" in str(inter.layout)
    # its bubble is half of 1F1B's on the same layout (vpp 2), up to the uneven parts and the messages
    one = evals[(2, 4, "1f1b")]
    assert inter.bubble_fraction < one.bubble_fraction


def test_cli_fix_vpp_writes_a_config_the_launch_accepts(tmp_path, capsys):
    from recipes import train

    out = tmp_path / "vpp.toml"
    assert plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--gpu", "H100", "--set",
                      "model.overrides.n_mtp_layers=0", "--fix", "pp=2,dp=4,ep=4,schedule=interleaved1f1b,vpp=2,"
                      "micro_batch=2,microbatches=4,fp8=false,recompute=none,moments=bfloat16",
                      "--write-config", str(out)]) == 0
    assert "pp2 dp4 ep4 interleaved1f1b vpp2 mb2x4" in capsys.readouterr().out
    cfg = load_config(out)
    assert (cfg.parallel.schedule, cfg.parallel.vpp) == ("interleaved1f1b", 2)
    assert train.main(["--config", str(out), "--dry-run", "--device", "H100"]) == 0
    gib = estimate(cfg, model_args(cfg), device="H100").peak_bytes / 1024**3
    assert f"{gib:.2f}" in capsys.readouterr().out
    ev = evaluate(_request(), Layout(2, 4, 4, "interleaved1f1b", 2, 4, fp8=False, vpp=2))
    assert ev.status == "ok" and math.isclose(ev.peak_bytes / 1024**3, gib, rel_tol=1e-12)
    assert plan.main(["--model", "recipes/configs/tiny_cpu.toml", "--gpu", "H100", "--fix", "vpp=0"]) == 2
    assert "--fix vpp: expected a positive integer" in capsys.readouterr().err
