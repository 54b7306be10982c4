"""The overlapped forward-and-backward: one micro-batch's pass as explicit pieces cut at the all-to-alls.

DeepSeek-V3 hides each expert all-to-all of one micro-batch behind compute of another (its forward
behind the other's backward, and the reverse); Megatron-Core's combined-1F1B plan does the same with
per-layer nodes. Here an expert-parallel layer is five pieces (names as in ``layer_pieces``)::

    attention  h -> h, send, plan, shared   Block.attention, then ffn_norm into MoE.send (router, rows to
                                            send, shared experts)
    dispatch   send -> rows                 all-to-all, ExpertParallel.post_dispatch
    experts    rows -> y                    MoE.expert_rows (this rank's routed experts)
    combine    y -> back                    all-to-all, ExpertParallel.post_combine
    output     h, back, shared -> h         h + MoE.combined (each token's sum over its experts)

One hidden-state tensor travels between the layers of a stage. A layer without all-to-alls is one piece: the
Block itself. A compute piece is a plain function of named
values. It reads its tensor inputs cut from the piece that made them (``_cut``: the same storage, a new
autograd root whose incoming gradient is caught), so its backward is ``torch.autograd.backward`` of its own
outputs, and what was caught at its inputs is the gradient the piece before it needs. An exchange piece
is posted by the plan, forward and reverse (``Exchanged.reverse``), never from inside autograd.

``Run`` is one micro-batch's pass over a list of pieces. ``forward_step`` lands the exchange in flight,
runs the compute up to the next exchange and posts it; ``backward_step`` does the same backwards.
``overlapped`` interleaves a forward Run with a backward Run in a fixed order (the backward's first step,
then one step of each in turn), never by timing, so every rank posts its exchanges in the same order.
For a chunk of one expert-parallel layer, F of micro-batch a against B of micro-batch b::

    B(b): output                  -> post combine reverse
    F(a): attention               -> post dispatch
    B(b): experts                 -> post dispatch reverse
    F(a): experts                 -> post combine
    B(b): attention               (and the layers before)
    F(a): output                  (and the layers after)

Each arrow's exchange travels while the other micro-batch computes the next line. The memory kept is the
plain forward's: nothing holds a piece's inputs or outputs but what its own autograd graph saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from models.deepseek_v3.block import Block, LayerWrap, call
from models.deepseek_v3.expert_parallel import CommHandle


@dataclass(frozen=True)
class Compute:
    """``fn(*values of reads) -> {name: value for name in writes}``: one piece of a layer's compute."""

    name: str
    fn: Callable[..., dict[str, Any]]
    reads: tuple[str, ...]
    writes: tuple[str, ...]


@dataclass(frozen=True)
class Exchange:
    """An all-to-all: ``post(*values of reads)`` returns a handle whose result has ``rows`` (what landed, stored
    as ``lands``) and ``exchanged`` (its reverse); with ``info`` the whole result is stored under that name too.
    ``reads[0]`` is the tensor that travels: the reverse exchange returns its gradient."""

    name: str
    post: Callable[..., CommHandle]
    reads: tuple[str, ...]
    lands: str
    info: str | None = None

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.lands,) if self.info is None else (self.lands, self.info)


Piece = Compute | Exchange


def layer_pieces(block: Block, cos: torch.Tensor, sin: torch.Tensor, stream: str = "h",
                 wrap: LayerWrap | None = None) -> list[Piece]:
    """One layer as pieces from and to the hidden state named ``stream``. ``wrap(block, fn)`` runs each piece's
    compute (the memory policy's whole-block recompute then recomputes each compute piece on its own: the
    exchanges are never run twice)."""
    if not block.expert_parallel:
        layer = call(block, wrap)
        return [Compute(f"layer {block.layer_id}", lambda x: {stream: layer(x, cos, sin)}, (stream,), (stream,))]
    moe = block.ffn

    def attention(x: torch.Tensor) -> dict[str, Any]:
        h = block.attention(x, cos, sin)
        y = block.ffn_norm(h)
        send, plan, shared = moe.send(y.flatten(0, -2), y.shape[-2])
        return {stream: h, "send": send, "plan": plan, "shared": shared}

    def output(h: torch.Tensor, back: torch.Tensor, plan, shared: torch.Tensor | None) -> dict[str, Any]:
        return {stream: h + moe.combined(back, plan, shared).view_as(h)}

    def wrapped(fn: Callable[..., dict]) -> Callable[..., dict]:
        return fn if wrap is None else wrap(block, fn)

    return [
        Compute("attention", wrapped(attention), (stream,), (stream, "send", "plan", "shared")),
        Exchange("dispatch", lambda send, plan: moe.ep.post_dispatch(send, plan, moe.dim), ("send", "plan"),
                 lands="rows", info="received"),
        Compute("experts", wrapped(lambda rows, received: {"y": moe.expert_rows(rows, received)}),
                ("rows", "received"), ("y",)),
        Exchange("combine", moe.ep.post_combine, ("y", "received"), lands="back"),
        Compute("output", output, (stream, "back", "plan", "shared"), (stream,)),
    ]


