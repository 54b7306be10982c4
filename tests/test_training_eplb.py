"""EPLB in the training runtime: it moves experts between GPUs without changing the math.

The strong check: a 2-rank (ep=2) run with EPLB on (2 redundant slots, a new plan after every
step) gives the same per-step losses and final logical expert weights as the same run with EPLB
off. Also: plans really change and the hottest expert gets replicas, replicas stay exact copies,
a checkpoint written under EPLB loads bit-exactly into a run without EPLB (logical layout), a
resume under EPLB continues bit-identically, and bad configs fail before training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from training.config import load_config

CONFIG = Path(__file__).resolve().parents[1] / "recipes/configs/tiny_cpu.toml"
STEPS, SAVE_AT = 4, 2
# The debug model (8 experts top-2, 4 groups) with 1 dense + 1 MoE layer + 1 MTP MoE layer: 2 MoE layers.
BASE = ["parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=none", f"run.steps={STEPS}",
        "run.threads=1", "model.fp8=false", "model.overrides.n_layers=2", "data.seq_len=16", "data.global_batch=8",
        "data.micro_batch=2", "optim.warmup_steps=2", "logging.wandb=disabled", "logging.progress=false",
        "logging.plot=false", "run.sample_tokens=0", "checkpoint.interval=0", "checkpoint.async_save=false",
        "balance.gamma=0.01"]
EPLB = ["eplb.enabled=true", "eplb.redundant_experts=2", "eplb.interval=1", "eplb.ema_decay=0.5"]


def _cfg(extra=()):
    return load_config(CONFIG, BASE + list(extra))


def _expert_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model_state_dict().items() if ".experts." in k}


def _gather_physical(trainer) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Independent of the runtime's conversion: every rank's raw physical w13 rows with the plan row."""
    import torch.distributed as dist

    out = []
    group = trainer.ps.group("ep")
    for i, layer in enumerate(trainer.eplb.layers):
        w = layer.experts.w13.detach()
        rows = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, w.contiguous(), group=group)
        out.append((torch.cat(rows), trainer.eplb.phy2log[i].clone(), torch.tensor(layer.experts.expert_ids)))
    return out


def _run(trainer, steps: int, record: dict) -> None:
    for _ in range(steps):
        metrics = trainer.train_step()
        record.setdefault("loss", []).append(metrics["loss"])
        record.setdefault("grad_norm", []).append(metrics["grad_norm"])
        record.setdefault("ep_imbalance", []).append(metrics.get("ep_imbalance"))
        if trainer.eplb is not None:
            record.setdefault("plans", []).append(trainer.eplb.phy2log.clone())
            record.setdefault("ema", []).append(trainer.eplb.ema.load.clone())


