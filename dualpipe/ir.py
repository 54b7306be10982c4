"""The schedule IR: per-rank ordered actions on (stage, micro-batch), and the messages they imply.

One ``Schedule`` drives everything: the validator proves it, the simulator times it, the
timeline draws it and the runtime executes it. Actions use the notation of PyTorch's
``torch.distributed.pipelining`` with global stage numbers: ``0F3`` (forward of stage 0 on
micro-batch 3), ``7B3`` (full backward), ``7I3`` (input-gradient backward), ``7W3`` (weight
gradient) and ``(0F7;7B3)OVERLAP_F_B`` (a forward and a backward run together). A CSV holds one
line per rank.

Stages form chains (a micro-batch runs through a chain's stages in order): 1F1B has one chain
over the ranks, DualPipeV one V-shaped chain of 2*PP stages, DualPipe two mirrored chains (stage
``s < PP`` on rank ``s``; stage ``PP + j`` is model part ``j`` on rank ``PP-1-j``) that carry the
two halves of the micro-batches.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

KINDS = ("F", "B", "I", "W")
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP_RE = re.compile(r"^\((\d+F\d+);(\d+[BI]\d+)\)OVERLAP_F_B$")


@dataclass(frozen=True)
class Action:
    """One computation: ``kind`` in F/B/I/W on global ``stage`` for micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self,)


@dataclass(frozen=True)
class Overlap:
    """A forward and a backward (B or I) of two stages on one rank, run as one overlapped unit."""

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if self.forward.kind != "F" or self.backward.kind not in ("B", "I"):
            raise ValueError(f"overlap needs (F; B|I), got ({self.forward}; {self.backward})")

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self.forward, self.backward)


Item = Action | Overlap


def parse_item(text: str) -> Item:
    """``'7I0'`` -> Action, ``'(0F7;7B3)OVERLAP_F_B'`` -> Overlap; ValueError on anything else."""
    text = text.strip()
    m = _ACTION_RE.match(text)
    if m:
        return Action(m.group(2), int(m.group(1)), int(m.group(3)))
    m = _OVERLAP_RE.match(text)
    if m:
        return Overlap(parse_item(m.group(1)), parse_item(m.group(2)))
    raise ValueError(f"not a pipeline action: {text!r} (expected e.g. '0F3', '7I0', '(0F7;7B3)OVERLAP_F_B')")


@dataclass(frozen=True)
class Chain:
    """Stages a micro-batch passes through in order, and the micro-batches that take this path."""

    stages: tuple[int, ...]
    microbatches: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where stages live and how they connect: ``stage_rank[s]`` is the rank holding stage ``s``.

    A chain is a micro-batch's path through the whole model, so the ``i``-th stage of every chain runs model
    part ``i``. With two chains (DualPipe's mirrored ones) each part is held twice in the world, and its two
    copies must stay equal.
    """

    num_ranks: int
    stage_rank: tuple[int, ...]
    chains: tuple[Chain, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @functools.cached_property
    def parts(self) -> tuple[int, ...]:
        """The model part each stage runs: its place in its chain."""
        return tuple(self.chain_of(s).stages.index(s) for s in range(self.num_stages))

    @functools.cached_property
    def num_parts(self) -> int:
        """How many pieces the model is cut into."""
        return len(set(self.parts))

    @property
    def copies(self) -> int:
        """How many stages run each part (2 under DualPipe, else 1)."""
        return self.num_stages // self.num_parts

    def parts_of(self, rank: int) -> tuple[int, ...]:
        """The parts ``rank`` holds, in the order of its stages (``stages_of``)."""
        return self._rank_parts[rank]

    @functools.cached_property
    def _rank_parts(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.parts[s] for s in self.stages_of(r)) for r in range(self.num_ranks))

    def part_rank(self, part: int) -> int:
        """The rank of the first stage that runs ``part`` (under DualPipe: the down chain's)."""
        return self.stage_rank[self.parts.index(part)]

    def same_rank(self, part_a: int, part_b: int) -> bool:
        """Whether some rank holds both parts (e.g. the embedding's and the head's, so they can share it)."""
        return any(part_a in held and part_b in held for held in map(self.parts_of, range(self.num_ranks)))

    def chain_of(self, stage: int) -> Chain:
        for chain in self.chains:
            if stage in chain.stages:
                return chain
        raise ValueError(f"stage {stage} is in no chain")

    def prev_stage(self, stage: int) -> int | None:
        stages = self.chain_of(stage).stages
        i = stages.index(stage)
        return stages[i - 1] if i > 0 else None

    def next_stage(self, stage: int) -> int | None:
        stages = self.chain_of(stage).stages
        i = stages.index(stage)
        return stages[i + 1] if i + 1 < len(stages) else None

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)


@dataclass(frozen=True)
class Message:
    """A tensor list crossing ranks: activations of ``mb`` into ``stage`` ('act') or gradients out of it ('grad').

    ``stage`` is the stage that consumes the message; ``src``/``dst`` are pipeline ranks.
    """

    kind: str
    stage: int
    mb: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.mb}, rank {self.src}->{self.dst})"


