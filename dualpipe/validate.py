"""Prove a schedule runnable: complete, dependency-respecting on each rank, and deadlock-free.

Deadlock freedom is checked with the exchange model of ``ir.comm_plan`` that the runtime follows.
By default sends are buffered (the runtime posts them asynchronously and only receives block);
``check_deadlock_free(s, rendezvous=True)`` also demands that every send be matched while its
sender waits, the strictest semantics a backend may have (of our schedules 1F1B and ZB1P pass it).
"""

from __future__ import annotations

from collections import Counter

from dualpipe.ir import Action, Message, Overlap, Schedule, comm_plan


class ScheduleError(ValueError):
    """The schedule is incomplete, violates a dependency, or deadlocks; the message says where."""


def validate(schedule: Schedule, rendezvous: bool = False) -> None:
    """Raise ScheduleError naming the rank and action at the first problem found."""
    check_complete(schedule)
    check_local_order(schedule)
    check_deadlock_free(schedule, rendezvous=rendezvous)


def check_complete(schedule: Schedule) -> None:
    """Every (stage, micro-batch) of every chain has one F and either one B or one I and one W,
    each on the rank that holds the stage; nothing else appears."""
    lay = schedule.layout
    if len(schedule.actions) != lay.num_ranks:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lines, layout has {lay.num_ranks} ranks")
    seen: Counter[tuple[str, int, int]] = Counter()
    for rank, items in enumerate(schedule.actions):
        for item in items:
            for a in item.parts:
                if not 0 <= a.stage < lay.num_stages or lay.stage_rank[a.stage] != rank:
                    raise ScheduleError(f"rank {rank}: {a} is on a stage this rank does not hold")
                if a.mb not in lay.chain_of(a.stage).microbatches:
                    raise ScheduleError(f"rank {rank}: {a} names micro-batch {a.mb}, not carried by stage {a.stage}")
                seen[(a.kind, a.stage, a.mb)] += 1
    for (kind, stage, mb), n in seen.items():
        if n > 1:
            raise ScheduleError(f"rank {lay.stage_rank[stage]}: {Action(kind, stage, mb)} appears {n} times")
    for chain in lay.chains:
        for stage in chain.stages:
            rank = lay.stage_rank[stage]
            for mb in chain.microbatches:
                f, b, i, w = (seen[(k, stage, mb)] for k in "FBIW")
                if not f:
                    raise ScheduleError(f"rank {rank}: missing {Action('F', stage, mb)}")
                if not (b and not i and not w) and not (i and w and not b):
                    raise ScheduleError(f"rank {rank}: stage {stage} micro-batch {mb} needs one B or one I and one W "
                                        f"(has B={b} I={i} W={w})")


def check_local_order(schedule: Schedule) -> None:
    """On each rank: F before its backward, I before its W, and stages that hand tensors to each
    other on the same rank in chain order. Parts of an overlap must be independent."""
    lay = schedule.layout
    for rank, items in enumerate(schedule.actions):
        done: set[tuple[str, int, int]] = set()
        for item in items:
            if isinstance(item, Overlap) and item.forward.mb == item.backward.mb:
                raise ScheduleError(f"rank {rank}: {item} overlaps two passes of the same micro-batch")
            for a in item.parts:
                for need in _local_needs(schedule, a):
                    if lay.stage_rank[need.stage] == rank and (need.kind, need.stage, need.mb) not in done:
                        if need.kind == "B" and ("I", need.stage, need.mb) in done:
                            continue
                        raise ScheduleError(f"rank {rank}: {a} runs before {need}, which it depends on")
                done.add((a.kind, a.stage, a.mb))


def _local_needs(schedule: Schedule, a: Action) -> list[Action]:
    lay = schedule.layout
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    needs = []
    if a.kind == "F":
        prev = lay.prev_stage(a.stage)
        if prev is not None:
            needs.append(Action("F", prev, a.mb))
    else:
        needs.append(Action("F", a.stage, a.mb))
        nxt = lay.next_stage(a.stage)
        if nxt is not None:
            needs.append(Action("B", nxt, a.mb))  # B or I of the next stage; see check_local_order
    return needs


def check_deadlock_free(schedule: Schedule, rendezvous: bool = False) -> None:
    """Play the exchanges of all ranks against each other; raise if some rank can never proceed.

    With ``rendezvous`` a rank's exchange also waits until each of its sends is received; without,
    only receives wait (buffered sends, as gloo behaves).
    """
    plans = comm_plan(schedule)
    send_at: dict[Message, int] = {}
    recv_at: dict[Message, int] = {}
    for plan in plans:
        for e, ex in enumerate(plan):
            for m in ex.sends:
                send_at[m] = e
            for m in ex.recvs:
                recv_at[m] = e
    pos = [0] * len(plans)

    def blockers(rank: int) -> list[Message]:
        ex = plans[rank][pos[rank]]
        out = [m for m in ex.recvs if pos[m.src] < send_at[m]]
        if rendezvous:
            out += [m for m in ex.sends if m not in recv_at or pos[m.dst] < recv_at[m]]
        return out

    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(plans):
            while pos[rank] < len(plan) and not blockers(rank):
                pos[rank] += 1
                progress = True
    stuck = [r for r, plan in enumerate(plans) if pos[r] < len(plan)]
    if stuck:
        lines = []
        for r in stuck:
            items = schedule.actions[r]
            where = str(items[pos[r]]) if pos[r] < len(items) else "the final send flush"
            lines.append(f"rank {r} before {where} waits on " + ", ".join(str(m) for m in blockers(r)))
        raise ScheduleError("schedule deadlocks: " + "; ".join(lines))
