"""Expert parallelism over a torch.distributed group: asynchronous all-to-all token dispatch and combine.

One MoE layer's (physical) experts are sharded over the EP group, rank ``r`` holding the block
``[r * local, (r + 1) * local)``. A forward is::

    handle = ep.dispatch(x, indices, weights) # counts exchanged, then tokens (and their weights) in flight
    ...                                       # other compute (another micro-batch) overlaps here
    d = handle.wait()                         # d.x_grouped / d.m_indices: deep_gemm contiguous layout
    y_grouped = experts(d.x_grouped, d.m_indices, d.weights)  # rows scaled by their weight before w2
    handle = ep.combine(y_grouped, d)
    ...                                       # overlap again
    y = handle.wait()                         # [T, dim], sum over the top-k in token order

- Two layers of API. The pieces: ``plan_send`` (routing order, local), ``gather`` (the rows to send,
  differentiable), ``post_dispatch`` (the exchange, not differentiable), ``regroup`` (arrival order ->
  grouped layout, differentiable), ``ungroup`` / ``post_combine`` / ``scatter_back`` on the way back. The
  overlapped plan (``models.deepseek_v3.plan``) runs these as separate pieces and posts each exchange's
  reverse itself (``Exchanged.reverse``) in its backward. ``dispatch`` / ``combine`` compose the same pieces
  differentiably for a plain forward and ``backward()`` (``_Arrived``: the backward posts the reverse
  exchange and waits for it).
- Asynchrony: exchanges return a handle at once. The host work that must precede a transfer (the
  count exchange, FP8 packing) and the posting run on the process's one communication thread
  (``_CommThread``, the CPU analogue of a comm stream), in submission order, on the caller's device
  stream; that thread does not wait for the transfer, so it stages the next exchange while this one
  travels. ``wait()`` blocks until the transfer has landed and then finishes it (FP8 unpacking) on the
  caller's thread.
- Variable splits: each rank first learns, with one small ``all_to_all_single`` of per-expert
  counts (posted asynchronously), how many rows it will receive from every peer for every local
  expert; the token all-to-all follows.
- Layout: the sender orders its (token, expert) assignments by expert (one stable argsort, one
  ``index_select``), so every peer's rows are one contiguous slice; the receiver regroups rows
  ``[source][expert]`` into ``[expert][source]`` blocks padded to
  ``deep_gemm.get_m_alignment_for_contiguous_layout()`` rows with pad rows indexed -1. The index plan
  is computed while the tokens travel, then one gather; the way back undoes both.
- Routing weights: ``gather(x, weights, plan)`` sends each row's fp32 weight with it, as extra
  columns of the same all-to-all (``_weight_columns``: one column in fp32/fp64 rows, a rounded +
  remainder pair in bf16/fp16 rows), so the experts scale their SwiGLU output before ``w2`` and the
  combine is a plain sum: nothing ``[tokens * top-k, dim]`` is kept for the weights' gradient, which
  comes back with the rows' in the reverse exchange. ``combine(y, d, weights)`` (weights after the
  exchange, on the token's rank) remains for rows that were not scaled.
- FP8 dispatch (V3): rows go as e4m3 plus their 1x128 fp32 scales (``deep_gemm.per_token_cast_to_fp8``),
  packed into one byte buffer, and are dequantized on arrival; combine and all backward traffic
  stay in the activations' dtype (bf16 in V3). The quantization is straight-through for autograd.
- Fused kernels (``fused``, the model's ``fused_ops`` switch, where they run: ``fused_ops.send_layout``): the
  rows to send with their weight columns in one gather, the regroup / ungroup / scatter-back as gathers and sums
  whose backward is a gather (no ``index_add``); under FP8 dispatch the sender packs the wire in the gather (cast
  on the way, or the norm's precast moved) and the receiver dequantises the landed bytes straight into the grouped
  layout with the rows' own 1x128 cast for the grouped GEMM; the rows in the activations' dtype in sent and
  arrival order are then stand-ins without storage (``SendPlan.wire``, ``Received.wire`` hold the bytes).
- Dropped assignments (index -1, capacity factor) are never sent.
- Redundant experts (EPLB): with a ``phy2log`` plan, assignment (t, j) to logical expert ``e``
  goes to replica ``t % logcnt[e]`` of ``e``, spreading a hot expert's tokens over its copies.
- Flight recorder (``accel.flight``, handed down like the trace recorder): every exchange is an entry,
  begun when it is posted to the comm thread, numbered on its group when the comm thread issues it,
  marked as each of its collectives is handed to the backend and when the waiter starts blocking, ended
  when it has landed; a wait that fails dumps the recorder first.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

import accel
import deep_gemm
import fused_ops
from accel.flight import Entry, FlightRecorder, FlightSite, group_ranks
from accel.trace import TraceRecorder
from models.deepseek_v3.permute import PermuteState, unpermute

T = TypeVar("T")
_staging = threading.local()  # ``current``: (site, entry) of the exchange this thread is staging, if recorded


def _note_posted() -> None:
    """One collective of the exchange being staged is handed to the backend (for the flight recorder)."""
    current = getattr(_staging, "current", None)
    if current is not None:
        current[0].flight.posted(current[1])


class _CommThread:
    """The process's one communication thread: every EP exchange is staged and posted on it, in order.

    The CPU analogue of a communication stream. What must happen before a transfer can start (the
    routing-order gathers, the count exchange and its wait) runs here, so the caller's thread goes on
    with other compute (ATen releases the GIL); the thread then posts the transfer and moves on to the
    next exchange without waiting for it to land (``Posted``: the waiter finishes it). One thread for
    all layers and groups keeps each rank's collectives in program order, which is what makes them
    match across ranks; the backward all-to-alls queue here for the same reason.
    """

    _executor: ThreadPoolExecutor | None = None
    _pid: int | None = None
    _inline = False

    @classmethod
    @contextlib.contextmanager
    def inline(cls) -> Iterator[None]:
        """Run every exchange on the calling thread to completion, in the same order (no overlap), within the
        block: for a memory measurement (``recipes.memory_report`` on a CPU), which then sees each exchange's
        tensors between two of the thread's own allocations."""
        cls._inline = True
        try:
            yield
        finally:
            cls._inline = False

    @classmethod
    def submit(cls, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the comm thread with the caller's grad mode and device stream."""
        if cls._inline:
            done: Future = Future()
            try:
                result = fn()
                if isinstance(result, Posted):
                    _wait_all(result.works)
                done.set_result(result)
            except BaseException as exc:  # delivered at wait(), as from the thread
                done.set_exception(exc)
            return done
        if cls._pid != os.getpid():  # first use, or a forked child: threads do not survive fork
            cls._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv3-ep-comm")
            cls._pid = os.getpid()
        grad, stream = torch.is_grad_enabled(), accel.current_stream()

        def task() -> T:
            with torch.set_grad_enabled(grad), accel.stream_guard(stream):
                return fn()

        return cls._executor.submit(task)


@dataclass
class Posted(Generic[T]):
    """An exchange the comm thread has posted: the collectives in flight (and the buffers that must outlive
    them) and ``finish``, which builds the result once they have landed."""

    works: list
    finish: Callable[[], T]
    posted_at: float = 0.0  # when the comm thread began staging it (``time.perf_counter``)
    nbytes: int = 0  # bytes this rank sends (the flight recorder's entry)


class CommHandle(Generic[T]):
    """A communication in flight: staged and posted on the comm thread. ``wait()`` blocks until it has
    landed, finishes it on the caller's thread and returns the result (the same one on a second call).

    With a ``recorder`` the exchange is recorded on its comm track from the start of its staging until
    it has landed for the waiter.
    """

    def __init__(self, future: Future, recorder: TraceRecorder | None = None, name: str = "",
                 site: FlightSite | None = None, entry: Entry | None = None) -> None:
        self._future, self._recorder, self._name = future, recorder, name
        self._site, self._entry = site, entry
        self._result: tuple[T] | None = None

    def is_completed(self) -> bool:
        """Whether it has landed (``wait()`` would not block)."""
        if self._result is not None:
            return True
        if not self._future.done():
            return False
        posted = self._future.result()
        return all(w.is_completed() for w in posted.works if not isinstance(w, torch.Tensor))

    def wait(self) -> T:
        if self._result is None:
            if self._entry is None:
                posted = self._future.result()
                _wait_all(posted.works)
            else:
                posted = self._wait_recorded(self._site, self._entry)
            if self._recorder is not None:
                self._recorder.add("comm", self._name, posted.posted_at, time.perf_counter())
            self._result = (posted.finish(),)
        return self._result[0]

    def _wait_recorded(self, site: FlightSite, entry: Entry) -> Posted[T]:
        flight = site.flight
        flight.waiting(entry)
        try:
            posted = self._future.result()
            try:
                _wait_all(posted.works)
            except RuntimeError as exc:  # the backend's timeout: say which exchange, step and action
                raise RuntimeError(f"rank {flight.rank}: expert all-to-all {entry.name!r} of layer {entry.layer} "
                                   f"(group {site.group} {list(site.ranks)}) at step {entry.step}, action "
                                   f"{entry.context}, did not complete: {exc}") from exc
        except BaseException as exc:
            flight.fail(entry, exc)
            raise
        flight.end(entry)
        return posted


def post(recorder: TraceRecorder | None, name: str, fn: Callable[[], Posted[T]],
         site: FlightSite | None = None) -> CommHandle[T]:
    """Stage and post ``fn``'s exchange on the comm thread; the handle to wait for it. With a flight ``site``
    the exchange is an entry of its recorder."""
    entry = None
    if site is not None:
        entry = site.flight.begin("all_to_all", name, group=site.group, ranks=site.ranks, layer=site.layer,
                                  blocking=False, sequence=False)

    def staged() -> Posted[T]:
        start = time.perf_counter()
        if entry is None:
            posted = fn()
        else:
            site.flight.sequence(entry)  # issued now: its number on the group (the comm thread keeps the order)
            _staging.current = (site, entry)
            try:
                posted = fn()
            finally:
                _staging.current = None
            entry.nbytes = posted.nbytes
        posted.posted_at = start  # when the comm thread began staging it: the trace's span starts there
        return posted

    return CommHandle(_CommThread.submit(staged), recorder, name, site, entry)


def _all_to_all(send: torch.Tensor, recv: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> list:
    """Post ``all_to_all_single`` (``in_splits`` rows of ``send`` to each rank, ``out_splits`` from each into
    ``recv``); the works to wait for, with the buffers that must outlive the exchange."""
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)
    _note_posted()
    return [work, send, recv]


@dataclass
class Exchanged:
    """One all-to-all as its reverse needs it: split sizes and the shape of what landed, no activations.
    ``reverse(grad)`` posts the gradient of the landed rows back to their senders on the comm thread; its
    ``wait()`` gives the gradient of the rows that were sent."""

    sent_splits: list[int]  # rows this rank sent to each rank
    received_splits: list[int]  # rows it received from each rank
    rows_sent: int
    landed_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    group: dist.ProcessGroup | None
    recorder: TraceRecorder | None = None
    site: FlightSite | None = None

    def reverse(self, grad: torch.Tensor | None) -> CommHandle[torch.Tensor]:
        """Post the gradient back (zeros when none reached the landed rows: the peers still take part)."""
        if grad is None:
            grad = torch.zeros(self.landed_shape, dtype=self.dtype, device=self.device)
        received = sum(self.received_splits)

        def posted() -> Posted[torch.Tensor]:
            send = grad[:received].contiguous()
            out = grad.new_empty(self.rows_sent, *grad.shape[1:])
            works = _all_to_all(send, out, self.sent_splits, self.received_splits, self.group)
            return Posted(works, lambda: out, nbytes=send.numel() * send.element_size())

        return post(self.recorder, "backward all-to-all", posted, self.site)


@dataclass
class Returned:
    """Rows a combine brought back (in sent order) and how to reverse that exchange."""

    rows: torch.Tensor
    exchanged: Exchanged


def arrived(sent: torch.Tensor, rows: torch.Tensor, exchanged: Exchanged) -> torch.Tensor:
    """The landed ``rows`` as a differentiable function of the rows ``sent``: a plain ``backward()`` sends the
    gradient back through the reverse exchange and waits for it. (The overlapped plan posts the reverse
    itself instead.)"""
    return _Arrived.apply(sent, rows, exchanged)


class _Arrived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sent: torch.Tensor, rows: torch.Tensor, exchanged: Exchanged) -> torch.Tensor:
        ctx.exchanged = exchanged
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchanged.reverse(grad).wait(), None, None


