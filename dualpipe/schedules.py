"""Schedule generators: 1F1B, interleaved 1F1B (Megatron's virtual pipeline stages), ZB1P (ZB-H1),
ZB-V, DualPipe and DualPipeV as ``Schedule`` IR.

``build(name, num_ranks, num_microbatches, vpp=1)`` is the one entry point (``vpp``, the model chunks
per rank, only for ``interleaved1f1b``). DualPipe and DualPipeV
follow the eight-phase structure of deepseek-ai/DualPipe (warm-up forwards, zero-bubble
I/W pairs, the overlapped F&B main loop, zero-bubble cool-down), so the runtime executing this
IR performs the same computation in the same order as upstream. ZB-V is produced by a greedy
list scheduler over the V-shaped placement under the 1F1B activation-memory limit.
"""

from __future__ import annotations

import functools
from collections import deque

from dualpipe.ir import Action, Chain, Item, Layout, Overlap, Schedule

SCHEDULES = ("1f1b", "interleaved1f1b", "zb1p", "zbv", "dualpipe", "dualpipev")


# -- layouts --------------------------------------------------------------------------------
def linear_layout(num_ranks: int, num_microbatches: int) -> Layout:
    """One stage per rank, stage ``r`` on rank ``r`` (1F1B, ZB1P)."""
    return Layout(num_ranks, tuple(range(num_ranks)), (Chain(tuple(range(num_ranks)), tuple(range(num_microbatches))),))


def interleaved_layout(num_ranks: int, num_microbatches: int, vpp: int) -> Layout:
    """``PP x vpp`` stages in one chain, stage ``s`` on rank ``s % PP``: rank ``r`` holds model chunks
    ``r, r + PP, r + 2 PP, ...`` (Megatron-Core's virtual pipeline placement)."""
    n = num_ranks * vpp
    chain = Chain(tuple(range(n)), tuple(range(num_microbatches)))
    return Layout(num_ranks, tuple(s % num_ranks for s in range(n)), (chain,))


def v_layout(num_ranks: int, num_microbatches: int) -> Layout:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2*PP-1-r`` (DualPipeV, ZB-V)."""
    n = 2 * num_ranks
    stage_rank = tuple(s if s < num_ranks else n - 1 - s for s in range(n))
    return Layout(num_ranks, stage_rank, (Chain(tuple(range(n)), tuple(range(num_microbatches))),))


def dualpipe_layout(num_ranks: int, num_microbatches: int) -> Layout:
    """Two mirrored chains: stage ``s < PP`` on rank ``s`` carries micro-batches ``0..N/2-1``;
    stage ``PP + j`` (model part ``j``) on rank ``PP-1-j`` carries ``N/2..N-1``."""
    p, half = num_ranks, num_microbatches // 2
    stage_rank = tuple(range(p)) + tuple(p - 1 - j for j in range(p))
    chains = (Chain(tuple(range(p)), tuple(range(half))), Chain(tuple(range(p, 2 * p)), tuple(range(half, 2 * half))))
    return Layout(p, stage_rank, chains)


_LAYOUTS = {"1f1b": linear_layout, "zb1p": linear_layout, "zbv": v_layout, "dualpipe": dualpipe_layout,
            "dualpipev": v_layout}


@functools.lru_cache(maxsize=256)
def layout(name: str, num_ranks: int, vpp: int = 1) -> Layout:
    """Where ``name`` puts its stages over ``num_ranks`` ranks and which model part each runs: the facts a
    trainer builds its stages from (the chains carry no micro-batches here; ``build(...).layout`` has them)."""
    check_vpp(name, vpp)
    if name == "interleaved1f1b":
        return interleaved_layout(num_ranks, 0, vpp)
    return _LAYOUTS[name](num_ranks, 0)


def min_microbatches(name: str, num_ranks: int) -> int:
    """The fewest micro-batches ``name`` schedules over ``num_ranks`` ranks (DualPipe README rules; Megatron-Core's
    for interleaved 1F1B: at least one group of ``PP``)."""
    if name in ("dualpipe", "dualpipev"):
        return 2 * num_ranks
    return num_ranks if name == "interleaved1f1b" else 1


# -- checks ---------------------------------------------------------------------------------
def check_vpp(name: str, vpp: int) -> None:
    """ValueError unless ``vpp`` (model chunks per rank) suits ``name``: >= 2 for interleaved 1F1B, else 1."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
        raise ValueError(f"vpp (model chunks per rank) must be a positive int, got {vpp!r}")
    if name == "interleaved1f1b" and vpp < 2:
        raise ValueError(f"interleaved1f1b needs vpp >= 2 model chunks per rank, got {vpp} (vpp 1 is plain 1f1b)")
    if name != "interleaved1f1b" and vpp != 1:
        raise ValueError(f"vpp={vpp} needs schedule interleaved1f1b; {name} holds a fixed number of stages per rank")


