"""The model's forward as interleavable steps, and the backward that walks it piece by piece.

``Block.steps`` / ``MoE.steps`` are generators: they ``yield`` where a communication is in flight
(after an expert-parallel dispatch is posted, after the combine is posted) and return their output.
``Block.forward`` and ``MoE.forward`` simply ``drain`` them, so the forward is written once; a
pipeline schedule runs the same steps and puts another micro-batch's work where they yield.

A forward run with a ``Cuts`` recorder also notes, at each expert all-to-all, the autograd edges on
either side of it and of the tensors that live across it (``Cuts.exchange``). ``backward_steps`` then
runs that forward's backward between consecutive exchanges, and at each one posts the reverse
all-to-all asynchronously and yields while it travels: the backward's exchanges hide behind
whatever runs at the yield (V3's overlap of one micro-batch's backward with another's forward).
Only autograd edges are recorded, never activations: a recorded forward keeps no more memory alive
than the plain one, and its ordinary ``.backward()`` still works (the exchanges are also autograd
nodes, with a blocking reverse exchange).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from accel.grads import accumulate_grad

T = TypeVar("T")
Steps = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run a step generator to the end and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def interleave(primary: Steps[T], secondary: Steps[None]) -> T:
    """Run two step generators turn about, ``secondary`` first (one step of it, one of ``primary``, ...) so
    each computes while the other's communication is in flight; finish both; return ``primary``'s value.

    DualPipe's chunk passes the backward as ``secondary``: its first step is short (down to the last
    layer's combine) and posts an exchange, so the forward's compute before its first dispatch
    (embedding, dense layers, attention) runs while that travels; and its last step (attention and
    dense layers after the last exchange) runs while the forward's last combine travels. The turns never
    depend on timing, so every rank posts its exchanges in the same order.
    """
    secondary_done = next(secondary, StopIteration) is StopIteration
    while True:
        try:
            next(primary)
        except StopIteration as stop:
            result = stop.value
            break
        if not secondary_done:
            secondary_done = next(secondary, StopIteration) is StopIteration
    if not secondary_done:
        drain(secondary)
    return result


class Reversible(Protocol):
    """An exchange the backward can reverse: what ``expert_parallel.Exchange`` provides."""

    sent: GradientEdge  # the tensor that was sent (its gradient is what the reverse exchange returns)
    received: GradientEdge  # the tensor the exchange produced

    def reverse(self, grad_received: torch.Tensor | None):  # -> a handle whose wait() gives grad of ``sent``
        ...


@dataclass
class _Mark:
    exchange: Reversible
    live: tuple[GradientEdge, ...]  # tensors made before the exchange and used after it


def _edge(t: torch.Tensor | GradientEdge) -> GradientEdge:
    return t if isinstance(t, GradientEdge) else get_gradient_edge(t)


def _key(e: GradientEdge) -> tuple[int, int]:
    return id(e.node), e.output_nr


class Cuts:
    """What ``backward_steps`` needs from one forward: its input and its exchanges in order.

    Code that uses, after an all-to-all, tensors made before it (routing weights, shared-expert
    output, the block's residual) takes fresh ``alias``es of them that only the code after the
    exchange reads, and names those in ``exchange(ex, *aliases)`` once the exchange has landed. The
    backward takes their gradients at the aliases, so it stops there instead of running into the
    code before the exchange (which the exchange's own path also reaches). A tensor read again only
    after *every* later exchange (the hidden states the loss heads read after the MTP blocks) is
    ``carry``-ed instead: its alias crosses each exchange recorded from then on.
    """

    def __init__(self, stage_input: torch.Tensor | None = None) -> None:
        self.stage_input = stage_input if stage_input is not None and stage_input.requires_grad else None
        self.marks: list[_Mark] = []
        self.carried: list[GradientEdge] = []

    def carry(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh alias of ``t`` for code that runs after all exchanges still to be recorded."""
        (alias,) = self.alias(t)
        if alias.requires_grad:
            self.carried.append(get_gradient_edge(alias))
        return alias

    @staticmethod
    def alias(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """A fresh autograd node per tensor (the same values); None and tensors without grad pass as they are."""
        return tuple(t.view_as(t) if t is not None and t.requires_grad else t for t in tensors)

    def exchange(self, ex: Reversible, *live: torch.Tensor | None) -> None:
        edges = tuple(get_gradient_edge(t) for t in live if t is not None and t.requires_grad)
        self.marks.append(_Mark(ex, edges + tuple(self.carried)))


def _leaves(roots: Sequence[GradientEdge], stops: set[tuple[int, int]]) -> list[torch.Tensor]:
    """Leaf tensors (parameters) whose gradient flows from ``roots`` without crossing a stop.

    A backward restricted to some ``inputs`` computes gradients only for those, so each piece must
    name the parameters it reaches; asking for one beyond a stop would drag autograd past it.
    """
    stop_nodes = {k[0] for k in stops}
    seen, found, todo = set(), [], [e.node for e in roots]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop_nodes:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf itself
        if variable is not None:
            found.append(variable)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def _backward_piece(pending: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor]],
                    stops: Sequence[GradientEdge]) -> dict[tuple[int, int], tuple[GradientEdge, torch.Tensor]]:
    """Back-propagate the ``pending`` gradients down to ``stops``; parameters reached accumulate their gradient
    (``accel.grads``).

    Returns the gradients at the stops (a pending edge that is also a stop passes through).
    """
    stop_keys = {_key(e): e for e in stops}
    roots = [(e, g) for k, (e, g) in pending.items() if k not in stop_keys]
    out = {k: pending[k] for k in stop_keys if k in pending}
    if not roots:
        return out
    params = _leaves([e for e, _ in roots], set(stop_keys))
    inputs = [*stop_keys.values(), *params]
    if not inputs:  # nothing upstream wants a gradient (a first stage without parameters)
        return out
    grads = torch.autograd.grad([e for e, _ in roots], inputs, [g for _, g in roots], allow_unused=True)
    for (k, e), g in zip(stop_keys.items(), grads):
        if g is not None:
            out[k] = (e, g + out[k][1] if k in out else g)
    for p, g in zip(params, grads[len(stop_keys):]):
        if g is not None:
            accumulate_grad(p, g)
    return out


def backward_steps(cuts: Cuts, roots: Sequence[tuple[torch.Tensor | GradientEdge, torch.Tensor]]) -> Steps[None]:
    """The backward of the forward ``cuts`` recorded, from ``roots`` = [(output, its gradient)].

    Between exchanges it is one restricted autograd pass; at each exchange (last first) the reverse
    all-to-all is posted and the generator yields until it is waited for. The stage input's
    gradient lands in its ``.grad``, like a plain backward's.
    """
    pending = {_key(e): (e, g) for e, g in ((_edge(t), g) for t, g in roots) if g is not None}
    for mark in reversed(cuts.marks):
        ex = mark.exchange
        pending = _backward_piece(pending, [ex.received, *mark.live])
        _, grad_received = pending.pop(_key(ex.received), (None, None))
        handle = ex.reverse(grad_received)
        yield
        pending[_key(ex.sent)] = (ex.sent, handle.wait())
    x = cuts.stage_input
    stops = [get_gradient_edge(x)] if x is not None else []
    pending = _backward_piece(pending, stops)
    if x is not None and stops and _key(stops[0]) in pending:
        accumulate_grad(x, pending[_key(stops[0])][1])
