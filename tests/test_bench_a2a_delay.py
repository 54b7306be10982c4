"""The delay model of ``recipes.bench_a2a_delay``: a serial wire that holds each exchange back by the delay
(the waiter sleeps), and the per-chunk multiples computed from a step's timeline."""

from __future__ import annotations

import time

import pytest

from recipes.bench_a2a_delay import DelayedAllToAll, _chunk_multiples


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self, *args) -> bool:
        self.waited = True
        return True


def _inner(*args, async_op: bool = False, **kwargs):
    assert async_op, "the real exchange is always posted asynchronously"
    return _Work()


def test_exchanges_land_one_delay_apart_on_the_serial_wire():
    wire = DelayedAllToAll(_inner)
    wire.delay_s = 0.05
    t0 = time.perf_counter()
    first, second = wire(None, None, async_op=True), wire(None, None, async_op=True)
    assert second.lands_at - first.lands_at == pytest.approx(0.05, abs=1e-3)  # queued behind the first
    assert 0.05 <= first.lands_at - t0 < 0.55  # posted at once (a loaded machine may take a while to get here)
    second.wait()
    assert time.perf_counter() - t0 >= 0.1 and first.work.waited is False and second.work.waited
    t1 = time.perf_counter()
    assert wire(None, None) is None  # a blocking call returns once it has landed
    assert time.perf_counter() - t1 >= 0.05
    assert len(wire.starts) == 3


def test_no_delay_adds_no_wait():
    wire = DelayedAllToAll(_inner)
    t0 = time.perf_counter()
    for _ in range(20):
        wire(None, None)
    assert time.perf_counter() - t0 < 0.5


def test_chunk_multiples_against_the_same_chunks_without_delay():
    nodelay = [("A", 0.0, 1.0), ("B", 1.0, 3.0)]  # compute 1 s and 2 s
    delayed = [("A", 10.0, 11.5), ("B", 11.5, 13.5)]  # 1.5 s and 2 s with the delay
    starts = [10.1, 10.2, 11.6]  # two exchanges posted in A, one in B
    x_max, x_sum = _chunk_multiples(nodelay, delayed, starts, delay=0.5)
    # A: comm 1.0, compute 1.0 -> max 1, sum 2; B: comm 0.5, compute 2 -> max 2, sum 2.5
    assert x_max == pytest.approx(3.5 / 3.0)
    assert x_sum == pytest.approx(3.5 / 4.5)
