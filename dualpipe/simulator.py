"""Event simulation of a schedule: when each action runs, the makespan, bubbles and peak memory.

The simulation follows the runtime's communication model (``ir.comm_plan``): before each item
a rank posts the sends of its previous item and waits for the messages its item needs, taking
each link's messages in the sender's order; a message arrives ``p2p`` after its producer ends.
Host time spent on messages is charged where the runtime spends it: ``send`` per message an item
posts (after its computation, before the message leaves) and ``recv`` per message a rank takes,
one after the other, once each has arrived. An item that moves two messages each way (DualPipe's
overlapped F&B) pays them twice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from dualpipe.ir import Item, Message, Overlap, Schedule, comm_plan
from dualpipe.schedules import built


@dataclass(frozen=True)
class Costs:
    """Per-action durations (any unit). ``B`` is the full backward; ``I`` defaults to ``B - W``;
    ``FB`` (an overlapped forward and backward) defaults to ``F + B`` (no overlap gain)."""

    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    I: float | None = None  # noqa: E741 - the pipelining notation's name
    FB: float | None = None
    p2p: float = 0.0
    send: float = 0.0  # host time to post one message
    recv: float = 0.0  # host time to take one arrived message

    def __post_init__(self) -> None:
        for name in ("F", "B", "W", "p2p", "send", "recv"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost {name} must be >= 0, got {getattr(self, name)}")
        if self.W > self.B:
            raise ValueError(f"cost W ({self.W}) cannot exceed the full backward B ({self.B})")

    @property
    def input_grad(self) -> float:
        return self.B - self.W if self.I is None else self.I

    @property
    def overlapped(self) -> float:
        return self.F + self.B if self.FB is None else self.FB

    def of(self, item: Item) -> float:
        if isinstance(item, Overlap):
            return self.overlapped - (self.W if item.backward.kind == "I" else 0.0)
        return {"F": self.F, "B": self.B, "I": self.input_grad, "W": self.W}[item.kind]


@dataclass
class Interval:
    item: Item
    start: float
    end: float


@dataclass
class SimResult:
    """Timeline per rank and the figures derived from it."""

    schedule: Schedule
    costs: Costs
    timeline: list[list[Interval]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((iv.end for row in self.timeline for iv in row), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(iv.end - iv.start for iv in self.timeline[rank])

    def bubble(self, rank: int) -> float:
        """Idle time of ``rank`` within the step (makespan minus its compute)."""
        return self.makespan - self.busy(rank)

    def peak_activations(self, rank: int) -> int:
        return peak_activations(self.schedule, rank)

    def parameters(self, rank: int) -> int:
        """Stage replicas whose parameters the rank holds (in units of one stage)."""
        return len(self.schedule.layout.stages_of(rank))


def peak_activations(schedule: Schedule, rank: int) -> int:
    """Most (stage, micro-batch) activations alive at once on ``rank``: from F until B, or until W after an I.
    A rank runs its items in order, so this needs no timing."""
    live = peak = 0
    for item in schedule.actions[rank]:
        for a in item.parts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind in ("B", "W"):
                live -= 1
    return peak


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class Program:
    """A schedule resolved once into its dependency graph, to be timed under many ``Costs``.

    ``order`` lists (rank, index) of every item in an order where each item comes after the
    items it waits for; ``waits[i]`` holds the order positions of the producers of the messages
    item ``i`` takes before it starts (``ir.comm_plan``'s receives, buffered ones included, in the
    order the runtime takes them); ``sends[i]`` counts the messages item ``i`` posts.
    """

    schedule: Schedule
    order: tuple[tuple[int, int], ...]
    waits: tuple[tuple[int, ...], ...]
    sends: tuple[int, ...]

    def run(self, costs: Costs | None = None) -> SimResult:
        """Time every item: its rank takes its messages in order, each once it has arrived (``p2p`` after its
        producer ends) at ``recv`` apiece; then it computes (``costs.of``) and posts its sends at ``send`` apiece.
        ``costs`` is a ``Costs`` or anything with its ``of``, ``p2p``, ``send`` and ``recv``."""
        costs = costs or Costs()
        actions = self.schedule.actions
        end = [0.0] * len(self.order)
        clock = [0.0] * self.schedule.num_ranks
        result = SimResult(self.schedule, costs, [[] for _ in range(self.schedule.num_ranks)])
        for i, (rank, idx) in enumerate(self.order):
            item = actions[rank][idx]
            start = clock[rank]
            for j in self.waits[i]:
                start = max(start, end[j] + costs.p2p) + costs.recv
            end[i] = clock[rank] = start + costs.of(item) + self.sends[i] * costs.send
            result.timeline[rank].append(Interval(item, start, end[i]))
        return result


def compile_schedule(schedule: Schedule) -> Program:
    """Resolve ``schedule``'s communication into a ``Program``; DeadlockError if it cannot finish."""
    plans = comm_plan(schedule)
    producer: dict[Message, int] = {}
    pos = [0] * schedule.num_ranks
    order: list[tuple[int, int]] = []
    waits: list[tuple[int, ...]] = []
    sends: list[int] = []
    progress = True
    while progress:
        progress = False
        for rank, items in enumerate(schedule.actions):
            while pos[rank] < len(items):
                ex = plans[rank][pos[rank]]
                if any(m not in producer for m in ex.recvs):
                    break
                waits.append(tuple(producer[m] for m in ex.recvs))
                order.append((rank, pos[rank]))
                sends.append(0)
                for part in items[pos[rank]].parts:
                    for m in schedule.sends_of(part):
                        producer[m] = len(order) - 1
                        sends[-1] += 1
                pos[rank] += 1
                progress = True
    stuck = [r for r, items in enumerate(schedule.actions) if pos[r] < len(items)]
    if stuck:
        where = "; ".join(f"rank {r} at {schedule.actions[r][pos[r]]}" for r in stuck)
        raise DeadlockError(f"simulation stuck: {where}")
    return Program(schedule, tuple(order), tuple(waits), tuple(sends))


@functools.lru_cache(maxsize=256)
def program(name: str, num_ranks: int, num_microbatches: int, vpp: int = 1) -> Program:
    """The compiled ``name`` schedule (``schedules.build``), memoised: searches time one schedule many times."""
    return compile_schedule(built(name, num_ranks, num_microbatches, vpp))


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time every item of ``schedule`` under ``costs``; DeadlockError if it cannot finish."""
    return compile_schedule(schedule).run(costs)
