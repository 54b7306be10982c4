"""The shortest an overlapped F&B chunk can be, given its steps: two chains on one compute unit and one serial wire.

    python benchmarks/chunk_bound.py --forward 7.3 2.9 8.2 3.7 4.5 --backward 0.6 5.6 7.7 5.1 12.1 \
        [--exchange MS | --comm-ratio 1.0] [--count-ms 0.1] [--w-share 0.45]

A chunk interleaves a forward (compute step, exchange, compute step, ...: attention + router, dispatch,
experts, combine, ...) with a backward (the same, reversed). Each side waits for its own exchange before
its next step; the compute unit runs one step at a time; the wire carries one exchange at a time
(``recipes/bench_a2a_delay.py``'s model), first come, first served: an exchange is posted when the step
before it ends. This tries every order of the compute steps (both sides' own orders kept) and prints the
best makespan against
max(compute, comm), next to the strict alternation backward-first that ``models.deepseek_v3.plan.overlapped``
runs. The forward's dispatch exchanges (its 1st, 3rd, ...) also carry the count exchange ahead of them
(``--count-ms``). Step times come from a run without delay (the interleave's steps, e.g. timed with a
wrapper around it); ``--comm-ratio`` sizes the token exchanges so the chunk's comm is that multiple of its
compute. ``--w-share`` also gives the bound when that share of each backward step is weight gradient free
to run whenever the compute unit would idle, carried into the next chunk if need be (V3 places W so). Pure
Python; a few seconds for 9 + 9 steps (48,620 orders).
"""

from __future__ import annotations

import argparse
import itertools
import sys


def makespan(order: list[str], compute: dict[str, list[float]], exchanges: dict[str, list[float]]) -> float:
    """Run the compute steps in ``order``; each step but a side's last posts that side's next exchange,
    which the wire carries first come, first served (the comm thread's order)."""
    return _schedule(order, compute, exchanges)[0]


def _schedule(order: list[str], compute: dict[str, list[float]],
              exchanges: dict[str, list[float]]) -> tuple[float, float]:
    """(makespan, compute-unit idle time before the last step) of ``makespan``'s schedule."""
    t_compute = t_wire = idle = 0.0
    step = {"F": 0, "B": 0}
    landed = {"F": 0.0, "B": 0.0}  # when the side's last posted exchange lands
    for side in order:
        k = step[side]
        start = max(t_compute, landed[side] if k else 0.0)
        idle += start - t_compute
        t_compute = start + compute[side][k]
        if k < len(exchanges[side]):
            t_wire = max(t_wire, t_compute) + exchanges[side][k]
            landed[side] = t_wire
        step[side] += 1
    return max(t_compute, t_wire), idle


def with_floating_weight_grads(order: list[str], compute: dict[str, list[float]],
                               exchanges: dict[str, list[float]], w_share: float) -> float:
    """The chunk when ``w_share`` of every backward step after the first is weight gradient that may run
    whenever the compute unit would idle, in this chunk or the next (V3's W placement, steady state): the
    chains hold the input-gradient parts only, and the W work that finds no idle time lengthens the chunk."""
    b = compute["B"]
    chains = {"F": compute["F"], "B": [b[0]] + [x * (1.0 - w_share) for x in b[1:]]}
    span, idle = _schedule(order, chains, exchanges)
    return span + max(0.0, w_share * sum(b[1:]) - idle)


def merges(a: int, b: int):
    """Every interleaving of ``a`` F's and ``b`` B's."""
    for picks in itertools.combinations(range(a + b), a):
        chosen = set(picks)
        yield ["F" if i in chosen else "B" for i in range(a + b)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forward", type=float, nargs="+", required=True, help="forward compute steps, ms")
    ap.add_argument("--backward", type=float, nargs="+", required=True, help="backward compute steps, ms")
    ap.add_argument("--exchange", type=float, default=None, help="ms per token exchange")
    ap.add_argument("--comm-ratio", type=float, default=1.0, help="chunk comm / compute (without --exchange)")
    ap.add_argument("--count-ms", type=float, default=0.1, help="the count exchange ahead of each dispatch")
    ap.add_argument("--w-share", type=float, default=None,
                    help="also: this share of each backward step after the first is weight gradient, run in idle time")
    ns = ap.parse_args(argv)
    f, b = ns.forward, ns.backward
    if len(f) < 2 or len(b) < 2:
        ap.error("--forward and --backward need at least two steps each (an exchange between them)")
    if ns.w_share is not None and not 0.0 <= ns.w_share < 1.0:
        ap.error("--w-share must be in [0, 1)")
    total = sum(f) + sum(b)
    n = len(f) - 1 + len(b) - 1
    e = ns.exchange if ns.exchange is not None else ns.comm_ratio * total / n
    ex = {"F": [e + (ns.count_ms if k % 2 == 0 else 0.0) for k in range(len(f) - 1)], "B": [e] * (len(b) - 1)}
    compute = {"F": f, "B": b}
    comm = sum(ex["F"]) + sum(ex["B"])
    alternation = makespan(_alternation(len(f), len(b)), compute, ex)
    best = min(makespan(order, compute, ex) for order in merges(len(f), len(b)))
    bound = max(total, comm)
    print(f"compute {total:.1f} ms, comm {comm:.1f} ms ({n} exchanges of {e:.2f} ms)")
    print(f"backward-first alternation: {alternation:.1f} ms = {alternation / bound:.3f} x max(comm, compute)")
    print(f"best of every order:        {best:.1f} ms = {best / bound:.3f} x max(comm, compute)")
    if ns.w_share is not None:
        floating = min(with_floating_weight_grads(order, compute, ex, ns.w_share)
                       for order in merges(len(f), len(b)))
        print(f"with {ns.w_share:.0%} of each backward step as floating W: {floating:.1f} ms = "
              f"{floating / bound:.3f} x max(comm, compute)")
    return 0


def _alternation(nf: int, nb: int) -> list[str]:
    """``plan.overlapped``'s turns: one backward step, one forward step, ..., then the rest of either."""
    out = []
    for i in range(max(nf, nb)):
        if i < nb:
            out.append("B")
        if i < nf:
            out.append("F")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