def check_sizes(name: str, num_ranks: int, num_microbatches: int, vpp: int = 1) -> None:
    """ValueError unless ``name`` can schedule ``num_microbatches`` over ``num_ranks`` (with ``vpp`` chunks each)."""
    check_vpp(name, vpp)
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_chunks (micro-batches) must be a positive int, got {num_microbatches!r}")
    least = min_microbatches(name, num_ranks)
    if name == "dualpipe":
        if num_ranks % 2:
            raise ValueError(f"DualPipe needs an even number of ranks, got {num_ranks}")
        if num_microbatches % 2 or num_microbatches < least:
            raise ValueError(f"DualPipe needs num_chunks even and >= 2 x ranks = {least}, got {num_microbatches}")
    if name == "dualpipev" and num_microbatches < least:
        raise ValueError(f"DualPipeV needs num_chunks >= 2 x ranks = {least}, got {num_microbatches}")
    if name == "interleaved1f1b" and num_microbatches % num_ranks:
        raise ValueError(f"interleaved1f1b runs micro-batches in groups of ranks ({num_ranks}): num_chunks must be a "
                         f"multiple of {num_ranks}, got {num_microbatches}")


def build(name: str, num_ranks: int, num_microbatches: int, vpp: int = 1) -> Schedule:
    """The ``name`` schedule (one of ``SCHEDULES``) for ``num_ranks`` ranks and ``num_microbatches``; ``vpp`` model
    chunks per rank for ``interleaved1f1b``."""
    check_sizes(name, num_ranks, num_microbatches, vpp)
    if name == "interleaved1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, vpp)
    return _BUILDERS[name](num_ranks, num_microbatches)


@functools.lru_cache(maxsize=256)
def built(name: str, num_ranks: int, num_microbatches: int, vpp: int = 1) -> Schedule:
    """``build``, memoised (a Schedule is immutable): planners and memory estimates ask for the same ones often."""
    return build(name, num_ranks, num_microbatches, vpp)


# -- 1F1B and ZB-H1 -------------------------------------------------------------------------
def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Classic 1F1B: ``PP-1-r`` warm-up forwards, then alternate F and full B, then drain."""
    actions = []
    for r in range(num_ranks):
        warm = min(num_ranks - 1 - r, num_microbatches)
        items: list[Item] = [Action("F", r, m) for m in range(warm)]
        for i in range(num_microbatches - warm):
            items += [Action("F", r, warm + i), Action("B", r, i)]
        items += [Action("B", r, m) for m in range(num_microbatches - warm, num_microbatches)]
        actions.append(tuple(items))
    return Schedule("1f1b", linear_layout(num_ranks, num_microbatches), tuple(actions))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, vpp: int) -> Schedule:
    """Megatron-Core's interleaved 1F1B over ``vpp`` model chunks per rank (``interleaved_layout``).

    A rank walks its ``N x vpp`` (micro-batch, chunk) forwards in groups of ``PP`` micro-batches: chunk 0 of
    micro-batches ``0..PP-1``, chunk 1 of the same, ..., then the next group. Its backwards follow the same table
    with the chunks reversed. Rank ``r`` runs ``2 (PP - r - 1) + (vpp - 1) PP`` forwards as warm-up, then one
    forward and one backward in turn, then the remaining backwards. The bubble is ``1/vpp`` of 1F1B's,
    ``(PP-1)(F+B)/vpp``, at ``vpp`` times the point-to-point messages.
    """
    p = num_ranks
    table = [(mb, chunk) for g in range(0, num_microbatches, p) for chunk in range(vpp)
             for mb in range(g, min(g + p, num_microbatches))]
    total = len(table)
    actions = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (vpp - 1) * p, total)
        fwd = [Action("F", chunk * p + r, mb) for mb, chunk in table]
        bwd = [Action("B", (vpp - 1 - chunk) * p + r, mb) for mb, chunk in table]
        items: list[Item] = fwd[:warm]
        for k in range(total - warm):
            items += [fwd[warm + k], bwd[k]]
        items += bwd[total - warm:]
        actions.append(tuple(items))
    return Schedule("interleaved1f1b", interleaved_layout(p, num_microbatches, vpp), tuple(actions))


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into I and W. Rank ``r`` runs 1F1B's ``PP-1-r`` warm-up
    forwards, then F, I and the W of ``r`` micro-batches earlier; the ``r`` held-back W passes fill
    the cool-down, where 1F1B idles. Every rank keeps at most ``PP`` activations alive (1F1B's peak)
    and the bubble is ``(PP-1)(F+B-2W)``."""
    actions = []
    for r in range(num_ranks):
        warm = min(num_ranks - 1 - r, num_microbatches)
        items: list[Item] = [Action("F", r, m) for m in range(warm)]
        held: deque[int] = deque()
        for m in range(num_microbatches):
            if m + warm < num_microbatches:
                items.append(Action("F", r, m + warm))
            items.append(Action("I", r, m))
            held.append(m)
            if len(held) > r:
                items.append(Action("W", r, held.popleft()))
        items += [Action("W", r, m) for m in held]
        actions.append(tuple(items))
    return Schedule("zb1p", linear_layout(num_ranks, num_microbatches), tuple(actions))


