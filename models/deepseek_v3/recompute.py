"""The recompute the model still applies itself: MLA's up-projections ("mla_up") and whole blocks ("block").

V3's norm and SwiGLU recompute and FP8 activation caching are the memory policy's
(``training.memory_policy``), applied from outside. Left here until they move there too:

``produce_consume(producer, consumer, *inputs)`` computes ``consumer(*producer(*inputs))`` so that after
the forward only ``inputs`` and what the consumer needs *besides* the producer's outputs stay alive (MLA's
up-projections: the attention keeps the per-head q, k, v, which are remade from the latents):

1. the producer runs without a graph; its inputs are kept;
2. the consumer runs normally and saves whatever it saves, the producer's outputs (or views of them)
   included;
3. the storage of the producer's outputs is then released (resized to 0 bytes), so those saved views
   hold no memory;
4. just before the consumer's backward (a pre-hook on its outputs' autograd nodes) the producer is
   re-run with a graph from its kept inputs and its outputs are copied back into the same storage,
   so every saved view is valid again; the producer's backward then runs through that graph.

The same idea is Megatron-Core's ``CheckpointWithoutOutput``. ``maybe_recompute`` is whole-region recompute
(``torch.utils.checkpoint``); inside its recomputation ``recomputing()`` is true, so counters do not count
twice. Producer outputs must not be used after the consumer (they are released), must not alias the
producer's inputs, and must not be returned by the consumer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint


class _Produce(torch.autograd.Function):
    """``producer(*inputs)`` with only the inputs saved; see ``_recompute`` for the backward graph."""

    @staticmethod
    def forward(ctx, producer, *inputs: torch.Tensor):
        ctx.producer = producer
        ctx.save_for_backward(*inputs)
        ctx.storages = None  # [(storage, nbytes)] of the released outputs, set by ``Dropped.release``
        ctx.graph = None  # (detached inputs, recomputed outputs) once recomputed
        outputs = producer(*inputs)
        return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        _recompute(ctx)
        inputs, outputs = ctx.graph
        ctx.graph = ctx.storages = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


def _recompute(ctx) -> None:
    """Re-run the producer with a graph (once) and write its outputs back into the released storage."""
    if ctx.graph is not None:
        return
    inputs = [x.detach().requires_grad_(needs) for x, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
    with torch.enable_grad():
        outputs = ctx.producer(*inputs)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if ctx.storages is not None:
        with torch.no_grad():
            for (storage, nbytes), out in zip(ctx.storages, outputs):
                if storage is None:
                    continue
                if out.untyped_storage().nbytes() != nbytes:
                    raise RuntimeError("produce_consume: the recomputed producer output has a different layout "
                                       f"({out.untyped_storage().nbytes()} bytes, expected {nbytes})")
                storage.resize_(nbytes)
                storage.copy_(out.untyped_storage())
    ctx.graph = (inputs, outputs)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    return []


_recomputing: ContextVar[bool] = ContextVar("dsv3_recomputing", default=False)


def recomputing() -> bool:
    """Whether this forward is a ``maybe_recompute`` region run again in backward (its counters must not count
    twice, and its producers keep their outputs: see ``Dropped.release``). Always false in a ``torch.compile``d
    region: there the checkpoint's recomputation is the compiler's, inside the backward graph, and never reruns
    the Python forward."""
    return not torch.compiler.is_compiling() and _recomputing.get()


def maybe_recompute(fn: Callable, *args: torch.Tensor, enabled: bool):
    """``fn(*args)``, storing only its inputs for backward (recomputed there) when ``enabled`` and grads flow.

    Non-reentrant checkpointing: it composes with every backward a pipeline runs (a piece's own
    ``torch.autograd.backward``, or ``torch.autograd.grad``), which the reentrant variant refuses.
    deep_gemm's layers keep the parameter itself on their autograd context (not a saved-tensor copy),
    so the weight gradient still lands on the real parameter when the saved tensors are recomputed
    stand-ins. Every call of ``fn`` after the first is the recomputation: it runs with ``recomputing()``.
    """
    if not (enabled and torch.is_grad_enabled() and any(a.requires_grad for a in args if isinstance(a, torch.Tensor))):
        return fn(*args)
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*inputs)
        token = _recomputing.set(True)
        try:
            return fn(*inputs)
        finally:
            _recomputing.reset(token)

    return checkpoint(run, *args, use_reentrant=False)


class Dropped:
    """The producer's outputs (``outputs``), to be released with ``release(consumer_result)`` once every
    consumer has run. A no-op when recompute is off or no gradient flows."""

    def __init__(self, outputs: tuple[torch.Tensor, ...], node=None):
        self.outputs, self._node = outputs, node

    def release(self, result) -> None:
        """Free the outputs' storage; refill it before the backward of any tensor in ``result`` runs."""
        node = self._node
        if node is None or recomputing():
            # inside a backward (a checkpointed block's recomputation) the outputs are kept: what the consumer
            # saved is read by this same backward, and the checkpoint may stop recomputing before any refill
            return
        self._node = None
        # storages told apart by identity (a tensor's ``untyped_storage()`` is the same object for every view of
        # it), not by address: every meta storage's address is 0
        kept = {id(t.untyped_storage()) for t in _tensors(result)}
        storages, seen = [], set()
        for out in self.outputs:
            storage = out.untyped_storage()
            key = id(storage)
            if key in kept:
                raise ValueError("produce_consume: the consumer returned (a view of) a producer output; "
                                 "it would be released")
            storages.append(None if key in seen else (storage, storage.nbytes()))
            seen.add(key)
        node.storages = storages
        for storage in storages:
            if storage is not None:
                storage[0].resize_(0)
        for t in _tensors(result):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda grads, node=node: _recompute(node))


def _produce(producer: Callable, *inputs: torch.Tensor, enabled: bool = True) -> Dropped:
    """Run ``producer(*inputs)`` keeping only its inputs; ``Dropped.outputs`` feed the consumer, then
    ``Dropped.release(result)``."""
    if not (enabled and torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        out = producer(*inputs)
        return Dropped((out,) if isinstance(out, torch.Tensor) else tuple(out))
    outputs = _Produce.apply(producer, *inputs)
    return Dropped(outputs, outputs[0].grad_fn)


def produce_consume(producer: Callable, consumer: Callable, *inputs: torch.Tensor, enabled: bool = True):
    """``consumer(*producer(*inputs))``, keeping ``inputs`` instead of the producer's outputs for backward
    when ``enabled`` (see the module docstring)."""
    dropped = _produce(producer, *inputs, enabled=enabled)
    result = consumer(*dropped.outputs)
    dropped.release(result)
    return result


__all__ = ["maybe_recompute", "produce_consume", "recomputing"]
