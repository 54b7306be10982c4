"""Execute one rank's part of a schedule IR: the single runtime behind every pipeline class.

``Pipeline(modules, schedule=...)`` holds this rank's stage modules; ``step`` splits the batch
into micro-batches, builds (and caches) the schedule, and runs the rank's actions in order:

- ``F``: run the stage (and the criterion on a chain's last stage); hand outputs to the next stage.
- ``B``: full backward of the stage; hand input gradients to the previous stage.
- ``I``: the same backward with ``accel.wgrad.collect_into(store.put)`` active, so layers that defer
  their weight-gradient GEMMs (``accel.wgrad.defer``) leave them in this pipeline's store.
- ``W``: run the closures the matching I deferred.
- ``(F;B)OVERLAP_F_B``: the modules' ``overlapped_forward_backward`` classmethod when both stage
  modules share a class that defines it, else F then B. A module that also defines ``forward_run`` (a
  stage that runs a micro-batch as explicit pieces, ``models.deepseek_v3.plan``) runs every F and B of
  the step through it: its F returns a run record that the runtime hands to the matching B (plain
  ``backward_run`` or the overlapped chunk); otherwise upstream's contract (a plain forward, a plain
  backward from the stored outputs).

Messages between ranks follow ``ir.comm_plan`` (the model the validator and simulator use).
With a ``flight`` recorder (``accel.flight``) each action, send and receive is an entry of it, so a
hang can be traced to the rank and the action that stopped first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import accel.wgrad
from accel.flight import FlightRecorder
from accel.trace import TraceRecorder
from dualpipe import schedules
from dualpipe.comm import P2P
from dualpipe.ir import Action, Item, Overlap, Schedule, comm_plan
from dualpipe.utils import gather, run_backward, scatter
from dualpipe.validate import check_deadlock_free, validate
from dualpipe.weight_grad import WeightGradStore

DEFAULT_P2P_TIMEOUT = 300.0


def _forward_only(schedule: Schedule) -> Schedule:
    """The schedule with every backward and weight pass dropped (inference steps)."""
    actions = tuple(tuple(p for item in items for p in item.parts if p.kind == "F") for items in schedule.actions)
    return Schedule(schedule.name + "-forward", schedule.layout, actions)


class Pipeline(nn.Module):
    """Run ``schedule`` (a name from ``schedules.SCHEDULES``) over this rank's stage modules.

    Args:
        modules: this rank's stage modules in the order of ``schedule``'s layout
            (``layout.stages_of(rank)``: one for 1f1b/zb1p, two for zbv/dualpipe/dualpipev, ``vpp`` model chunks
            for interleaved1f1b).
        schedule: schedule name.
        vpp: model chunks per rank (``interleaved1f1b`` only).
        batch_dim: dimension along which inputs and labels are split into micro-batches.
        process_group: group of the pipeline ranks (default: the world).
        rank_mapping: ``rank_mapping[group_rank]`` is the pipeline rank of that group member.
        p2p_timeout: seconds any wait on a neighbour may take before a P2PTimeoutError.
        free_sent_outputs: release the storage of stage outputs once sent to the next rank, as
            upstream does (their backward needs only the graph). Turn off for stages whose last
            operation saves its own output for backward (e.g. ending in ``tanh`` or ``sigmoid``).
    """

    def __init__(self, modules: Sequence[nn.Module], schedule: str, batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None,
                 p2p_timeout: float = DEFAULT_P2P_TIMEOUT, free_sent_outputs: bool = True, vpp: int = 1) -> None:
        super().__init__()
        self.free_sent_outputs = free_sent_outputs
        schedules.check_vpp(schedule, vpp)
        self.schedule_name, self.vpp = schedule, vpp
        self.module = nn.ModuleList(modules)
        self.batch_dim = batch_dim
        self.group = process_group
        self.num_ranks = dist.get_world_size(process_group)
        group_rank = dist.get_rank(process_group)
        mapping = list(range(self.num_ranks)) if rank_mapping is None else list(rank_mapping)
        if sorted(mapping) != list(range(self.num_ranks)):
            raise ValueError(f"rank_mapping must be a permutation of 0..{self.num_ranks - 1}, got {mapping}")
        self.rank = mapping[group_rank]
        inverse = {pp: g for g, pp in enumerate(mapping)}
        peers = [dist.get_global_rank(process_group, inverse[p]) if process_group is not None else inverse[p]
                 for p in range(self.num_ranks)]
        device = next(self.module.parameters()).device if any(True for _ in self.module.parameters()) else (
            accel.default_device())
        self.p2p = P2P(process_group, peers, self.rank, device, timeout=p2p_timeout)
        self.store = WeightGradStore()
        mods = [type(m) for m in modules]
        self.overlapped_forward_backward = (len(mods) == 2 and mods[0] is mods[1]
                                            and hasattr(mods[0], "overlapped_forward_backward"))
        self._cache: dict[tuple[int, bool], tuple[Schedule, list]] = {}
        self.recorder: TraceRecorder | None = None  # when set, each action is a span of its compute track

    @property
    def flight(self) -> FlightRecorder | None:
        """The flight recorder of this rank's actions and P2P messages (None: not recorded)."""
        return self.p2p.flight

    @flight.setter
    def flight(self, flight: FlightRecorder | None) -> None:
        self.p2p.flight = flight

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self, num_chunks: int, forward_only: bool = False) -> Schedule:
        return self._plan(num_chunks, forward_only)[0]

    def _plan(self, num_chunks: int, forward_only: bool) -> tuple[Schedule, list]:
        key = (num_chunks, forward_only)
        if key not in self._cache:
            sched = schedules.build(self.schedule_name, self.num_ranks, num_chunks, self.vpp)
            validate(sched)
            if forward_only:
                sched = _forward_only(sched)
                check_deadlock_free(sched)
            stages = sched.layout.stages_of(self.rank)
            if len(stages) != len(self.module):
                raise ValueError(f"{self.schedule_name} places {len(stages)} stage(s) on each rank "
                                 f"(rank {self.rank}: stages {list(stages)}), got {len(self.module)} module(s)")
            self._cache[key] = (sched, comm_plan(sched))
        return self._cache[key]

    def _stage_module(self, stage: int) -> nn.Module:
        return self.module[self._sched.layout.stages_of(self.rank).index(stage)]

    # -- step ----------------------------------------------------------------------------------
    def run(self, num_chunks: int, inputs: dict[int, tuple], labels: dict[int, tuple],
            criterion: Callable | None, return_outputs: bool) -> tuple[dict[int, torch.Tensor], dict[int, list]]:
        """Execute this rank's actions. ``inputs[mb]`` feeds chain-first stages held here,
        ``labels[mb]`` the criterion of chain-last stages held here. Returns per-micro-batch
        losses and (if asked) outputs of this rank's chain-last stages."""
        forward_only = not torch.is_grad_enabled()
        sched, plan = self._plan(num_chunks, forward_only)
        self._sched = sched
        self._criterion, self._labels, self._return_outputs = criterion, labels, return_outputs
        self._inputs: dict[tuple[int, int], list] = {}
        self._outputs: dict[tuple[int, int], list] = {}
        self._out_grads: dict[tuple[int, int], list] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._final: dict[int, list] = {}
        self._runs: dict[tuple[int, int], Any] = {}  # planned stages: each forward's record, for its backward
        lay = sched.layout
        for stage in lay.stages_of(self.rank):
            if lay.prev_stage(stage) is None:
                for mb in lay.chain_of(stage).microbatches:
                    self._inputs[(stage, mb)] = list(inputs[mb])
        self.store.clear()
        self.last_step_stats = {"max_pending_wgrad": 0, "wgrad_closures_run": 0}
        # (item, start, end, receive overhead not spent waiting) of each computation, for benchmarks
        self.last_step_timeline: list[tuple[Item, float, float, float]] = []
        flight = self.flight
        try:
            for item, ex in zip(sched.actions[self.rank], plan[self.rank]):
                name = str(item)
                if flight is not None:
                    flight.action = name  # the EP exchanges of this action name it
                exchange_start, blocked_before = time.perf_counter(), self.p2p.blocked_s
                for msg in ex.recvs:
                    tensors = self.p2p.recv(msg, name)
                    if msg.kind == "act":
                        self._inputs[(msg.stage, msg.mb)] = [self._as_input(t) for t in tensors]
                    else:
                        self._out_grads[(msg.stage, msg.mb)] = tensors
                started = time.perf_counter()
                if flight is None:
                    self._run_item(item)
                else:
                    single = isinstance(item, Action)
                    with flight.record("action", name, stage=item.stage if single else None,
                                       mb=item.mb if single else None):
                        self._run_item(item)
                ended = time.perf_counter()
                overhead = started - exchange_start - (self.p2p.blocked_s - blocked_before)
                self.last_step_timeline.append((item, started, ended, overhead))
                if self.recorder is not None:
                    self.recorder.add("compute", str(item), started, ended)
                stats = self.last_step_stats
                stats["max_pending_wgrad"] = max(stats["max_pending_wgrad"], self.store.pending())
                self.p2p.reap_sends()
            self.p2p.wait_sends()
        finally:
            leftover = self.store.pending()
            self.store.clear()
            if flight is not None:
                flight.action = None
        if leftover and not forward_only:
            raise RuntimeError(f"rank {self.rank}: {leftover} weight-gradient closures were never run by a W action")
        return self._losses, self._final

    def _as_input(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is not None and torch.is_grad_enabled() and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_()
        return t

    # -- actions -------------------------------------------------------------------------------
    def _run_item(self, item: Item) -> None:
        if isinstance(item, Overlap):
            if self.overlapped_forward_backward:
                self._overlapped(item.forward, item.backward)
            else:
                self._forward(item.forward)
                self._backward(item.backward)
        elif item.kind == "F":
            self._forward(item)
        elif item.kind in ("B", "I"):
            self._backward(item)
        else:
            self.last_step_stats["wgrad_closures_run"] += self.store.pop((item.stage, item.mb))

    def _pre_forward(self, a: Action) -> tuple[nn.Module, list, Callable | None, tuple]:
        inputs = self._inputs[(a.stage, a.mb)]
        last = self._sched.layout.next_stage(a.stage) is None
        criterion = self._criterion if last else None
        labels = tuple(self._labels.get(a.mb, ())) if criterion is not None else ()
        return self._stage_module(a.stage), inputs, criterion, labels

    def _post_forward(self, a: Action, outputs: Any, loss: torch.Tensor | None) -> None:
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        for i, t in enumerate(outputs):
            if isinstance(t, torch.Tensor) and t._base is not None:
                raise ValueError(f"rank {self.rank}: stage {a.stage} returned a view as output {i} "
                                 f"(micro-batch {a.mb}); return a fresh tensor (e.g. .clone() or .contiguous())")
        lay = self._sched.layout
        nxt = lay.next_stage(a.stage)
        key = (a.stage, a.mb)
        if not torch.is_grad_enabled():
            self._inputs.pop(key, None)
        if nxt is None:
            if loss is not None:
                self._losses[a.mb] = loss
            if self._return_outputs:
                self._final[a.mb] = [t.detach() if isinstance(t, torch.Tensor) else t for t in outputs]
            if torch.is_grad_enabled():
                self._outputs[key] = outputs
            return
        if torch.is_grad_enabled():
            self._outputs[key] = outputs
        if lay.stage_rank[nxt] == self.rank:
            self._inputs[(nxt, a.mb)] = [self._as_input(t.detach()) if isinstance(t, torch.Tensor) else t
                                         for t in outputs]
        else:
            (msg,) = self._sched.sends_of(a)
            # once sent, an output is needed only as an autograd root: free its storage (as upstream)
            self.p2p.send(msg, outputs, free_after=self.free_sent_outputs and torch.is_grad_enabled())

    def _planned(self, module: nn.Module) -> bool:
        """Whether this step runs ``module``'s micro-batches as run records (see the module docstring)."""
        return self.overlapped_forward_backward and torch.is_grad_enabled() and hasattr(module, "forward_run")

    def _forward(self, a: Action) -> None:
        module, inputs, criterion, labels = self._pre_forward(a)
        if self._planned(module):
            outputs, loss, self._runs[(a.stage, a.mb)] = module.forward_run(inputs, criterion, labels)
            self._post_forward(a, outputs, loss)
            return
        outputs = module(*inputs)
        loss = None
        if criterion is not None:
            outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
            loss = criterion(*outs, *labels)
        self._post_forward(a, outputs, loss)

    def _pre_backward(self, a: Action) -> tuple[torch.Tensor | None, list, list]:
        key = (a.stage, a.mb)
        if self._sched.layout.next_stage(a.stage) is None:
            if a.mb not in self._losses:
                raise ValueError(f"rank {self.rank}: a training step needs a criterion on the rank holding the "
                                 f"last stage ({a.stage}); got criterion=None")
            self._outputs.pop(key, None)
            return self._losses[a.mb], [], []
        outputs, grads = self._outputs.pop(key), self._out_grads.pop(key)
        if len(grads) != len(outputs):
            raise ValueError(f"rank {self.rank}: stage {a.stage} micro-batch {a.mb} produced {len(outputs)} outputs "
                             f"but received {len(grads)} gradients from the next stage")
        pairs = []
        for i, (t, g) in enumerate(zip(outputs, grads)):
            if g is None or not t.requires_grad:
                continue
            if g.shape != t.shape or g.dtype != t.dtype:
                raise ValueError(f"rank {self.rank}: gradient {i} for stage {a.stage} micro-batch {a.mb} has shape "
                                 f"{tuple(g.shape)}/{g.dtype} but the output has {tuple(t.shape)}/{t.dtype}: "
                                 "neighbouring stages disagree on shapes")
            pairs.append((t, g))
        return None, [t for t, _ in pairs], [g for _, g in pairs]

    def _post_backward(self, a: Action) -> None:
        key = (a.stage, a.mb)
        if a.kind == "I":
            self.store.flush(key)
        inputs = self._inputs.pop(key)
        grads = [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]
        prev = self._sched.layout.prev_stage(a.stage)
        if prev is None:
            return
        if self._sched.layout.stage_rank[prev] == self.rank:
            self._out_grads[(prev, a.mb)] = grads
        else:
            (msg,) = self._sched.sends_of(a)
            self.p2p.send(msg, grads)

    def _collecting(self, a: Action) -> contextlib.AbstractContextManager:
        return accel.wgrad.collect_into(self.store.put) if a.kind == "I" else contextlib.nullcontext()

    def _backward(self, a: Action) -> None:
        loss, outputs, grads = self._pre_backward(a)
        run = self._runs.pop((a.stage, a.mb), None)
        with self._collecting(a):
            if run is not None:
                type(self._stage_module(a.stage)).backward_run(run, loss, grads)
            elif loss is not None:
                loss.backward()
            elif outputs:
                run_backward(outputs, grads)
        if loss is not None:
            loss.detach_()
        self._post_backward(a)

    def _overlapped(self, f: Action, b: Action) -> None:
        module0, inputs0, criterion0, labels0 = self._pre_forward(f)
        loss1, outputs1, grads1 = self._pre_backward(b)
        with self._collecting(b):
            if self._planned(module0):
                outputs0, loss0, self._runs[(f.stage, f.mb)] = type(module0).overlapped_forward_backward(
                    module0, inputs0, criterion0, list(labels0), self._runs.pop((b.stage, b.mb)), loss1, grads1)
            else:
                outputs0, loss0 = type(module0).overlapped_forward_backward(
                    module0, inputs0, criterion0, list(labels0), self._stage_module(b.stage), loss1, outputs1, grads1)
        if loss1 is not None:
            loss1.detach_()
        self._post_forward(f, outputs0, loss0)
        self._post_backward(b)

    # -- public step -----------------------------------------------------------------------------
    def step(self, *inputs: torch.Tensor | None, num_chunks: int = 0, criterion: Callable | None = None,
             labels: Sequence[torch.Tensor | None] = (), return_outputs: bool = False
             ) -> tuple[torch.Tensor | None, Any]:
        """One training (or, under ``torch.no_grad()``, inference) step over ``num_chunks`` micro-batches.

        Inputs are needed on the rank holding the first stage, ``criterion`` and ``labels`` on
        the rank holding the last; that rank returns ``(loss per micro-batch, outputs or None)``,
        other ranks ``(None, None)``.
        """
        sched = self._checked_schedule(num_chunks)
        lay = sched.layout
        if len(lay.chains) != 1:
            raise ValueError(f"{self.schedule_name} feeds several chains; use its own class (DualPipe) to step it")
        chain = lay.chains[0]
        first, last = lay.stage_rank[chain.stages[0]] == self.rank, lay.stage_rank[chain.stages[-1]] == self.rank
        if last and torch.is_grad_enabled() and criterion is None:
            raise ValueError(f"a training step needs a criterion on rank {self.rank}, which holds the last stage")
        ins = dict(enumerate(scatter(inputs, num_chunks, self.batch_dim))) if first else {}
        labs = dict(enumerate(scatter(tuple(labels), num_chunks, self.batch_dim))) if last else {}
        losses, outs = self.run(num_chunks, ins, labs, criterion if last else None, return_outputs)
        return self._result(chain.microbatches, last, losses, outs, criterion, return_outputs)

    def _checked_schedule(self, num_chunks: int) -> Schedule:
        if not isinstance(num_chunks, int) or isinstance(num_chunks, bool):
            raise ValueError(f"num_chunks must be an int, got {num_chunks!r}")
        schedules.check_sizes(self.schedule_name, self.num_ranks, num_chunks, self.vpp)
        return self.schedule(num_chunks)

    def _result(self, mbs: Sequence[int], here: bool, losses: dict, outs: dict, criterion: Callable | None,
                return_outputs: bool) -> tuple[torch.Tensor | None, Any]:
        if not here:
            return None, None
        loss = torch.stack([losses[m] for m in mbs]) if criterion is not None else None
        outputs = None
        if return_outputs:
            outputs = gather([outs[m] for m in mbs], self.batch_dim)
            outputs = outputs[0] if len(outputs) == 1 else outputs
        return loss, outputs