def _wait_all(works: list) -> None:
    for w in works:
        if not isinstance(w, torch.Tensor):  # tensors ride along only to stay alive
            w.wait()


def _pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rows as bytes: e4m3 values then the fp32 1x128 scales (one buffer, one all-to-all).

    Any width works: the last tile of a row whose width is not a multiple of 128 is a partial one.
    """
    x_fp8, scales = deep_gemm.per_token_cast_to_fp8(x.detach())
    return torch.cat([x_fp8.view(torch.uint8), scales.float().contiguous().view(torch.uint8)], dim=1)


def _unpack_fp8(packed: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    x_fp8 = packed[:, :dim].contiguous().view(torch.float8_e4m3fn)
    scales = packed[:, dim:dim + 4 * -(-dim // 128)].contiguous().view(torch.float32)
    full = scales.repeat_interleave(128, dim=1)[:, :dim]
    return (x_fp8.float() * full).to(dtype)


def _weight_columns(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Routing weights ``[n]`` as ``[n, c]`` columns of the rows' ``dtype``, to travel with the rows: one column
    where ``dtype`` holds the weight exactly, else the weight rounded plus the rounding's remainder (their sum
    keeps 16 mantissa bits in bf16). Differentiable: the pair's gradients add up to the weight's."""
    if torch.finfo(dtype).eps <= torch.finfo(weights.dtype).eps:
        return weights.to(dtype).unsqueeze(1)
    rounded = weights.to(dtype)
    return torch.stack([rounded, (weights - rounded.to(weights.dtype)).to(dtype)], dim=1)