def _rank_main(rank: int, world: int, tmp: str) -> dict:
    from training.checkpoint.trainer_hooks import attach, load_checkpoint
    from training.parallel import init_parallel
    from training.trainer import Trainer

    tmp = Path(tmp)
    out: dict = {}

    def trainer_for(extra=()):
        cfg = _cfg(extra)
        return cfg, Trainer(cfg, init_parallel(cfg.parallel, 120.0), tmp / "run")

    # 1. EPLB off: the reference (checkpoint at SAVE_AT too)
    cfg, off = trainer_for()
    off_hooks = attach(off, cfg, tmp / "off")
    out["off"] = {}
    _run(off, SAVE_AT, out["off"])
    off_hooks.save(sync=True)
    out["off_saved"] = {k: v.clone() for k, v in off.model_state_dict().items()}
    _run(off, STEPS - SAVE_AT, out["off"])
    off_hooks.close()
    out["off"]["experts"] = _expert_state(off)
    out["off_keys"] = {k: tuple(v.shape) for k, v in off.model_state_dict().items()}

    # 2. EPLB on, checkpoint at SAVE_AT
    cfg, on = trainer_for(EPLB)
    hooks = attach(on, cfg, tmp / "on")
    out["on"] = {}
    _run(on, SAVE_AT, out["on"])
    hooks.save(sync=True)
    out["saved"] = {k: v.clone() for k, v in on.model_state_dict().items()}
    out["saved_keys"] = {k: tuple(v.shape) for k, v in out["saved"].items()}
    _run(on, STEPS - SAVE_AT, out["on"])
    hooks.close()
    out["on"]["experts"] = _expert_state(on)
    out["physical"] = _gather_physical(on)
    folder = tmp / "on" / "checkpoints" / f"step_{SAVE_AT:09d}"

    # 3. the EPLB checkpoint into a run without EPLB
    _, plain = trainer_for()
    load_checkpoint(plain, folder)
    out["plain_loaded"] = {k: v.clone() for k, v in plain.model_state_dict().items()}
    out["plain"] = {}
    _run(plain, STEPS - SAVE_AT, out["plain"])

    # 4. resume under EPLB
    _, again = trainer_for(EPLB)
    load_checkpoint(again, folder)
    out["resumed_plan"] = again.eplb.phy2log.clone()
    out["resumed"] = {}
    _run(again, STEPS - SAVE_AT, out["resumed"])
    out["resumed"]["experts"] = _expert_state(again)

    # 5. resume the EPLB checkpoint with more redundant slots: the saved plan is dropped, its load average kept
    _, wider = trainer_for(EPLB + ["eplb.redundant_experts=4"])
    load_checkpoint(wider, folder)
    out["wider_loaded"] = {k: v.clone() for k, v in wider.model_state_dict().items()}
    out["wider_ema"] = wider.eplb.ema.load.clone()
    out["wider"] = {}
    _run(wider, STEPS - SAVE_AT, out["wider"])

    # 6. a checkpoint written without EPLB, resumed with EPLB on (the uniform-load plan)
    _, late = trainer_for(EPLB)
    load_checkpoint(late, tmp / "off" / "checkpoints" / f"step_{SAVE_AT:09d}")
    out["late_loaded"] = {k: v.clone() for k, v in late.model_state_dict().items()}
    out["late"] = {}
    _run(late, STEPS - SAVE_AT, out["late"])
    out["late"]["experts"] = _expert_state(late)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_rank_main, 2, str(tmp_path_factory.mktemp("eplb")), timeout=240)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_eplb_changes_placement_not_math(runs):
    """Replicas are exact copies whose gradients are summed, so EPLB on equals EPLB off up to fp32
    summation order: a replicated expert's weight gradient is two partial GEMM sums added, instead of
    one GEMM over all its rows, and the grouped rows arrive in another order. Measured: losses agree to
    1.2e-7, gradient norms to ~1e-7 relative and weights to 1.3e-7 over 4 steps. 1e-5 on losses (which
    move by ~0.3 nats), 1e-5 relative on the clipped gradient norm and 1e-6 on weights (each moves by
    ~5e-3 in 2 steps) fail on a missing replica-gradient sum (measured: losses 1.5e-3 and weights 1.6e-2
    apart), on replicas counted twice in the norm (norm 6e-4 relative off, weights 1.6e-6) or on an
    expert moved to the wrong slot."""
    for rank, r in enumerate(runs):
        assert r["on"]["loss"] == pytest.approx(r["off"]["loss"], abs=1e-5), (rank, r["on"]["loss"], r["off"]["loss"])
        assert r["on"]["grad_norm"] == pytest.approx(r["off"]["grad_norm"], rel=1e-5)
        assert r["on"]["experts"].keys() == r["off"]["experts"].keys()
        for k, w in r["off"]["experts"].items():
            torch.testing.assert_close(r["on"]["experts"][k], w, rtol=0, atol=1e-6, msg=f"rank {rank} {k}")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_plans_change_and_the_hottest_expert_is_replicated(runs):
    r = runs[0]
    plans, emas = r["on"]["plans"], r["on"]["ema"]
    assert any(not torch.equal(a, b) for a, b in zip(plans, plans[1:])), "the plan never changed between steps"
    for plan, ema in zip(plans, emas):
        for layer in range(plan.shape[0]):
            copies = torch.bincount(plan[layer], minlength=8)
            assert copies.min() >= 1 and copies.sum() == 10
            assert copies[int(ema[layer].argmax())] >= 2, (plan[layer], ema[layer])  # the hottest has a replica
    for other in runs[1:]:  # every rank derived the same plans from the all-reduced loads
        assert all(torch.equal(a, b) for a, b in zip(plans, other["on"]["plans"]))
    # ep_imbalance: max / mean rows per EP rank, measured on both runs
    assert all(v is not None and v >= 1.0 for v in r["on"]["ep_imbalance"] + r["off"]["ep_imbalance"])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_replicas_stay_exact_copies_and_match_the_logical_state(runs):
    for rank, r in enumerate(runs):
        for layer, (rows, phy2log, local) in enumerate(r["physical"]):
            per_rank = rows.shape[0] // 2
            assert torch.equal(local, phy2log[rank * per_rank:(rank + 1) * per_rank])
            for e in phy2log.unique().tolist():
                slots = (phy2log == e).nonzero().flatten()
                for s in slots[1:]:
                    assert torch.equal(rows[s], rows[slots[0]]), (layer, e)  # bit-identical replicas
            # the saved (logical) state is this rank's 4 logical experts, taken from the physical rows
            key = [k for k in r["on"]["experts"] if k.endswith("experts.w13")][layer]
            first = torch.stack([rows[(phy2log == e).nonzero()[0, 0]] for e in range(4 * rank, 4 * rank + 4)])
            assert torch.equal(r["on"]["experts"][key], first)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_eplb_checkpoint_is_logical_and_loads_without_eplb(runs):
    for r in runs:
        assert r["saved_keys"] == r["off_keys"]  # same names and shapes as a run without EPLB
        assert r["plain_loaded"].keys() == r["saved"].keys()
        for k, v in r["saved"].items():
            assert torch.equal(r["plain_loaded"][k], v), k  # bit-exact in the logical layout
        # and it trains on from there like the EPLB run (placement only differs: fp32 order, as above)
        assert r["plain"]["loss"] == pytest.approx(r["on"]["loss"][SAVE_AT:], abs=1e-5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_with_other_redundancy_keeps_weights_and_load_average(runs):
    for r in runs:
        for k, v in r["saved"].items():
            assert torch.equal(r["wider_loaded"][k], v), k
        assert torch.equal(r["wider_ema"], r["on"]["ema"][SAVE_AT - 1])
        assert all(p.shape[-1] == 12 for p in r["wider"]["plans"])  # 8 + 4 slots from the first re-plan on
        assert r["wider"]["loss"] == pytest.approx(r["on"]["loss"][SAVE_AT:], abs=1e-5)  # fp32 order, as above


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_checkpoint_without_eplb_resumes_with_eplb_on(runs):
    """Turning EPLB on at a resume: the logical weights land in the physical slots bit-exactly and the run
    continues like the one without EPLB (fp32 summation order only; tolerances as above)."""
    for rank, r in enumerate(runs):
        for k, v in r["off_saved"].items():
            assert torch.equal(r["late_loaded"][k], v), k
        assert r["late"]["loss"] == pytest.approx(r["off"]["loss"][SAVE_AT:], abs=1e-5)
        for k, w in r["off"]["experts"].items():
            torch.testing.assert_close(r["late"]["experts"][k], w, rtol=0, atol=1e-6, msg=f"rank {rank} {k}")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_under_eplb_is_bit_identical(runs):
    for r in runs:
        assert torch.equal(r["resumed_plan"], r["on"]["plans"][SAVE_AT - 1])
        assert r["resumed"]["loss"] == r["on"]["loss"][SAVE_AT:]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"]["plans"], r["on"]["plans"][SAVE_AT:]))
        for k, v in r["on"]["experts"].items():
            assert torch.equal(r["resumed"]["experts"][k], v), k


def _zero1_rank(rank: int, world: int, tmp: str) -> dict:
    """dp=4, ep=2: expert optimizer states are ZeRO-1 sharded over the 2 ranks holding the same experts."""
    from training.optim import split_zero
    from training.parallel import init_parallel
    from training.trainer import Trainer

    out = {}
    for name, extra in (("off", []), ("on", EPLB)):
        cfg = _cfg(["parallel.dp=4", "parallel.zero1=true", "run.steps=3", *extra])
        trainer = Trainer(cfg, init_parallel(cfg.parallel, 120.0), Path(tmp) / name)
        out[name] = {}
        _run(trainer, 3, out[name])
        out[name]["experts"] = _expert_state(trainer)
        expert_opt = split_zero(trainer.optimizer.optimizers[-1])[0]
        out[name]["owned"] = sum(len(g["params"]) for g in expert_opt.param_groups)
        out[name]["total"] = len(trainer.optimizer.expert_params)
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_eplb_with_zero1_sharded_expert_states_matches_eplb_off(tmp_path):
    """With ZeRO-1 over ``edp`` every rank of an EP group owns the same expert tensors' moments, so they
    move together; the run equals EPLB off (tolerances as in ``test_eplb_changes_placement_not_math``)."""
    runs = run_distributed(_zero1_rank, 4, str(tmp_path), timeout=240)
    for rank, r in enumerate(runs):
        assert r["on"]["owned"] < r["on"]["total"]  # the expert moments really are sharded
        assert r["on"]["loss"] == pytest.approx(r["off"]["loss"], abs=1e-5)
        assert r["on"]["grad_norm"] == pytest.approx(r["off"]["grad_norm"], rel=1e-5)
        for k, w in r["off"]["experts"].items():
            torch.testing.assert_close(r["on"]["experts"][k], w, rtol=0, atol=1e-6, msg=f"rank {rank} {k}")


@pytest.mark.parametrize("extra,match", [
    (["parallel.ep=1"], r"parallel.ep must be > 1"),
    (["eplb.redundant_experts=1"], r"8 \+ 1 = 9 physical experts must be divisible by parallel.ep=2"),
    (["eplb.interval=0"], r"interval >= 1"),
    (["eplb.ema_decay=1.0"], r"ema_decay in \[0, 1\)"),
    (["eplb.num_nodes=4"], r"num_nodes=4 must divide num_gpus=2"),
    (["eplb.num_groups=3"], r"num_groups=3 must divide the 8 experts"),
    (["model.overrides.n_dense_layers=2", "model.overrides.n_mtp_layers=0"], r"no MoE layer"),
])
def test_bad_eplb_configs_fail_before_training(extra, match):
    from training.trainer import check_static

    with pytest.raises(ValueError, match=match):
        check_static(_cfg(EPLB + extra))


def _recipe_rank(rank: int, world: int, out: str) -> int:
    from recipes.expert_balance import main

    return main(["--steps", "3", "--strategies", "aux_free", "--eplb", "2", "--eplb-interval", "1", "--out", out,
                 "--eval-batches", "1", "--set", "model.preset=debug_tiny", "--set", "model.overrides.n_mtp_layers=0",
                 "--set", "data.seq_len=16", "--set", "data.global_batch=4", "--set", "data.micro_batch=2",
                 "--set", "parallel.dp=2", "--set", "parallel.ep=2", "--set", "run.threads=1"])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_expert_balance_recipe_reports_rank_imbalance_with_and_without_eplb(tmp_path):
    import csv

    out = tmp_path / "report"
    assert run_distributed(_recipe_rank, 2, str(out), timeout=200) == [0, 0]
    rows = {r["strategy"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert set(rows) == {"aux_free", "aux_free@eplb"}
    for r in rows.values():
        assert float(r["ep_imbalance_last"]) >= 1.0  # max / mean over EP ranks
    # EPLB moves experts, not the math: the same losses (fp32 order only, see test_eplb_changes_placement_not_math)
    assert float(rows["aux_free@eplb"]["final_loss"]) == pytest.approx(float(rows["aux_free"]["final_loss"]), abs=1e-5)
    assert (out / "ep_imbalance.png").stat().st_size > 0 and (out / "aux_free_eplb.jsonl").exists()


def test_recipe_eplb_without_expert_parallelism_fails_before_training(tmp_path, capsys):
    from recipes.expert_balance import main

    assert main(["--steps", "1", "--strategies", "none", "--eplb", "2", "--out", str(tmp_path / "r"),
                 "--set", "model.preset=debug_tiny"]) == 2
    assert "parallel.ep must be > 1" in capsys.readouterr().err


def test_memory_estimate_counts_the_redundant_slots():
    """``--dry-run``'s per-rank estimate: each EP rank holds (8 + 2) / 2 = 5 expert slots instead of 4."""
    from planner.memory import estimate
    from training.trainer import model_args

    off, on = _cfg(), _cfg(EPLB)
    (a,), (b,) = estimate(off, model_args(off)), estimate(on, model_args(on))
    assert b.expert_params * 4 == a.expert_params * 5 and a.expert_params > 0
    assert b.params - b.expert_params == a.params - a.expert_params  # dense part unchanged


def test_example_config_validates_and_round_trips():
    """``recipes/configs/eplb_cpu.toml`` passes every pre-launch check; ``[eplb]`` survives the run folder's
    config.toml and stays out of the config hash (a resume may switch EPLB on or off)."""
    import tomllib

    from training.checkpoint import format as fmt
    from training.config import numerics_dict
    from training.trainer import check_static

    cfg = load_config(CONFIG.parent / "eplb_cpu.toml")
    check_static(cfg)
    assert cfg.eplb.enabled and cfg.eplb.redundant_experts == 2
    assert tomllib.loads(cfg.to_toml())["eplb"]["interval"] == cfg.eplb.interval
    off = load_config(CONFIG.parent / "eplb_cpu.toml", ["eplb.enabled=false"])
    assert fmt.config_hash(numerics_dict(off)) == fmt.config_hash(numerics_dict(cfg))