class _Catch(torch.autograd.Function):
    """``x`` as a new autograd root: its gradient is caught in ``box`` instead of flowing into ``x``'s graph.
    ``token`` (an empty tensor that requires grad) makes the output require grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.box.append(grad)
        return None, None, None


def _cut(x: torch.Tensor, box: list) -> torch.Tensor:
    return _Catch.apply(x.detach(), torch.empty(0, requires_grad=True), box)


def _last_reads(pieces: Sequence[Piece]) -> list[tuple[str, ...]]:
    """For each piece, the names it is the last to read before they are written again (or at all): what to let
    go of once it has run."""
    later: set[str] = set()
    out: list[tuple[str, ...]] = []
    for piece in reversed(pieces):
        later -= set(piece.writes)
        out.append(tuple(k for k in piece.reads if k not in later))
        later |= set(piece.reads)
    return out[::-1]


class Run:
    """One micro-batch's pass over ``pieces``, from the ``given`` values (the stage input, tokens).

    Given values are read as they are (a gradient of the stage input lands in its ``.grad``); values a piece
    made are cut when read. ``values`` holds what later pieces still read and, at the end, the outputs
    (the names in ``keep``).
    """

    def __init__(self, pieces: Sequence[Piece], keep: tuple[str, ...] = ("h", "loss"), **given: Any) -> None:
        self.pieces = list(pieces)
        self.values: dict[str, Any] = dict(given)
        self.made: set[str] = set()  # names some piece wrote (the rest are given)
        self._release = [tuple(k for k in names if k not in keep) for names in _last_reads(self.pieces)]
        self._next = 0
        self._in_flight: tuple[Exchange, CommHandle, bool] | None = None
        self._done: list[tuple[Piece, Any]] = []  # what each piece's backward needs, in forward order
        self._grads: dict[str, torch.Tensor] = {}
        self._reversing: tuple[Exchange, CommHandle] | None = None

    # ---- forward --------------------------------------------------------------------------------------
    def forward_step(self) -> bool:
        """Land the exchange in flight, run the compute up to the next exchange and post it. False at the end."""
        if self._in_flight is not None:
            self._land(*self._in_flight)
            self._in_flight = None
        while self._next < len(self.pieces):
            i, piece = self._next, self.pieces[self._next]
            self._next += 1
            args = [self.values[k] for k in piece.reads]
            self._let_go(i)
            if isinstance(piece, Exchange):
                self._in_flight = (piece, piece.post(*args), args[0].requires_grad)
                return True
            self._compute(piece, args)
        return False

    def forward(self) -> dict[str, Any]:
        """The whole forward (each exchange waited for at once); the values at the end."""
        while self.forward_step():
            pass
        return self.values

    def _compute(self, piece: Compute, args: list) -> None:
        boxes: dict[str, list] = {}
        inputs = []
        for name, value in zip(piece.reads, args):
            if name in self.made and isinstance(value, torch.Tensor) and value.requires_grad:
                value = _cut(value, boxes.setdefault(name, []))
            inputs.append(value)
        out = piece.fn(*inputs)
        if tuple(out) != piece.writes:
            raise RuntimeError(f"piece {piece.name!r} wrote {tuple(out)}, declared {piece.writes}")
        edges = [(name, get_gradient_edge(t)) for name, t in out.items()
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        self._done.append((piece, (boxes, edges)))
        self.values.update(out)
        self.made.update(out)

    def _land(self, piece: Exchange, handle: CommHandle, differentiable: bool) -> None:
        result = handle.wait()
        self._done.append((piece, result.exchanged))
        self.values[piece.lands] = result.rows.requires_grad_(differentiable)  # a fresh buffer: a new root
        if piece.info is not None:
            self.values[piece.info] = result
        self.made.update(piece.writes)

    def _let_go(self, i: int) -> None:
        for name in self._release[i]:
            self.values.pop(name, None)

    # ---- backward -------------------------------------------------------------------------------------
    def backward_step(self, **grads: torch.Tensor) -> bool:
        """Land the reverse exchange in flight, run the backward up to the next exchange and post its reverse.
        False at the end. The first call passes the gradients of the outputs (``loss=ones``, ``h=grad``)."""
        self._grads.update(grads)
        if self._reversing is not None:
            piece, handle = self._reversing
            self._reversing = None
            self._add(piece.reads[0], handle.wait())
        while self._done:
            piece, record = self._done.pop()
            if isinstance(piece, Exchange):
                self._reversing = (piece, record.reverse(self._grads.pop(piece.lands, None)))
                return True
            self._backward_compute(*record)
        return False

    def backward(self, **grads: torch.Tensor) -> None:
        """The whole backward (each reverse exchange waited for at once)."""
        more = self.backward_step(**grads)
        while more:
            more = self.backward_step()

    def _backward_compute(self, boxes: dict[str, list], edges: list[tuple[str, GradientEdge]]) -> None:
        roots = [(edge, self._grads.pop(name)) for name, edge in edges if name in self._grads]
        if roots:
            torch.autograd.backward([e for e, _ in roots], [g for _, g in roots])
        for name, box in boxes.items():
            for grad in box:
                self._add(name, grad)

    def _add(self, name: str, grad: torch.Tensor) -> None:
        self._grads[name] = grad if name not in self._grads else self._grads[name] + grad


def overlapped(forward: Run, backward: Run, **grads: torch.Tensor) -> None:
    """``forward``'s pass and ``backward``'s backward (from ``grads`` of its outputs), interleaved: one step of
    the backward, then one of each in turn, so that each posted exchange travels while the other computes."""
    more = backward.backward_step(**grads)
    while forward.forward_step():
        if more:
            more = backward.backward_step()
    while more:
        more = backward.backward_step()


__all__ = ["Compute", "Exchange", "Piece", "Run", "layer_pieces", "overlapped"]