@dataclass
class SendPlan:
    """Where this rank's (token, slot) assignments go, from the routing alone (nothing has travelled yet)."""

    order: torch.Tensor  # [T * k] assignments sorted by physical expert, dropped ones (index -1) last
    state: PermuteState  # (token, slot) <-> sent row
    send_counts: torch.Tensor  # [num physical] rows for each physical expert
    send_splits: list[int]  # rows sent to each rank
    num_sent: int  # assignments that travel (the rest were dropped)
    k: int  # slots per token
    # with fused kernels (``ExpertParallel.fused``): ``assign`` the assignment of each sent row, ``rows`` the sent
    # row of each assignment or -1 (dropped), for ``fused_ops.gather_rows`` and ``fused_ops.unpermute``
    layout: fused_ops.Grouping | None = None
    # FP8 dispatch with fused kernels: the rows as they travel, packed by the sender (``fused_ops.pack_rows_fp8``)
    wire: torch.Tensor | None = None


@dataclass
class Received:
    """What a dispatch delivered: ``rows`` in arrival order (``[source][expert]``, one spare zero row after them)
    and the plan that regroups them into the contiguous grouped layout."""

    rows: torch.Tensor
    exchanged: Exchanged
    dim: int  # feature columns; any columns after them are the routing weights
    source: torch.Tensor  # [M] arrival row of each grouped row (the spare zero row for padding; -1 when fused)
    m_indices: torch.Tensor  # [M] int32: local expert of each grouped row, -1 for pad rows
    state: PermuteState  # arrival rows <-> grouped rows
    tokens_per_expert: torch.Tensor  # [local experts] rows received per local expert (unpadded)
    # with fused kernels: ``assign`` the arrival row of each grouped row or -1 (padding: ``source``), ``rows`` the
    # grouped row of each arrival row and -1 for the spare row (``state.rows`` is a view of it), for
    # ``fused_ops.regroup_rows`` / ``gather_rows``
    layout: fused_ops.Grouping | None = None
    # the FP8 bytes that landed when the sender packed them (``SendPlan.wire``); ``rows`` then only stands for
    # the rows in the activations' dtype (no storage): ``regroup`` dequantises straight into the grouped layout
    wire: torch.Tensor | None = None


