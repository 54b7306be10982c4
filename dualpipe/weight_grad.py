"""Per-pipeline store of deferred weight-gradient closures, and a reference layer that defers.

Upstream keeps one process-global ``WeightGradStore``; two pipelines in one process would then
run each other's closures. Here each pipeline owns a store. During an I action the runtime
activates ``accel.wgrad.collect_into(store.put)``, so every layer that calls
``accel.wgrad.defer(fn)`` hands its weight-gradient GEMM to this store; ``flush(key)`` files them
under the action's (stage, micro-batch) and the matching W action runs ``pop(key)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

import accel.wgrad
from accel.grads import accumulate_grad


class WeightGradStore:
    """Deferred weight-gradient closures of one pipeline, filed by the I action that made them."""

    def __init__(self) -> None:
        self._cache: list[Callable[[], None]] = []
        self._queue: dict[Hashable, list[Callable[[], None]]] = {}

    def put(self, fn: Callable[[], None]) -> None:
        self._cache.append(fn)

    def flush(self, key: Hashable) -> None:
        """File the closures collected since the last flush under ``key``."""
        if key in self._queue:
            raise RuntimeError(f"weight gradients for {key} were already collected")
        self._queue[key] = self._cache
        self._cache = []

    def pop(self, key: Hashable) -> int:
        """Run (and forget) the closures filed under ``key``; returns how many ran."""
        if key not in self._queue:
            raise RuntimeError(f"no weight gradients collected for {key}: its I action has not run")
        funcs = self._queue.pop(key)
        for fn in funcs:
            fn()
        return len(funcs)

    def pending(self) -> int:
        """Closures waiting to run (filed or not yet flushed)."""
        return len(self._cache) + sum(len(v) for v in self._queue.values())

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        self._cache, self._queue = [], {}


class _LinearDeferredWGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):  # noqa: ANN205
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN205
        x, weight = ctx.saved_tensors
        bias = ctx.bias

        def weight_grad() -> None:
            g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            gw = g2.t() @ x2
            accumulate_grad(weight, gw)
            if bias is not None:
                accumulate_grad(bias, g2.sum(0))

        if not accel.wgrad.defer(weight_grad):
            weight_grad()
        return grad_out @ weight, None, None


class LinearWithDeferredWGrad(nn.Linear):
    """``nn.Linear`` whose weight gradient is deferred to the active zero-bubble store (if any).

    The reference for how a layer takes part in I/W splitting: the input gradient is returned
    to autograd at once, the weight (and bias) gradient is wrapped in a closure given to
    ``accel.wgrad.defer`` and accumulated into the gradient (``accel.grads``) when the pipeline's W action runs it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearDeferredWGrad.apply(x, self.weight, self.bias)
