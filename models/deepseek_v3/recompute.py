"""Recompute that frees what it recomputes (DeepSeek-V3 report, section 3.2.3).

V3 recomputes every RMSNorm and the MLA up-projections in backward so that their outputs are never
stored: the GEMM after a norm keeps the norm's *input* and recomputes the norm. Checkpointing the
producer alone (``torch.utils.checkpoint(norm, x)``) does not do that: the consumer (the Linear after
the norm) still saves ``norm(x)`` as its own input, so nothing is saved.

``produce_consume(producer, consumer, *inputs)`` computes ``consumer(*producer(*inputs))`` so that
after the forward only ``inputs`` and what the consumer needs *besides* the producer's outputs stay
alive:

1. the producer runs without a graph; its inputs are kept (optionally through a ``Stash``, e.g. FP8);
2. the consumer runs normally and saves whatever it saves, the producer's outputs (or views of them)
   included;
3. the storage of the producer's outputs is then released (resized to 0 bytes), so those saved views
   hold no memory;
4. just before the consumer's backward (a pre-hook on its outputs' autograd nodes) the producer is
   re-run with a graph from its kept inputs and its outputs are copied back into the same storage,
   so every saved view is valid again; the producer's backward then runs through that graph.

The GEMMs of the consumer are not recomputed (full checkpointing would). The same idea is
Megatron-Core's ``CheckpointWithoutOutput``. Nothing here is global: the bookkeeping lives on the
producer's autograd node; only public torch APIs (a custom ``autograd.Function``, storage ``resize_``,
a node pre-hook). ``outputs=`` hands in producer outputs that a kernel already made in the forward
(the fused residual add + RMSNorm writes the norm's input ``h`` and its output ``y`` in one pass): they
feed the consumer and are released and recomputed as if the producer had made them (the same bits when
the producer computes what that kernel did). ``maybe_recompute`` is whole-region recompute
(``torch.utils.checkpoint``); inside its recomputation ``recomputing()`` is true, so counters do not
count twice. Producer outputs must not be used after the consumer (they are released), must not alias
the producer's inputs, and must not be returned by the consumer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Stash:
    """How the producer's inputs are kept for backward: ``pack(x) -> tensors``, ``unpack(tensors, dtype) -> x``.

    The default (no stash) keeps the inputs themselves. ``layers.FP8_STASH`` keeps them as e4m3 +
    1x128 scales (the SwiGLU input under FP8 activation caching). ``produce``/``produce_consume`` take
    one stash for every input, or a tuple of one stash (or None) per input.
    """

    pack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    unpack: Callable[[tuple[torch.Tensor, ...], torch.dtype], torch.Tensor]


class _Produce(torch.autograd.Function):
    """``producer(*inputs)`` with only the (stashed) inputs saved; see ``_recompute`` for the backward graph."""

    @staticmethod
    def forward(ctx, producer, stash: Stash | tuple[Stash | None, ...] | None, given: tuple[torch.Tensor, ...] | None,
                *inputs: torch.Tensor):
        stashes = stash if isinstance(stash, tuple) else (stash,) * len(inputs)
        if len(stashes) != len(inputs):
            raise ValueError(f"produce_consume: {len(stashes)} stashes for {len(inputs)} inputs")
        ctx.producer, ctx.stashes = producer, stashes
        ctx.dtypes = [x.dtype for x in inputs]
        packed = [s.pack(x) if s is not None else (x,) for s, x in zip(stashes, inputs)]
        ctx.counts = [len(p) for p in packed]
        ctx.save_for_backward(*(t for p in packed for t in p))
        ctx.storages = None  # [(storage, nbytes)] of the released outputs, set by ``Dropped.release``
        ctx.graph = None  # (detached inputs, recomputed outputs) once recomputed
        outputs = producer(*inputs) if given is None else given
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
        return (None, None, None, *(x.grad if x.requires_grad else None for x in inputs))


def _recompute(ctx) -> None:
    """Re-run the producer with a graph (once) and write its outputs back into the released storage."""
    if ctx.graph is not None:
        return
    saved, inputs, i = ctx.saved_tensors, [], 0
    for stash, count, dtype, needs_grad in zip(ctx.stashes, ctx.counts, ctx.dtypes, ctx.needs_input_grad[3:]):
        x = stash.unpack(saved[i:i + count], dtype) if stash is not None else saved[i]
        inputs.append(x.detach().requires_grad_(needs_grad))
        i += count
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
    twice, and its producers keep their outputs: see ``Dropped.release``)."""
    return _recomputing.get()


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
        kept = {t.untyped_storage().data_ptr() for t in _tensors(result)}
        storages, seen = [], set()
        for out in self.outputs:
            storage = out.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in kept:
                raise ValueError("produce_consume: the consumer returned (a view of) a producer output; "
                                 "it would be released")
            storages.append(None if ptr in seen else (storage, storage.nbytes()))
            seen.add(ptr)
        node.storages = storages
        for storage in storages:
            if storage is not None:
                storage[0].resize_(0)
        for t in _tensors(result):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda grads, node=node: _recompute(node))


def _produce(producer: Callable, *inputs: torch.Tensor, enabled: bool = True,
             stash: Stash | tuple[Stash | None, ...] | None = None,
             outputs: tuple[torch.Tensor, ...] | None = None) -> Dropped:
    """Run ``producer(*inputs)`` (or take its ``outputs``) keeping only its inputs; ``Dropped.outputs`` feed the
    consumer, then ``Dropped.release(result)``."""
    if not (enabled and torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        if outputs is not None:
            raise ValueError("produce_consume: outputs= is for a recomputed producer (enabled, gradients on)")
        out = producer(*inputs)
        return Dropped((out,) if isinstance(out, torch.Tensor) else tuple(out))
    if outputs is not None and any(t.requires_grad for t in outputs):
        raise ValueError("produce_consume: outputs= must be computed without a graph (the recompute makes it)")
    outputs = _Produce.apply(producer, stash, outputs, *inputs)
    return Dropped(outputs, outputs[0].grad_fn)


def produce_consume(producer: Callable, consumer: Callable, *inputs: torch.Tensor, enabled: bool = True,
                    stash: Stash | tuple[Stash | None, ...] | None = None,
                    outputs: tuple[torch.Tensor, ...] | None = None):
    """``consumer(*producer(*inputs))``, keeping ``inputs`` instead of the producer's outputs for backward
    when ``enabled`` (see the module docstring). ``outputs``: what ``producer(*inputs)`` gives, already
    computed without a graph in this forward (only where the recompute runs); the producer then runs only
    in backward."""
    dropped = _produce(producer, *inputs, enabled=enabled, stash=stash, outputs=outputs)
    result = consumer(*dropped.outputs)
    dropped.release(result)
    return result


__all__ = ["Stash", "maybe_recompute", "produce_consume", "recomputing"]
