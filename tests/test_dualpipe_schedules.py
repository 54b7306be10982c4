"""Schedule IR, generators, validator, simulator, calculator and CLI (no processes spawned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpipe.calculator import closed_form
from dualpipe.ir import Action, Overlap, Schedule, comm_plan, from_csv, parse_item
from dualpipe.schedules import SCHEDULES, build
from dualpipe.simulate import main as simulate_main
from dualpipe.simulator import Costs, simulate
from dualpipe.validate import ScheduleError, check_deadlock_free, validate

# The project's shared golden data (beside the checkout) when present, else the copy kept in tests/golden.
_SHARED_GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "dualpipev_4rank_10mb.csv"
GOLDEN = _SHARED_GOLDEN if _SHARED_GOLDEN.exists() else Path(__file__).parent / "golden" / "dualpipev_4rank_10mb.csv"

SIZES = [(1, 2), (1, 5), (2, 4), (2, 7), (3, 6), (4, 8), (4, 10), (4, 13), (6, 12), (6, 20), (8, 16), (8, 22)]


def _cases():
    for name in SCHEDULES:
        for ranks, mbs in SIZES:
            if name == "dualpipe" and (ranks % 2 or mbs % 2):
                continue
            if name in ("dualpipe", "dualpipev") and mbs < 2 * ranks:
                continue
            if name == "interleaved1f1b":  # its own sizes: tests/test_interleaved_schedule.py
                continue
            yield name, ranks, mbs


def test_dualpipev_reproduces_golden_csv_and_imports_back():
    golden = GOLDEN.read_text()
    sched = build("dualpipev", 4, 10)
    assert sched.to_csv() == golden
    back = from_csv(golden, name="dualpipev")
    assert back.actions == sched.actions and back.layout == sched.layout


@pytest.mark.parametrize("name,ranks,mbs", list(_cases()))
def test_every_generated_schedule_validates_and_round_trips(name, ranks, mbs):
    sched = build(name, ranks, mbs)
    validate(sched)
    back = from_csv(sched.to_csv())
    assert back.actions == sched.actions and back.layout == sched.layout
    if name in ("1f1b", "zb1p"):  # these also survive send-blocks-until-received semantics
        check_deadlock_free(sched, rendezvous=True)


def test_parse_rejects_garbage():
    assert parse_item("(0F7;7B3)OVERLAP_F_B") == Overlap(Action("F", 0, 7), Action("B", 7, 3))
    for bad in ("0X1", "F0", "(0B1;1F0)OVERLAP_F_B", ""):
        with pytest.raises(ValueError):
            parse_item(bad)


def _edit(sched: Schedule, rank: int, items) -> Schedule:
    actions = list(sched.actions)
    actions[rank] = tuple(items)
    return Schedule(sched.name, sched.layout, tuple(actions))


def test_validator_rejects_broken_schedules():
    good = build("zb1p", 4, 8)
    items = list(good.actions[2])
    with pytest.raises(ScheduleError, match="missing|needs one B"):  # an action dropped
        validate(_edit(good, 2, items[:-1]))
    w_at = next(i for i, a in enumerate(items) if a.kind == "W")
    i_at = next(i for i, a in enumerate(items) if a.kind == "I" and a.mb == items[w_at].mb)
    swapped = list(items)
    swapped[w_at], swapped[i_at] = swapped[i_at], swapped[w_at]  # W before its I
    with pytest.raises(ScheduleError, match="runs before"):
        validate(_edit(good, 2, swapped))
    # rank 1 waits for the gradient of micro-batch 0 before sending micro-batch 1's activation on,
    # which rank 2 needs first: a cross-rank cycle only the exchange simulation can see
    one = build("1f1b", 4, 8)
    r1 = [a for a in one.actions[1]]
    b0 = r1.index(Action("B", 1, 0))
    f1 = r1.index(Action("F", 1, 1))
    r1.insert(f1, r1.pop(b0))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(_edit(one, 1, r1))
    with pytest.raises(ScheduleError, match="does not hold"):
        validate(_edit(one, 0, [Action("F", 1, 0)] + list(one.actions[0])))


def test_send_order_follows_sender():
    sched = build("dualpipe", 4, 8)
    plans = comm_plan(sched)
    received: dict = {}
    for plan in plans:
        for ex in plan:
            for m in ex.recvs:
                received.setdefault((m.src, m.dst), []).append(m)
    assert received == sched.link_order()


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("costs", [Costs(), Costs(F=1.3, B=2.1, W=0.7, FB=2.9), Costs(F=2, B=3, W=0.5)])
def test_simulator_matches_closed_form_for_1f1b_and_zb1p(name, ranks, costs):
    res = simulate(build(name, ranks, 3 * ranks + 1), costs)
    cf = closed_form(name, ranks, costs)
    # every rank idles (PP-1)(F+B) resp. (PP-1)(F+B-2W): exact up to floating-point summation order
    for r in range(ranks):
        assert res.bubble(r) == pytest.approx(cf.bubble, abs=1e-9)
    assert max(res.peak_activations(r) for r in range(ranks)) == cf.activations
    assert res.parameters(0) == cf.parameters


@pytest.mark.parametrize("name,ranks", [("dualpipe", 2), ("dualpipe", 4), ("dualpipe", 6), ("dualpipe", 8),
                                        ("dualpipev", 1), ("dualpipev", 2), ("dualpipev", 3), ("dualpipev", 4)])
@pytest.mark.parametrize("f,w,fb", [(1.0, 1.0, 3.0), (2.0, 1.0, 4.0), (1.0, 1.0, 2.2), (1.5, 0.5, 2.0)])
def test_simulator_matches_closed_form_for_dualpipe(name, ranks, f, w, fb):
    # The README's (PP/2-1)(F&B+B-3W) is exact in our simulation when the input-gradient pass
    # costs as much as the forward (I = B - W = F), the usual assumption; the worst rank attains it.
    costs = Costs(F=f, B=f + w, W=w, FB=fb)
    res = simulate(build(name, ranks, 4 * ranks + 2), costs)
    cf = closed_form(name, ranks, costs)
    assert max(res.bubble(r) for r in range(ranks)) == pytest.approx(cf.bubble, abs=1e-9)
    assert max(res.peak_activations(r) for r in range(ranks)) == cf.activations
    assert res.parameters(0) == cf.parameters


def test_dualpipe_beats_zero_bubble_beats_1f1b():
    costs = Costs(F=1, B=2, W=1, FB=2.5)
    bubbles = {n: max(simulate(build(n, 8, 24), costs).bubble(r) for r in range(8)) for n in ("1f1b", "zb1p")}
    bubbles["dualpipe"] = max(simulate(build("dualpipe", 8, 24), costs).bubble(r) for r in range(8))
    assert bubbles["dualpipe"] < bubbles["zb1p"] < bubbles["1f1b"], bubbles


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="even number of ranks"):
        build("dualpipe", 3, 12)
    with pytest.raises(ValueError, match="num_chunks even"):
        build("dualpipe", 4, 9)
    with pytest.raises(ValueError, match=">= 2 x ranks"):
        build("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="schedule must be one of"):
        build("gpipe", 4, 8)
    with pytest.raises(ValueError, match="cannot exceed"):
        Costs(B=1, W=2)


def test_cli_writes_csv_trace_png(tmp_path, capsys):
    csv, trace, png = tmp_path / "s.csv", tmp_path / "s.json", tmp_path / "s.png"
    assert simulate_main(["--schedule", "dualpipe", "--ranks", "4", "--microbatches", "8", "--csv", str(csv),
                          "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "closed-form bubble 2" in out and "bubble" in out
    assert from_csv(csv.read_text()).actions == build("dualpipe", 4, 8).actions
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == sum(len(r) for r in build("dualpipe", 4, 8).actions)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
