"""The wire model of ``recipes.bench_a2a_delay``: a serial wire that holds each exchange back by latency +
bytes / bandwidth (the waiter sleeps), the bandwidth that gives a comm / compute ratio, and the per-chunk
multiples computed from a step's timeline."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from recipes.bench_a2a_delay import DelayedAllToAll, _chunk_multiples, _wire_settings


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
    wire.latency_s = 0.05
    t0 = time.perf_counter()
    first, second = wire(None, None, async_op=True), wire(None, None, async_op=True)
    assert second.lands_at - first.lands_at == pytest.approx(0.05, abs=1e-3)  # queued behind the first
    assert 0.05 <= first.lands_at - t0 < 0.55  # posted at once (a loaded machine may take a while to get here)
    second.wait()
    assert time.perf_counter() - t0 >= 0.1 and first.work.waited is False and second.work.waited
    t1 = time.perf_counter()
    assert wire(None, None) is None  # a blocking call returns once it has landed
    assert time.perf_counter() - t1 >= 0.05
    assert len(wire.calls) == 3


def test_time_on_the_wire_is_latency_plus_the_larger_side_over_the_bandwidth():
    wire = DelayedAllToAll(_inner)
    wire.latency_s, wire.s_per_byte = 1e-3, 1e-6
    counts = torch.empty(8, dtype=torch.int64)  # a count exchange: 64 bytes
    tokens_in, tokens_out = torch.empty(300, 64), torch.empty(500, 64)  # 76.8 KB out, 128 KB in
    wire(counts, counts, async_op=True)
    wire(tokens_out, tokens_in, async_op=True)
    (_, b0, t0), (_, b1, t1) = wire.calls
    assert (b0, b1) == (64, 500 * 64 * 4)
    assert t0 == pytest.approx(1e-3 + 64e-6) and t1 == pytest.approx(1e-3 + 0.128)


def test_no_delay_adds_no_wait():
    wire = DelayedAllToAll(_inner)
    t0 = time.perf_counter()
    for _ in range(20):
        wire(None, None)
    assert time.perf_counter() - t0 < 0.5


def test_wire_settings_make_comm_the_asked_multiple_of_compute():
    ns = argparse.Namespace(delay_ms=None, latency_ms=0.5, comm_ratio=[0.5, 1.0])
    compute, calls, nbytes = 2.0, 100, 4e6
    for ratio, (latency, s_per_byte) in zip(ns.comm_ratio, _wire_settings(ns, compute, calls, nbytes)):
        assert latency == 5e-4
        assert calls * latency + nbytes * s_per_byte == pytest.approx(ratio * compute)
    assert _wire_settings(argparse.Namespace(delay_ms=7.0), compute, calls, nbytes) == [(7e-3, 0.0)]
    with pytest.raises(ValueError, match="--latency-ms 30"):  # 100 x 30 ms > 1.0 x 2 s
        _wire_settings(argparse.Namespace(delay_ms=None, latency_ms=30.0, comm_ratio=[1.0]), compute, calls, nbytes)


def test_chunk_multiples_against_the_same_chunks_without_delay():
    nodelay = [("A", 0.0, 1.0), ("B", 1.0, 3.0)]  # compute 1 s and 2 s
    delayed = [("A", 10.0, 11.5), ("B", 11.5, 13.5)]  # 1.5 s and 2 s with the wire
    calls = [(10.1, 100, 0.4), (10.2, 100, 0.6), (11.6, 50, 0.5)]  # two exchanges posted in A, one in B
    x_max, x_sum = _chunk_multiples(nodelay, delayed, calls)
    # A: comm 1.0, compute 1.0 -> max 1, sum 2; B: comm 0.5, compute 2 -> max 2, sum 2.5
    assert x_max == pytest.approx(3.5 / 3.0)
    assert x_sum == pytest.approx(3.5 / 4.5)