@dataclass
class Dispatched:
    """Tokens received by this rank in the contiguous grouped layout (``ExpertParallel.dispatch``)."""

    x_grouped: torch.Tensor  # [M, dim], local experts' blocks padded to the alignment
    m_indices: torch.Tensor  # [M] int32: local expert of each row, -1 for pad rows
    tokens_per_expert: torch.Tensor  # [local experts] rows received per local expert (unpadded)
    weights: torch.Tensor | None  # [M] fp32 routing weight of each row (0 on pad rows), if sent
    received: Received
    plan: SendPlan
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # x_grouped's 1x128 cast when it landed as FP8 (fused)


class ExpertParallel:
    """Dispatch/combine for one MoE layer whose experts are sharded over ``group``.

    num_experts: logical routed experts. phy2log: optional EPLB placement (one layer's
    ``[num physical]`` row); without it physical expert i is logical expert i.
    fp8_dispatch: send tokens as e4m3 + 1x128 scales. alignment: rows per grouped-GEMM block
    (default ``deep_gemm.get_m_alignment_for_contiguous_layout()``). flight: the rank's flight recorder
    (``accel.flight``), with ``layer`` the MoE layer's id its entries name. fused: the row movements (gather,
    regroup, ungroup, scatter-back) as ``fused_ops`` kernels where they run (``fused_ops.send_layout``; the
    model's ``fused_ops`` switch), the same numbers as the torch path at the same rounding points.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, *, fp8_dispatch: bool = False,
                 phy2log: torch.Tensor | None = None, alignment: int | None = None,
                 recorder: TraceRecorder | None = None, flight: FlightRecorder | None = None,
                 layer: int | None = None, fused: bool = False) -> None:
        if not dist.is_initialized():
            raise ValueError("ExpertParallel needs an initialized torch.distributed process group")
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = num_experts
        self.fp8_dispatch, self.fused = fp8_dispatch, fused
        self.recorder = recorder  # records every exchange on its comm track (recipes.train --trace)
        self.site = FlightSite(flight, "ep", group_ranks(group), layer) if flight is not None else None
        self.alignment = alignment or deep_gemm.get_m_alignment_for_contiguous_layout()
        self.set_plan(phy2log)

    def set_plan(self, phy2log: torch.Tensor | None) -> None:
        """Use a new EPLB placement from the next dispatch on (the weights must have moved with it)."""
        if phy2log is None:
            phy2log = torch.arange(self.num_experts)
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu().reshape(-1)
        num_physical = phy2log.numel()
        if num_physical % self.world:
            raise ValueError(f"ExpertParallel: {num_physical} (physical) experts are not divisible by the "
                             f"expert-parallel size {self.world}")
        if num_physical < self.num_experts or torch.bincount(phy2log, minlength=self.num_experts).min() < 1:
            raise ValueError(f"ExpertParallel: phy2log must host each of the {self.num_experts} logical experts")
        self.num_physical, self.local = num_physical, num_physical // self.world
        self.phy2log = phy2log
        self.local_logical = phy2log[self.rank * self.local:(self.rank + 1) * self.local]
        self.logcnt = torch.bincount(phy2log, minlength=self.num_experts)
        # replicas of each logical expert in physical order: first[e] + j -> physical slot
        order = torch.sort(phy2log, stable=True).indices
        self._replica_slots = order
        self._first_replica = torch.cumsum(self.logcnt, 0) - self.logcnt

    def to_physical(self, indices: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots; replica ``t % copies`` for token t; -1 stays -1."""
        if self.num_physical == self.num_experts and torch.equal(self.phy2log, torch.arange(self.num_experts)):
            return indices
        device = indices.device
        if self._replica_slots.device != device:
            self.logcnt, self._replica_slots, self._first_replica = (
                t.to(device) for t in (self.logcnt, self._replica_slots, self._first_replica))
        logical = indices.clamp_min(0)
        token = torch.arange(indices.shape[0], device=device)[:, None].expand_as(logical)
        replica = token % self.logcnt[logical]
        phys = self._replica_slots[self._first_replica[logical] + replica]
        return torch.where(indices >= 0, phys, indices)

    def _post_counts(self, send_counts: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start exchanging [num_physical] per-expert row counts; the result is [world, local] rows I receive.

        Exchanged on the tokens' device (NCCL/MCCL take device tensors only), then read on the host.
        Posted asynchronously so the send-side gather runs while the counts travel.
        """
        send = send_counts.to(torch.int64).contiguous()
        recv = torch.empty(self.world * self.local, dtype=torch.int64, device=send.device)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        _note_posted()
        return recv.view(self.world, self.local), (work, send)

    def _grouped_plan(self, recv_counts: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Index plan of the regrouping: received rows ``[source][expert]`` -> ``[expert][source]`` blocks.

        Returns ``source`` [M] (received row of each grouped row; ``total`` = the zero row for padding),
        ``m_indices`` [M] int32, ``rows`` [total] (grouped row of each received row) and the per-expert
        counts. Index arithmetic only (a few thousand int64s): the rows themselves move in one gather.
        """
        counts = recv_counts.to(device)  # [world, local]
        total = int(counts.sum())
        per_expert = counts.sum(0)
        padded = (per_expert + self.alignment - 1) // self.alignment * self.alignment
        group_start = padded.cumsum(0) - padded
        before_src = counts.cumsum(0) - counts  # rows of expert e from earlier sources
        block_start = counts.flatten().cumsum(0) - counts.flatten()  # start of (src, e) in the received rows
        flat = counts.flatten()
        block_dest = (group_start[None, :] + before_src).flatten()
        rows = (torch.arange(total, device=device) - block_start.repeat_interleave(flat)
                + block_dest.repeat_interleave(flat))
        num_grouped = int(padded.sum())
        source = torch.full((num_grouped,), total, dtype=torch.long, device=device)
        source[rows] = torch.arange(total, device=device)
        m_indices = torch.full((num_grouped,), -1, dtype=torch.int32, device=device)
        m_indices[rows] = torch.arange(self.local, device=device, dtype=torch.int32).repeat(self.world) \
            .repeat_interleave(flat)
        return source, m_indices, rows, per_expert

    # ---- the pieces: local steps (differentiable) and exchanges (not) ----------------------------------
    def plan_send(self, indices: torch.Tensor) -> SendPlan:
        """Order this rank's assignments by physical expert (so every peer's rows are one contiguous slice)."""
        num_tokens, k = indices.shape
        phys = self.to_physical(indices)
        dropped = self.num_physical  # a sentinel expert after the real ones: sorted last, never sent
        flat = torch.where(phys >= 0, phys, torch.full_like(phys, dropped)).reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_physical + 1)
        order = flat.argsort(stable=True)
        rows = torch.empty_like(order)
        rows[order] = torch.arange(order.numel(), device=order.device)
        send_counts = counts[:self.num_physical]
        num_sent = int(send_counts.sum())
        layout = fused_ops.send_layout(order, rows, num_sent, send_counts, num_tokens, k, self.fused)
        return SendPlan(order, PermuteState(rows=rows, num_tokens=num_tokens, tokens_per_expert=counts), send_counts,
                        send_counts.view(self.world, self.local).sum(1).tolist(), num_sent, k, layout)

    def gather(self, x: torch.Tensor, weights: torch.Tensor | None, plan: SendPlan,
               x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, SendPlan]:
        """The rows to send ``[num_sent, dim (+ weight columns)]``: each assignment's token, its routing weight as
        extra columns (``_weight_columns``) when given; and the plan to post them with.

        With fused kernels, one kernel: the rows with their columns; under FP8 dispatch the rows as they travel
        instead (e4m3 + scales, cast on the way, or moved from ``x_fp8``, the 1x128 cast of ``x`` its producer
        made: no cast at all) in the returned plan's ``wire``, the returned rows then a stand-in without storage
        for the gradient. (``x_fp8`` is not needed otherwise: the torch path casts the rows it sends.)"""
        columns = None if weights is None else _weight_columns(weights.reshape(-1), x.dtype)
        if plan.layout is not None and self.fp8_dispatch:
            send, wire = fused_ops.pack_rows_fp8(x, plan.layout.assign, plan.layout.rows, plan.k, columns, x_fp8)
            return send, replace(plan, wire=wire)
        if plan.layout is not None:
            return fused_ops.gather_rows(x, plan.layout.assign, plan.layout.rows, plan.k, columns), plan
        picked = plan.order[:plan.num_sent]
        rows = x.index_select(0, picked // plan.k)
        if weights is None:
            return rows, plan
        return torch.cat([rows, columns.index_select(0, picked)], dim=1), plan

    def post_dispatch(self, send: torch.Tensor, plan: SendPlan, dim: int) -> CommHandle[Received]:
        """Send the gathered rows (``dim`` feature columns, then weight columns) to their experts' ranks; not
        differentiable (``dispatch`` is). The comm thread exchanges the counts, packs FP8 and posts the rows;
        ``wait()`` unpacks what landed."""
        return post(self.recorder, "dispatch", lambda: self._dispatch(send.detach(), plan, dim, lambda r: r),
                    self.site)

    def regroup(self, rows: torch.Tensor, received: Received, keep_rows: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Arrived rows -> ``(x_grouped [M, dim], row weights [M] or None, x_fp8)`` in the grouped layout (one
        gather; pad rows read the spare zero row, so their weight is 0). ``x_fp8``: when the rows landed as FP8
        bytes (``Received.wire``), ``x_grouped``'s own 1x128 cast made in the same kernel, bit for bit what the
        grouped GEMM would make of it (``Experts.forward(..., x_fp8=)``); else None. There, without
        ``keep_rows`` (a GEMM that reads only that cast), ``x_grouped`` is a stand-in without storage."""
        dim = received.dim
        if received.layout is not None:  # one kernel: the rows and the weights their columns carry
            layout = received.layout
            if received.wire is not None:
                return fused_ops.regroup_rows_fp8(rows, received.wire, dim, layout.assign, layout.rows, keep_rows)
            return (*fused_ops.regroup_rows(rows, dim, layout.assign, layout.rows), None)
        x_grouped = rows[:, :dim].index_select(0, received.source)
        if rows.shape[1] == dim:
            return x_grouped, None, None
        return x_grouped, rows[:, dim:].float().sum(1).index_select(0, received.source), None

    @staticmethod
    def ungroup(y_grouped: torch.Tensor, received: Received) -> torch.Tensor:
        """Expert outputs back in arrival order (what travels back)."""
        if received.layout is not None:
            return fused_ops.gather_rows(y_grouped, received.layout.rows[:-1], received.layout.assign)
        return y_grouped.index_select(0, received.state.rows)

    def post_combine(self, y: torch.Tensor, received: Received) -> CommHandle[Returned]:
        """Send expert outputs (arrival order) back to their tokens' ranks; not differentiable (``combine`` is)."""
        return post(self.recorder, "combine", lambda: self._combine(y.detach(), received, lambda returned: returned),
                    self.site)

    @staticmethod
    def scatter_back(rows: torch.Tensor, plan: SendPlan, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Returned rows (sent order) -> ``[T, dim]``: each token's sum over its slots (dropped ones give 0),
        weighted by ``weights [T, k]`` when the rows were not scaled before ``w2``."""
        if plan.layout is not None and weights is None:  # one kernel: dropped slots (row -1) add nothing
            return fused_ops.unpermute(rows, plan.layout)
        pad = plan.state.rows.numel() - plan.num_sent
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        return unpermute(rows, plan.state, weights)

    # ---- the same, differentiable end to end (a plain forward and backward) ---------------------------
    def dispatch(self, x: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor | None = None) -> CommHandle[Dispatched]:
        """Send every (token, expert) assignment to the rank hosting (a replica of) the expert.

        x [T, dim]; indices [T, k] logical expert ids, -1 = dropped; weights [T, k] (optional) routing
        weights, sent with the rows (``Dispatched.weights``). Returns at once with a handle; its ``wait()``
        gives ``Dispatched`` with the received rows in the contiguous grouped layout. Differentiable: the
        backward sends the rows' gradient back (and waits for it).
        """
        if x.dim() != 2 or indices.dim() != 2 or indices.shape[0] != x.shape[0]:
            raise ValueError(f"dispatch: x must be [T, dim] and indices [T, k], got {tuple(x.shape)} and "
                             f"{tuple(indices.shape)}")
        if weights is not None and weights.shape != indices.shape:
            raise ValueError(f"dispatch: weights must be [T, k] like indices {tuple(indices.shape)}, "
                             f"got {tuple(weights.shape)}")
        send, plan = self.gather(x, weights, self.plan_send(indices))

        def grouped(received: Received) -> Dispatched:
            rows = arrived(send, received.rows, received.exchanged)
            x_grouped, row_weights, x_fp8 = self.regroup(rows, received)
            return Dispatched(x_grouped, received.m_indices, received.tokens_per_expert, row_weights, received, plan,
                              x_fp8)

        return post(self.recorder, "dispatch", lambda: self._dispatch(send.detach(), plan, x.shape[1], grouped),
                    self.site)

    def combine(self, y_grouped: torch.Tensor, dispatched: Dispatched,
                weights: torch.Tensor | None = None) -> CommHandle[torch.Tensor]:
        """Return expert outputs to their tokens' ranks; ``wait()`` gives ``sum_j y[t, j]``, or
        ``sum_j weights[t, j] * y[t, j]`` with ``weights`` [T, k] (rows not scaled before ``w2``). Differentiable."""
        y = self.ungroup(y_grouped, dispatched.received)

        def back(returned: Returned) -> torch.Tensor:
            return self.scatter_back(arrived(y, returned.rows, returned.exchanged), dispatched.plan, weights)

        return post(self.recorder, "combine", lambda: self._combine(y.detach(), dispatched.received, back),
                    self.site)

    # ---- on the comm thread -------------------------------------------------------------------------------
    def _dispatch(self, send: torch.Tensor, plan: SendPlan, dim: int, then: Callable[[Received], T]) -> Posted[T]:
        """The exchange, staged so the wire is busy while the host works: the rows are packed while the counts
        travel, the regrouping's index plan is computed while the rows travel."""
        recv_counts, count_work = self._post_counts(plan.send_counts)
        packed = plan.wire  # packed by the sender's fused gather, or:
        if self.fp8_dispatch and packed is None:  # e4m3 + scales, then the weight columns' bytes: one buffer
            packed = torch.cat([_pack_fp8(send[:, :dim]), send[:, dim:].contiguous().view(torch.uint8)], dim=1)
        count_work[0].wait()
        recv_splits = recv_counts.sum(1).tolist()
        total = sum(recv_splits)
        if plan.wire is not None:  # the landed bytes go straight into the grouped layout: a stand-in, no storage
            rows = send.new_zeros(()).expand(total + 1, send.shape[1])
        else:
            rows = send.new_empty(total + 1, send.shape[1])
            rows[total:].zero_()  # one spare zero row: the regrouping's pad rows read it; the rest is overwritten
        wire = send if packed is None else packed
        recv = rows[:total] if packed is None else packed.new_empty(total, packed.shape[1])
        works = _all_to_all(wire, recv, recv_splits, plan.send_splits, self.group)
        source, m_indices, recv_rows, per_expert = self._grouped_plan(recv_counts, send.device)
        layout = None
        if plan.layout is not None:  # the fused kernels' forms of the same plan, in place of the torch path's
            source = torch.where(m_indices >= 0, source, -1)
            layout = fused_ops.Grouping(rows=F.pad(recv_rows, (0, 1), value=-1), assign=source, m_indices=m_indices,
                                        tokens_per_expert=per_expert, num_tokens=total + 1, k=1)
            recv_rows = layout.rows[:total]

        def landed() -> T:
            if packed is not None and plan.wire is None:
                rows[:total, :dim] = _unpack_fp8(recv, dim, send.dtype)
                rows[:total, dim:] = recv[:, packed.shape[1] - (send.shape[1] - dim) * send.element_size():] \
                    .contiguous().view(send.dtype)
            exchanged = Exchanged(plan.send_splits, recv_splits, send.shape[0], tuple(rows.shape), rows.dtype,
                                  rows.device, self.group, self.recorder, self.site)
            return then(Received(rows, exchanged, dim, source, m_indices,
                                 PermuteState(rows=recv_rows, num_tokens=total, tokens_per_expert=per_expert),
                                 per_expert, layout, None if plan.wire is None else recv))

        return Posted(works, landed, nbytes=wire.numel() * wire.element_size())

    def _combine(self, y: torch.Tensor, received: Received, then: Callable[[Returned], T]) -> Posted[T]:
        there = received.exchanged  # the dispatch this combine reverses
        back = y.new_empty(there.rows_sent, y.shape[1])
        works = _all_to_all(y.contiguous(), back, there.sent_splits, there.received_splits, self.group)
        exchanged = Exchanged(there.received_splits, there.sent_splits, y.shape[0], tuple(back.shape), back.dtype,
                              back.device, self.group, self.recorder, self.site)
        return Posted(works, lambda: then(Returned(back, exchanged)), nbytes=y.numel() * y.element_size())
