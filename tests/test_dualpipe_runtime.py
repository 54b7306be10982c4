"""Multi-rank runtime tests (gloo, CPU, float64): every schedule against a single-process run.

Tolerances: per-micro-batch losses and forward-only outputs must be bitwise equal (same float64
kernels on the same shapes in the same order); gradients sum the micro-batches in another order
across ranks, so they match to calc_diff < 1e-13 (DESIGN.md, upstream DualPipe's own check).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dualpipe import DualPipe, DualPipeV, Pipeline
from dualpipe.comm import P2PMismatchError, P2PTimeoutError
from dualpipe.schedules import build
from dualpipe.utils import calc_diff, run_backward
from dualpipe.weight_grad import LinearWithDeferredWGrad
from tests.dist_utils import run_distributed

GRAD_TOL = 1e-13


# -- toy model ------------------------------------------------------------------------------------
class ToyStage(nn.Module):
    """A deferring linear (so I/W splitting really happens), tanh, and a plain linear (no deferral)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.deferred = LinearWithDeferredWGrad(d_in, d_out, dtype=torch.float64)
        self.plain = nn.Linear(d_out, d_out, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.plain(torch.tanh(self.deferred(x)))
        self.__dict__.setdefault("produced", []).append(out)  # the test checks sent outputs get freed
        return out


class OverlapStage(ToyStage):
    """ToyStage with upstream's ``overlapped_forward_backward`` classmethod; counts its calls."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        cls.calls += 1
        outputs0 = module0(*inputs0)
        loss0 = criterion0(outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


class ViewStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x)[:, :2]  # a view of a larger tensor


def widths(num_parts: int) -> list[int]:
    """Stage widths vary so consecutive messages carry different shapes (exercises the P2P header)."""
    return [5 + (s * 3) % 4 for s in range(num_parts + 1)]


def make_model(num_parts: int, seed: int, cls: type[nn.Module] = ToyStage) -> nn.ModuleList:
    torch.manual_seed(seed)
    w = widths(num_parts)
    return nn.ModuleList(cls(w[s], w[s + 1]) for s in range(num_parts))


def make_batch(num_parts: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    w = widths(num_parts)
    return (torch.randn(batch, w[0], generator=g, dtype=torch.float64),
            torch.randn(batch, w[-1], generator=g, dtype=torch.float64))


def criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, label)


def reference(model: nn.ModuleList, x: torch.Tensor, y: torch.Tensor, chunks: int):
    """Single-process run over the same micro-batches: per-micro-batch losses, outputs, grads per part."""
    ref = copy.deepcopy(model)
    losses, outs = [], []
    for xm, ym in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
        h = xm
        for part in ref:
            h = part(h)
        loss = criterion(h, ym)
        loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    return torch.stack(losses), torch.cat(outs), [[p.grad.clone() for p in part.parameters()] for part in ref]


# -- one schedule, one rank ----------------------------------------------------------------------------
def _check_schedule(rank: int, world: int, name: str, chunks: int, seed: int, cls: type[nn.Module] = ToyStage,
                    vpp: int = 1) -> dict:
    """Train one step and run one inference step of ``name``; return what the parent asserts on."""
    sched = build(name, world, chunks, vpp)
    lay = sched.layout
    num_parts = world * vpp if name in ("1f1b", "zb1p", "dualpipe", "interleaved1f1b") else 2 * world
    model = make_model(num_parts, seed, cls)
    x, y = make_batch(num_parts, 3 * chunks, seed)
    ref_loss, ref_out, ref_grads = reference(model, x, y, chunks)

    def part_of(stage: int) -> int:
        return stage if stage < num_parts else stage - num_parts  # DualPipe: stage PP+j is part j

    parts = [part_of(s) for s in lay.stages_of(rank)]
    mods = [copy.deepcopy(model[p]) for p in parts]
    half = chunks // 2
    if name == "dualpipe":
        pipe = DualPipe(tuple(mods))
        ins = {0: (x.tensor_split(2)[0],), world - 1: (x.tensor_split(2)[1],)}.get(rank, (None,))
        labs = {0: (y.tensor_split(2)[1],), world - 1: (y.tensor_split(2)[0],)}.get(rank, (None,))
        expect = {0: slice(half, chunks), world - 1: slice(0, half)}.get(rank)
    elif name == "dualpipev":
        pipe = DualPipeV(tuple(mods))
        ins, labs, expect = (x,), (y,), (slice(0, chunks) if rank == 0 else None)
    else:
        pipe = Pipeline(mods, name, vpp=vpp)
        first, last = lay.stage_rank[0], lay.stage_rank[lay.num_stages - 1]
        ins = (x,) if rank == first else (None,)
        labs = (y,) if rank == last else (None,)
        expect = slice(0, chunks) if rank == last else None

    loss, out = pipe.step(*ins, num_chunks=chunks, criterion=criterion, labels=labs)
    sent = [m for s, m in zip(lay.stages_of(rank), mods)
            if lay.next_stage(s) is not None and lay.stage_rank[lay.next_stage(s)] != rank]
    freed = all(t.numel() == 0 for m in sent for t in m.__dict__.get("produced", []))
    res = {"sent_outputs_freed": freed, "stats": dict(pipe.last_step_stats), "store_left": pipe.store.pending(),
           "out_none": out is None}
    res["loss_equal"] = (loss is None) if expect is None else bool(torch.equal(loss, ref_loss[expect]))
    if name == "dualpipe":
        pipe.sync_mirrored_grads()
    res["grad_diff"] = max(calc_diff(p.grad, g) for mod, part in zip(mods, parts)
                           for p, g in zip(mod.parameters(), ref_grads[part]))
    with torch.no_grad():
        loss2, out2 = pipe.step(*ins, num_chunks=chunks, criterion=criterion, labels=labs, return_outputs=True)
    if expect is None:
        res["fwd_equal"] = loss2 is None and out2 is None
    else:
        res["fwd_equal"] = bool(torch.equal(out2, ref_out[3 * expect.start: 3 * expect.stop])
                                and torch.equal(loss2, ref_loss[expect]))
    res["overlap_calls"] = getattr(cls, "calls", 0)
    return res


def _all_schedules(rank: int, world: int) -> dict:
    out = {}
    names = ["1f1b", "zb1p", "zbv", "dualpipev"] + (["dualpipe"] if world % 2 == 0 else [])
    for i, name in enumerate(names):
        out[name] = _check_schedule(rank, world, name, 2 * world + 2, seed=10 * world + i)
    # interleaved 1F1B (micro-batches a multiple of the ranks): 3 model chunks a rank, and 2 with other sizes
    out["interleaved1f1b"] = _check_schedule(rank, world, "interleaved1f1b", 2 * world, 7 * world, vpp=3)
    out["interleaved1f1b-vpp2"] = _check_schedule(rank, world, "interleaved1f1b", 3 * world, 7 * world + 1, vpp=2)
    if world > 1:
        out["dualpipev-overlap"] = _check_schedule(rank, world, "dualpipev", 2 * world + 2, 99, OverlapStage)
    extras = {1: _bad_inputs, 2: _two_pipelines, 4: _odd_dualpipe}
    return {"schedules": out, "extra": extras[world](rank, world)}


def _assert_results(results: list[dict], world: int) -> None:
    for rank, per in enumerate(results):
        for name, r in per["schedules"].items():
            where = f"{name} rank {rank}/{world}"
            assert r["loss_equal"], f"{where}: per-micro-batch losses differ from the single-process run"
            assert r["grad_diff"] < GRAD_TOL, f"{where}: gradient calc_diff {r['grad_diff']:.3g}"
            assert r["fwd_equal"], f"{where}: forward-only outputs/losses differ"
            assert r["store_left"] == 0, f"{where}: weight-grad store not empty after the step"
            assert r["out_none"], f"{where}: outputs returned without return_outputs"
            assert r["sent_outputs_freed"], f"{where}: outputs sent to the next rank kept their storage"
            if name.split("-")[0] in ("zb1p", "zbv", "dualpipev", "dualpipe"):
                # I actions deferred real closures (ToyStage's deferring linear) that W actions ran
                assert r["stats"]["max_pending_wgrad"] > 0 and r["stats"]["wgrad_closures_run"] > 0, where
            if name == "1f1b":
                assert r["stats"]["wgrad_closures_run"] == 0, where
            if name == "dualpipev-overlap":
                assert r["overlap_calls"] > 0, f"{where}: overlapped_forward_backward was never called"


@pytest.mark.dist
@pytest.mark.timeout(300)  # ~35 s idle at 4 ranks; generous because the shared CI CPU can be 3x slower
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_schedule_matches_single_process(world):
    """Also, in the same processes: bad input (1 rank), two pipelines and rank_mapping (2 ranks),
    DualPipe on an odd-sized process group (4 ranks)."""
    results = run_distributed(_all_schedules, world, timeout=280)
    _assert_results(results, world)
    extras = [r["extra"] for r in results]
    if world == 1:
        errs = extras[0]
        assert "num_chunks >= 2 x ranks" in errs["too_few"]
        assert "num_chunks" in errs["zero"] and "int" in errs["float"]
        assert "even" in errs["dualpipe_odd_chunks"]
        assert "module" in errs["module_count"]
        assert "view" in errs["view"] and "stage 0" in errs["view"]
        assert "criterion" in errs["no_criterion"]
    if world == 2:
        for r in extras:
            assert r["distinct"] and r["b_pending"] == 1 and r["a_pending"] == 0
            assert r["reshaped_loss_equal"], "a step with new micro-batch shapes gave other losses"
            assert r["mapped_loss_equal"] and r["mapped_grad_diff"] < GRAD_TOL
    if world == 4:
        assert all("even number of ranks" in e for e in extras[:3]), extras


# -- two pipelines, bad input, failures -------------------------------------------------------------------
def _two_pipelines(rank: int, world: int) -> dict:
    a = Pipeline([make_model(world, 1)[rank]], "zb1p")
    b = Pipeline([make_model(world, 2)[rank]], "1f1b")
    b.store.put(lambda: None)  # B's pending closure must survive A's step untouched
    x, y = make_batch(world, 12, 1)
    a.step(x if rank == 0 else None, num_chunks=4, criterion=criterion, labels=(y if rank == world - 1 else None,))
    out = {"distinct": a.store is not b.store, "b_pending": b.store.pending(), "a_pending": a.store.pending()}
    # the same pipeline, next step with other micro-batch shapes: no static P2P shapes to re-declare
    x2, y2 = make_batch(world, 8, 7)
    loss2, _ = a.step(x2 if rank == 0 else None, num_chunks=4, criterion=criterion,
                      labels=(y2 if rank == world - 1 else None,))
    ref2 = reference(make_model(world, 1), x2, y2, 4)[0]
    out["reshaped_loss_equal"] = (loss2 is None) if rank != world - 1 else bool(torch.equal(loss2, ref2))
    # rank_mapping reversed: group rank 0 runs pipeline rank 1 (the last stage)
    model = make_model(world, 3)
    ref_loss, _, ref_grads = reference(model, x, y, 4)
    pp = world - 1 - rank
    mod = copy.deepcopy(model[pp])
    mapped = Pipeline([mod], "1f1b", rank_mapping=list(reversed(range(world))))
    loss, _ = mapped.step(x if pp == 0 else None, num_chunks=4, criterion=criterion,
                          labels=(y if pp == world - 1 else None,))
    out["mapped_loss_equal"] = (loss is None) if pp != world - 1 else bool(torch.equal(loss, ref_loss))
    out["mapped_grad_diff"] = max(calc_diff(p.grad, g) for p, g in zip(mod.parameters(), ref_grads[pp]))
    return out


def _bad_inputs(rank: int, world: int) -> dict:
    errors = {}
    mods = (ToyStage(5, 5), ToyStage(5, 5))
    pipe = DualPipeV(mods)
    x = torch.randn(12, 5, dtype=torch.float64)
    for label, chunks in (("too_few", 2 * world - 1), ("zero", 0), ("float", 4.0)):
        try:
            pipe.step(x, num_chunks=chunks, criterion=criterion, labels=(x,))
        except ValueError as exc:
            errors[label] = str(exc)
    try:
        DualPipe(mods).step(x, num_chunks=2 * world + 1, criterion=criterion, labels=(x,))
    except ValueError as exc:
        errors["dualpipe_odd_chunks"] = str(exc)
    try:
        Pipeline([ToyStage(5, 5)], "dualpipev")
        Pipeline([ToyStage(5, 5)], "dualpipev").step(x, num_chunks=4, criterion=criterion, labels=(x,))
    except ValueError as exc:
        errors["module_count"] = str(exc)
    if world == 1:
        try:
            Pipeline([ToyStage(5, 5)], "zb1p").step(x, num_chunks=2, criterion=None, labels=(x,))
        except ValueError as exc:
            errors["no_criterion"] = str(exc)
        try:
            Pipeline([ViewStage()], "1f1b").step(torch.randn(4, 4, dtype=torch.float64), num_chunks=2,
                                                 criterion=lambda o, t: o.sum(), labels=(None,))
        except ValueError as exc:
            errors["view"] = str(exc)
    return errors


def _odd_dualpipe(rank: int, world: int) -> str:
    group = torch.distributed.new_group([0, 1, 2])  # every rank must take part in creating it
    if rank == 3:
        return ""
    try:
        DualPipe((ToyStage(5, 5), ToyStage(5, 5)), process_group=group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _failures(rank: int, world: int) -> dict:
    """A stalled neighbour, then neighbours that disagree on the schedule, each on its own group
    (a timed-out group is left with pending receives)."""
    stall_group, disagree_group = torch.distributed.new_group([0, 1]), torch.distributed.new_group([0, 1])
    out = {}
    pipe = Pipeline([ToyStage(5, 5)], "1f1b", process_group=stall_group, p2p_timeout=2.0)
    x = torch.randn(24, 5, dtype=torch.float64)
    if rank == 1:
        time.sleep(3)  # never runs its part of the step: rank 0 must time out, not hang
    else:
        try:
            pipe.step(x[:8], num_chunks=4, criterion=criterion, labels=(None,))
            out["stall"] = "no error"
        except P2PTimeoutError as exc:
            out["stall"] = str(exc)
    pipe = DualPipeV((ToyStage(5, 5), ToyStage(5, 5)), process_group=disagree_group, p2p_timeout=6.0)
    try:
        pipe.step(x, num_chunks=4 if rank == 0 else 6, criterion=criterion, labels=(x,))
        out["disagree"] = "no error"
    except (P2PMismatchError, P2PTimeoutError) as exc:
        out["disagree"] = type(exc).__name__ + ": " + str(exc)
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(90)
def test_stalled_or_disagreeing_neighbour_raises_instead_of_hanging():
    res = run_distributed(_failures, 2, timeout=80)
    msg = res[0]["stall"]
    assert "rank 0" in msg and "from rank 1" in msg and "0B0" in msg, msg
    assert any(r["disagree"].startswith("P2PMismatchError") for r in res), res
