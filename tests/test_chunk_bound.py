"""benchmarks/chunk_bound.py: the makespan of two compute/exchange chains on one compute unit and one
first-come serial wire, checked by hand on small cases."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).parents[1] / "benchmarks" / "chunk_bound.py"
_spec = importlib.util.spec_from_file_location("chunk_bound", _path)
chunk_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chunk_bound)


def test_makespan_by_hand():
    compute = {"F": [1.0, 1.0], "B": [1.0, 1.0]}
    exchanges = {"F": [1.0], "B": [1.0]}
    # B0 0-1 (its exchange 1-2), F0 1-2 (2-3), B1 waits to 2: 2-3, F1 waits to 3: 3-4
    assert chunk_bound.makespan(["B", "F", "B", "F"], compute, exchanges) == 4.0
    # F0 0-1 (1-2), F1 waits to 2: 2-3, B0 3-4 (4-5), B1 5-6: one side at a time hides nothing
    assert chunk_bound.makespan(["F", "F", "B", "B"], compute, exchanges) == 6.0


def test_a_long_head_is_hidden_only_behind_the_other_side():
    compute = {"F": [4.0, 1.0], "B": [0.5, 1.0]}
    exchanges = {"F": [2.0], "B": [4.0]}
    # backward first: its exchange (0.5-4.5) travels while the forward's head runs (0.5-4.5)
    assert chunk_bound.makespan(["B", "F", "B", "F"], compute, exchanges) == pytest.approx(7.5)
    # forward first: F0 0-4 (4-6), B0 4-4.5, its exchange queues behind F's (6-10), B1 10-11, F1 11-12
    assert chunk_bound.makespan(["F", "B", "B", "F"], compute, exchanges) == pytest.approx(12.0)


def test_cli_reports_the_best_order(capsys):
    assert chunk_bound.main(["--forward", "1", "1", "--backward", "1", "1", "--exchange", "1", "--count-ms", "0"]) == 0
    out = capsys.readouterr().out
    assert "best of every order:        4.0 ms = 1.000 x" in out


def test_floating_weight_gradients_fill_idle_compute():
    compute = {"F": [1.0, 1.0], "B": [1.0, 2.0, 1.0]}
    exchanges = {"F": [3.0], "B": [1.0, 1.0]}
    order = ["B", "F", "B", "F", "B"]
    # B0 0-1 (1-2), F0 1-2 (2-5), B1 2-4 (its exchange waits for the wire: 5-6), F1 5-6, B2 6-7
    assert chunk_bound.makespan(order, compute, exchanges) == 7.0
    # half of B1 and B2 floats: B1 2-3 (5-6), F1 waits 3-5 then 5-6, B2 6-6.5; the 1.5 of W fits the 2 idle
    assert chunk_bound.with_floating_weight_grads(order, compute, exchanges, 0.5) == 6.5
    # 90% floating: B1 2-2.2, F1 waits 2.2-5: 2.7 of W in 2.8 idle, the chains end at 6.1
    assert chunk_bound.with_floating_weight_grads(order, compute, exchanges, 0.9) == pytest.approx(6.1)
    # W with no idle time to go to lengthens the chunk by all of it: 4 of chains + 1 of W = the compute, 5
    busy = {"F": [1.0, 1.0], "B": [1.0, 2.0]}
    assert chunk_bound.with_floating_weight_grads(["B", "F", "B", "F"], busy, {"F": [0.5], "B": [0.5]}, 0.5) == 5.0
