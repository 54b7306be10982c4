"""Deferred weight-gradient hook: how layers hand their weight-gradient GEMMs to a zero-bubble pipeline.

Zero-bubble schedules split a layer's backward into the input gradient (I, on the critical path)
and the weight gradient (W, run later to fill bubbles). A layer's autograd backward computes
its input gradient and wraps the weight-gradient computation in a closure::

    if not accel.wgrad.defer(compute_weight_grad):
        compute_weight_grad()

``defer`` hands the closure to the active collector (a pipeline's weight-grad store, which runs
it at the schedule's W action) and returns True, or returns False when nothing collects, in
which case the layer runs it at once. The active collector is process-global, not thread-local,
because autograd runs GPU backward passes on its own device threads. It lives here, in the
leaf layer, because models, kernel packages and the pipeline runtime all need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_collector: Callable[[Callable[[], None]], None] | None = None


def defer(fn: Callable[[], None]) -> bool:
    """Give ``fn`` to the active collector; False (run it yourself) when none is active."""
    if _collector is None:
        return False
    _collector(fn)
    return True


def active() -> bool:
    return _collector is not None


@contextlib.contextmanager
def collect_into(put: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """While the block runs, deferred weight-gradient closures go to ``put``."""
    global _collector
    previous, _collector = _collector, put
    try:
        yield
    finally:
        _collector = previous
