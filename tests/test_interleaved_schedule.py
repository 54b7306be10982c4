"""Interleaved 1F1B (Megatron-Core's virtual pipeline stages) in the schedule IR, validator and simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe.calculator import closed_form
from dualpipe.ir import from_csv
from dualpipe.schedules import build, check_sizes, layout
from dualpipe.simulate import main as simulate_main
from dualpipe.simulator import Costs, peak_activations, simulate
from dualpipe.validate import check_deadlock_free, validate

GOLDEN = Path(__file__).parent / "golden" / "interleaved1f1b_4rank_2vpp_8mb.csv"


def test_order_equals_megatron_core_golden():
    # tests/golden/README.md: derived from Megatron-Core's schedules.py (pp 4, vpp 2, 8 micro-batches)
    golden = GOLDEN.read_text()
    sched = build("interleaved1f1b", 4, 8, vpp=2)
    assert sched.to_csv() == golden
    back = from_csv(golden, name="interleaved1f1b")
    assert back.actions == sched.actions and back.layout == sched.layout


@pytest.mark.parametrize("ranks,vpp,mbs", [(2, 2, 2), (2, 2, 6), (2, 3, 4), (3, 2, 6), (4, 2, 4), (4, 2, 12),
                                           (4, 4, 8), (8, 2, 16)])
def test_validates_and_places_chunks_round_robin(ranks, vpp, mbs):
    sched = build("interleaved1f1b", ranks, mbs, vpp=vpp)
    validate(sched)
    check_deadlock_free(sched)
    lay = sched.layout
    assert lay.num_parts == ranks * vpp and lay.copies == 1
    for r in range(ranks):
        assert lay.parts_of(r) == tuple(r + c * ranks for c in range(vpp))
    assert layout("interleaved1f1b", ranks, vpp).stage_rank == lay.stage_rank
    # Megatron's warm-up: the first 2 (PP - r - 1) + (vpp - 1) PP items of rank r are forwards, then an F/B pair
    for r, items in enumerate(sched.actions):
        warm = min(2 * (ranks - r - 1) + (vpp - 1) * ranks, mbs * vpp)
        assert all(a.kind == "F" for a in items[:warm])
        if warm < mbs * vpp:
            assert [a.kind for a in items[warm:warm + 2]] == ["F", "B"]


@pytest.mark.parametrize("ranks,vpp", [(2, 2), (3, 2), (4, 2), (4, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("costs", [Costs(), Costs(F=1.3, B=2.1, W=0.7), Costs(F=2, B=3, W=0.5)])
def test_bubble_is_one_over_vpp_of_1f1b(ranks, vpp, costs):
    # costs are one chunk's; 1F1B over the same model has a whole rank's share per stage: vpp F, vpp B
    mbs = 3 * ranks
    res = simulate(build("interleaved1f1b", ranks, mbs, vpp=vpp), costs)
    share = Costs(F=vpp * costs.F, B=vpp * costs.B, W=vpp * costs.W)
    plain = simulate(build("1f1b", ranks, mbs), share)
    cf = closed_form("interleaved1f1b", ranks, costs, vpp)
    for r in range(ranks):  # exact up to floating-point summation order
        assert res.busy(r) == pytest.approx(plain.busy(r), abs=1e-9)
        assert res.bubble(r) == pytest.approx(cf.bubble, abs=1e-9)
        assert res.bubble(r) == pytest.approx(plain.bubble(r) / vpp, abs=1e-9)
    # peak on rank 0: warm-up + 1 chunk activations, each 1/vpp of a rank's share
    assert peak_activations(res.schedule, 0) / vpp == pytest.approx(cf.activations)
    assert max(peak_activations(res.schedule, r) for r in range(ranks)) == peak_activations(res.schedule, 0)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_sizes("interleaved1f1b", 4, 6, vpp=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        build("interleaved1f1b", 4, 2, vpp=2)
    with pytest.raises(ValueError, match="vpp >= 2"):
        build("interleaved1f1b", 4, 8)
    with pytest.raises(ValueError, match="needs schedule interleaved1f1b"):
        build("1f1b", 4, 8, vpp=2)
    with pytest.raises(ValueError, match="positive int"):
        layout("interleaved1f1b", 4, 0)


def test_simulate_cli(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert simulate_main(["--schedule", "interleaved1f1b", "--ranks", "4", "--vpp", "2", "--microbatches", "8",
                          "--csv", str(out)]) == 0
    assert out.read_text() == GOLDEN.read_text()
    assert "closed-form bubble 9" in capsys.readouterr().out  # (4-1)(1+2)
    with pytest.raises(SystemExit) as exc:
        simulate_main(["--schedule", "interleaved1f1b", "--ranks", "4", "--vpp", "2", "--microbatches", "6"])
    assert exc.value.code == 2
    assert "error: interleaved1f1b runs micro-batches in groups" in capsys.readouterr().err