@dataclass(frozen=True)
class Schedule:
    """A named schedule: ``actions[r]`` is rank ``r``'s ordered list of items."""

    name: str
    layout: Layout
    actions: tuple[tuple[Item, ...], ...]

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    def to_csv(self) -> str:
        return "\n".join(",".join(str(item) for item in rank_items) for rank_items in self.actions) + "\n"

    def save_csv(self, path: str | Path) -> None:
        Path(path).write_text(self.to_csv())

    # -- messages --------------------------------------------------------------------------
    def sends_of(self, action: Action) -> list[Message]:
        """Messages ``action`` produces for another rank (an F's outputs, a B/I's input gradients)."""
        lay = self.layout
        here = lay.stage_rank[action.stage]
        if action.kind == "F":
            nxt = lay.next_stage(action.stage)
            if nxt is not None and lay.stage_rank[nxt] != here:
                return [Message("act", nxt, action.mb, here, lay.stage_rank[nxt])]
        elif action.kind in ("B", "I"):
            prv = lay.prev_stage(action.stage)
            if prv is not None and lay.stage_rank[prv] != here:
                return [Message("grad", prv, action.mb, here, lay.stage_rank[prv])]
        return []

    def recvs_of(self, action: Action) -> list[Message]:
        """Messages ``action`` needs from another rank before it can run."""
        lay = self.layout
        here = lay.stage_rank[action.stage]
        if action.kind == "F":
            prv = lay.prev_stage(action.stage)
            if prv is not None and lay.stage_rank[prv] != here:
                return [Message("act", action.stage, action.mb, lay.stage_rank[prv], here)]
        elif action.kind in ("B", "I"):
            nxt = lay.next_stage(action.stage)
            if nxt is not None and lay.stage_rank[nxt] != here:
                return [Message("grad", action.stage, action.mb, lay.stage_rank[nxt], here)]
        return []

    def link_order(self) -> dict[tuple[int, int], list[Message]]:
        """For each (src, dst) rank pair, the messages in the order the sender emits them.

        Receivers take messages from a link in exactly this order (buffering early ones), so
        sends always match receives, also on backends without message tags (NCCL).
        """
        order: dict[tuple[int, int], list[Message]] = {}
        for rank_items in self.actions:
            for item in rank_items:
                for part in item.parts:
                    for msg in self.sends_of(part):
                        order.setdefault((msg.src, msg.dst), []).append(msg)
        return order


def from_csv(text: str, name: str = "imported") -> Schedule:
    """Parse one-line-per-rank CSV; the layout (placement and chains) is inferred from the actions.

    Stage ``s`` lives on the rank whose line mentions it; consecutive stages that see the same
    micro-batches form one chain (this recovers 1F1B, ZB, V-shaped and DualPipe's two chains).
    """
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise ValueError("schedule CSV is empty; expected one line of actions per rank")
    actions = tuple(tuple(parse_item(tok) for tok in ln.split(",")) for ln in lines)
    stage_rank: dict[int, int] = {}
    stage_mbs: dict[int, set[int]] = {}
    for rank, items in enumerate(actions):
        for item in items:
            for a in item.parts:
                if stage_rank.setdefault(a.stage, rank) != rank:
                    raise ValueError(f"stage {a.stage} appears on rank {stage_rank[a.stage]} and rank {rank}")
                stage_mbs.setdefault(a.stage, set()).add(a.mb)
    num_stages = max(stage_rank) + 1
    missing = sorted(set(range(num_stages)) - set(stage_rank))
    if missing:
        raise ValueError(f"stages {missing} have no actions; stage numbers must be 0..{num_stages - 1}")
    chains: list[Chain] = []
    current: list[int] = []
    for s in range(num_stages):
        if current and stage_mbs[s] != stage_mbs[current[0]]:
            chains.append(Chain(tuple(current), tuple(sorted(stage_mbs[current[0]]))))
            current = []
        current.append(s)
    chains.append(Chain(tuple(current), tuple(sorted(stage_mbs[current[0]]))))
    layout = Layout(len(actions), tuple(stage_rank[s] for s in range(num_stages)), tuple(chains))
    return Schedule(name, layout, actions)


def load_csv(path: str | Path) -> Schedule:
    return from_csv(Path(path).read_text(), name=Path(path).stem)


@dataclass(frozen=True)
class Exchange:
    """What a rank does before running one item: post ``sends`` (outputs of its previous item) and
    take ``recvs`` from each incoming link, in the sender's order, until the item's inputs are in."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    needs: tuple[Message, ...]


def comm_plan(schedule: Schedule) -> list[list[Exchange]]:
    """Per rank, one ``Exchange`` before each item plus a final one that flushes the last sends.

    This is the communication model shared by the validator, the simulator and the runtime:
    sends produced by item ``k`` are posted together with the receives of item ``k+1`` (as
    upstream's batched P2P does). Raises ValueError when an item needs a message nobody sends.
    """
    links = schedule.link_order()
    position = {(link, msg): i for link, msgs in links.items() for i, msg in enumerate(msgs)}
    plans: list[list[Exchange]] = []
    for rank, items in enumerate(schedule.actions):
        taken = {link: 0 for link in links if link[1] == rank}
        pending_sends: list[Message] = []
        plan = []
        for item in list(items) + [None]:
            needs = [m for part in (item.parts if item is not None else ()) for m in schedule.recvs_of(part)]
            recvs: list[Message] = []
            for msg in needs:
                link = (msg.src, msg.dst)
                pos = position.get((link, msg))
                if pos is not None and taken[link] > pos:
                    continue
                if pos is None:
                    raise ValueError(f"rank {rank}: {item} needs {msg}, which rank {msg.src} never sends")
                while taken[link] <= pos:
                    recvs.append(links[link][taken[link]])
                    taken[link] += 1
            plan.append(Exchange(tuple(pending_sends), tuple(recvs), tuple(needs)))
            pending_sends = [m for part in (item.parts if item is not None else ()) for m in schedule.sends_of(part)]
        plans.append(plan)
    return plans