# -- ZB-V (greedy over the V placement) -----------------------------------------------------
def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V style: V placement (two half-size stages per rank) with I/W split, under the same
    activation memory as 1F1B (``2*PP`` half-stage activations per rank)."""
    layout = v_layout(num_ranks, num_microbatches)
    return _greedy("zbv", layout, num_microbatches, [2 * num_ranks] * num_ranks)


def _greedy(name: str, layout: Layout, mbs: int, limit: list[int]) -> Schedule:
    """List-schedule F, I and W passes with unit costs: an idle rank runs a ready I (the critical
    path; deeper stage first), else a ready F while fewer than ``limit[rank]`` activations are
    alive (an activation lives from F to W), else its oldest pending W."""
    n_stages, ranks = layout.num_stages, layout.num_ranks
    f_done: dict[tuple[int, int], int] = {}  # (stage, mb) -> finish time
    i_done: dict[tuple[int, int], int] = {}
    next_f = [0] * n_stages
    next_i = [0] * n_stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
    live = [0] * ranks
    actions: list[list[Item]] = [[] for _ in range(ranks)]
    remaining = 3 * n_stages * mbs
    t = 0

    def ready(done: dict[tuple[int, int], int], key: tuple[int, int]) -> bool:
        return done.get(key, t + 1) <= t

    while remaining:
        for r in range(ranks):
            mine = sorted(layout.stages_of(r), key=lambda s: layout.chain_of(s).stages.index(s), reverse=True)
            choice = None
            for s in mine:
                m, nxt = next_i[s], layout.next_stage(s)
                if m < mbs and ready(f_done, (s, m)) and (nxt is None or ready(i_done, (nxt, m))):
                    choice = Action("I", s, m)
                    break
            if choice is None and live[r] < limit[r]:
                for s in mine:
                    m, prv = next_f[s], layout.prev_stage(s)
                    if m < mbs and (prv is None or ready(f_done, (prv, m))):
                        choice = Action("F", s, m)
                        break
            if choice is None and pending_w[r]:
                s, m = pending_w[r].popleft()
                choice = Action("W", s, m)
            if choice is None:
                continue
            actions[r].append(choice)
            remaining -= 1
            key = (choice.stage, choice.mb)
            if choice.kind == "F":
                f_done[key] = t + 1
                next_f[choice.stage] += 1
                live[r] += 1
            elif choice.kind == "I":
                i_done[key] = t + 1
                next_i[choice.stage] += 1
                pending_w[r].append(key)
            else:
                live[r] -= 1
        t += 1
    return Schedule(name, layout, tuple(tuple(a) for a in actions))


# -- DualPipe and DualPipeV -----------------------------------------------------------------
class _PhaseEmitter:
    """Emits actions for one rank's two phases, numbering micro-batches and W passes as upstream.

    ``stage[p]`` and ``mbs[p]`` give phase ``p``'s stage and micro-batch order; W passes run the
    oldest I (upstream's FIFO weight-grad queue).
    """

    def __init__(self, stages: tuple[int, int], mbs: tuple[list[int], list[int]]):
        self.stages, self.mbs = stages, mbs
        self.f = [0, 0]
        self.b = [0, 0]
        self.w_queue: deque[Action] = deque()
        self.items: list[Item] = []

    def _fwd(self, p: int) -> Action:
        a = Action("F", self.stages[p], self.mbs[p][self.f[p]])
        self.f[p] += 1
        return a

    def _bwd(self, p: int, zb: bool) -> Action:
        a = Action("I" if zb else "B", self.stages[p], self.mbs[p][self.b[p]])
        self.b[p] += 1
        if zb:
            self.w_queue.append(Action("W", a.stage, a.mb))
        return a

    def forward(self, p: int) -> None:
        self.items.append(self._fwd(p))

    def backward(self, p: int, zb: bool = False) -> None:
        self.items.append(self._bwd(p, zb))

    def weight(self) -> None:
        self.items.append(self.w_queue.popleft())

    def overlap(self, pf: int, pb: int) -> None:
        f = self._fwd(pf)
        self.items.append(Overlap(f, self._bwd(pb, False)))


def _dual_rank_items(em: _PhaseEmitter, half_ranks: int, h: int, num_chunks: int, middle: bool) -> tuple[Item, ...]:
    """The eight phases of upstream DualPipe(V) for a rank at (half-)position ``h``.

    ``num_chunks`` is the per-phase micro-batch count; ``middle`` marks the rank where the two
    phases meet (the last rank of DualPipeV, the two central ranks of DualPipe), whose first
    main-loop F and B run separately.
    """
    for _ in range((half_ranks - h - 1) * 2):  # 1: forwards of phase 0 fill the pipe
        em.forward(0)
    for _ in range(h + 1):  # 2: alternate phase 0 and phase 1 forwards
        em.forward(0)
        em.forward(1)
    for _ in range(half_ranks - h - 1):  # 3: zero-bubble I/W of phase 1 between forwards
        em.backward(1, zb=True)
        em.weight()
        em.forward(1)
    for i in range(num_chunks - 2 * half_ranks + h + 1):  # 4: main loop of overlapped F&B
        if i == 0 and middle:
            em.forward(0)
            em.backward(1)
        else:
            em.overlap(0, 1)
        em.overlap(1, 0)
    for _ in range(half_ranks - h - 1):  # 5
        em.backward(1)
        em.overlap(1, 0)
    zb = False
    for i in range(h + 1):  # 6: drain backwards; the second half use zero bubble
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        em.backward(1, zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        em.backward(0, zb)
    for _ in range(half_ranks - h - 1):  # 7
        em.weight()
        em.backward(0, zb=True)
    for _ in range(h + 1):  # 8
        em.weight()
    assert not em.w_queue
    return tuple(em.items)


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: the V-shaped "cut-in-half" DualPipe; all micro-batches enter and leave at rank 0."""
    layout = v_layout(num_ranks, num_microbatches)
    order = list(range(num_microbatches))
    actions = []
    for r in range(num_ranks):
        em = _PhaseEmitter((r, 2 * num_ranks - 1 - r), (order, order))
        actions.append(_dual_rank_items(em, num_ranks, r, num_microbatches, middle=(r == num_ranks - 1)))
    return Schedule("dualpipev", layout, tuple(actions))


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe: two mirrored pipelines fed from both ends (micro-batches ``0..N/2-1`` enter at
    rank 0, ``N/2..N-1`` at rank PP-1). Ranks in the second half start with the reverse direction."""
    p, half = num_ranks, num_microbatches // 2
    layout = dualpipe_layout(num_ranks, num_microbatches)
    down, up = list(range(half)), list(range(half, 2 * half))
    actions = []
    for r in range(p):
        h = min(r, p - 1 - r)
        stage_down, stage_up = r, p + (p - 1 - r)
        second_half = r >= p // 2
        stages = (stage_up, stage_down) if second_half else (stage_down, stage_up)
        mbs = (up, down) if second_half else (down, up)
        em = _PhaseEmitter(stages, mbs)
        actions.append(_dual_rank_items(em, p // 2, h, half, middle=(h == p // 2 - 1)))
    return Schedule("dualpipe", layout, tuple(actions))


_BUILDERS = {"1f1b": one_f_one_b, "zb1p": zb1p, "zbv": zbv, "dualpipe": dualpipe, "dualpipev": dualpipev}
