"""Event simulation of a schedule: when each action runs, the makespan, bubbles and peak memory.

The simulation follows the runtime's communication model (``ir.comm_plan``): before each item
a rank posts the sends of its previous item and waits for the messages its item needs, taking
each link's messages in the sender's order; a message arrives ``p2p`` after its producer ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpipe.ir import Item, Message, Overlap, Schedule, comm_plan


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

    def __post_init__(self) -> None:
        for name in ("F", "B", "W", "p2p"):
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
        """Most (stage, micro-batch) activations alive at once: from F until B, or until W after an I."""
        live = peak = 0
        for iv in self.timeline[rank]:
            for a in iv.item.parts:
                if a.kind == "F":
                    live += 1
                    peak = max(peak, live)
                elif a.kind in ("B", "W"):
                    live -= 1
        return peak

    def parameters(self, rank: int) -> int:
        """Stage replicas whose parameters the rank holds (in units of one stage)."""
        return len(self.schedule.layout.stages_of(rank))


class DeadlockError(RuntimeError):
    pass


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time every item of ``schedule`` under ``costs``; DeadlockError if it cannot finish."""
    costs = costs or Costs()
    plans = comm_plan(schedule)
    sent: dict[Message, float] = {}
    clock = [0.0] * schedule.num_ranks
    pos = [0] * schedule.num_ranks
    result = SimResult(schedule, costs, [[] for _ in range(schedule.num_ranks)])
    progress = True
    while progress:
        progress = False
        for rank, items in enumerate(schedule.actions):
            while pos[rank] < len(items):
                ex = plans[rank][pos[rank]]
                if any(m not in sent for m in ex.recvs):
                    break
                item = items[pos[rank]]
                start = max([clock[rank]] + [sent[m] + costs.p2p for m in ex.recvs])
                end = start + costs.of(item)
                result.timeline[rank].append(Interval(item, start, end))
                for part in item.parts:
                    for m in schedule.sends_of(part):
                        sent[m] = end
                clock[rank] = end
                pos[rank] += 1
                progress = True
    stuck = [r for r, items in enumerate(schedule.actions) if pos[r] < len(items)]
    if stuck:
        where = "; ".join(f"rank {r} at {schedule.actions[r][pos[r]]}" for r in stuck)
        raise DeadlockError(f"simulation stuck: {where}")
    return result
