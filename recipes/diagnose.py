"""Which rank hung, in which operation, and who waits on it: read the flight-recorder dumps of a run.

    python -m recipes.diagnose RUN_DIR           # one paragraph: the rank that stopped first, its waiters
    python -m recipes.diagnose RUN_DIR --json    # the same as JSON, with every rank's state

Every rank of ``recipes.train`` keeps its last pipeline actions and collectives (``accel.flight``) and
writes them to ``RUN_DIR/flight/rank_<r>.json`` when an operation times out, on SIGUSR1, or when nothing
has completed for ``run.watchdog_s`` seconds. Each rank's current operation is the one a thread blocks on
(else its running action, else none), and it waits on:

- a receive from rank p: on p, unless p's recorder shows the message sent (then the receiver itself is stuck);
- a send in its final wait: on the receiver;
- a collective (the n-th of its group on this rank, of which it has posted k parts): on every member that
  has not posted as many parts of the n-th collective of that group (or left no dump). A rank that has
  begun a collective and posted nothing of it is stuck on itself.

Following "waits on" from any waiting rank ends at ranks that wait on no one (in compute, outside any
recorded operation, stuck before posting, or without a dump): the one among them that stopped earliest
is named as the rank that stopped first. Exit status 0 with a diagnosis, 2 (one line) when RUN_DIR
holds no dumps or a damaged one (not JSON, a field missing or of the wrong type: the file and field are named).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from accel.cli import BAD_INPUT, OK, ArgumentParser

COLLECTIVES = ("all_to_all", "all_reduce", "barrier")
SAME_JOB_S = 120.0  # recorders created this close to the newest one's belong to the same job
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP = re.compile(r"^\((\d+)F(\d+);(\d+)[BI](\d+)\)OVERLAP_F_B$")


def load_dumps(run_dir: str | Path) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The newest job's dumps by rank, and notes on dumps ignored (an earlier job's, in the same folder)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"RUN_DIR {str(run_dir)!r} is not a folder; expected a run folder of recipes.train")
    files = sorted((root / "flight").glob("rank_*.json"))
    if not files:
        raise ValueError(f"RUN_DIR {str(run_dir)!r} holds no flight-recorder dumps (flight/rank_<r>.json): no rank "
                         "has timed out, stalled for run.watchdog_s or received SIGUSR1 in this run")
    dumps: dict[int, dict[str, Any]] = {}
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{f}: not a flight-recorder dump ({exc})") from None
        problem = dump_problem(d)
        if problem:
            raise ValueError(f"{f}: not a flight-recorder dump ({problem}); a damaged dump cannot be diagnosed")
        dumps[d["rank"]] = d
    newest = max(d["created"] for d in dumps.values())
    notes = [f"ignored {f.name}: an earlier job's dump" for r, d in sorted(dumps.items())
             for f in [root / "flight" / f"rank_{r}.json"] if newest - d["created"] > SAME_JOB_S]
    return {r: d for r, d in dumps.items() if newest - d["created"] <= SAME_JOB_S}, notes


_INT, _NUM, _STR, _NONE = (int,), (int, float), (str,), (type(None),)
# what the diagnosis reads of a dump (``accel.flight.FlightRecorder.snapshot``), with the types it relies on
DUMP_FIELDS = {"rank": _INT, "created": _NUM, "time": _NUM, "last_progress": _NUM, "entries": (list,),
               "world_size": _INT + _NONE, "step": _INT + _NONE}
ENTRY_FIELDS = {"seq": _INT + _NONE, "kind": _STR, "name": _STR, "step": _INT + _NONE, "mb": _INT + _NONE,
                "context": _STR + _NONE, "peer": _INT + _NONE, "group": _STR + _NONE, "ranks": (list,) + _NONE,
                "coll_seq": _INT + _NONE, "layer": _INT + _NONE, "start": _NUM, "parts": _INT,
                "wait": _NUM + _NONE, "end": _NUM + _NONE}


def _type_problem(table: dict[str, Any], fields: dict[str, tuple[type, ...]], where: str) -> str:
    for key, kinds in fields.items():
        if key not in table:
            return f"{where}missing '{key}'"
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            expected = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            return f"{where}'{key}' is {value!r}, expected {expected}"
    return ""


def dump_problem(d: object) -> str:
    """What is wrong with a parsed dump (a missing field, a wrong type), or "" when the diagnosis can read it."""
    if not isinstance(d, dict):
        return f"expected a JSON object, got {type(d).__name__}"
    problem = _type_problem(d, DUMP_FIELDS, "")
    if problem or d["rank"] < 0 or (d["world_size"] is not None and d["world_size"] <= d["rank"]):
        return problem or f"'rank' {d['rank']} is not in [0, world_size={d['world_size']})"
    for i, e in enumerate(d["entries"]):
        if not isinstance(e, dict):
            return f"entries[{i}] is {e!r}, expected an object"
        problem = _type_problem(e, ENTRY_FIELDS, f"entries[{i}]: ")
        if problem:
            return problem
    return ""


def _group_key(e: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    return e["group"], tuple(e["ranks"] or ())


def _current(d: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """This rank's current operation and what it is doing: waiting, compute or idle."""
    in_flight = [e for e in d["entries"] if e["end"] is None]
    blocked = [e for e in in_flight if e["wait"] is not None]
    if blocked:
        op = max(blocked, key=lambda e: (e["wait"], e["seq"]))
        if op["kind"] in COLLECTIVES and op["coll_seq"] is None:  # queued behind the comm thread's exchange
            issued = [e for e in in_flight if e["kind"] in COLLECTIVES and e["coll_seq"] is not None
                      and _group_key(e) == _group_key(op)]
            if issued:
                op = min(issued, key=lambda e: e["coll_seq"])
        return op, "waiting"
    actions = [e for e in in_flight if e["kind"] == "action"]
    if actions:
        return max(actions, key=lambda e: e["seq"]), "compute"
    return None, "idle"


def _joined(d: dict[str, Any] | None, key: tuple[str, tuple[int, ...]], seq: int, parts: int) -> bool:
    """Whether a member (its dump ``d``) has posted ``parts`` parts of the ``seq``-th collective of group ``key``."""
    if d is None:
        return False
    for e in d["entries"]:
        if e["kind"] in COLLECTIVES and e["coll_seq"] is not None and _group_key(e) == key:
            if e["coll_seq"] > seq or (e["coll_seq"] == seq and (e["parts"] >= parts or e["end"] is not None)):
                return True
    return False


def _sent(d: dict[str, Any] | None, to: int, op: dict[str, Any]) -> bool:
    """Whether the peer (its dump ``d``) has posted the message ``op`` receives."""
    return d is not None and any(e["kind"] == "send" and e["peer"] == to and e["name"] == op["name"]
                                 and e["step"] == op["step"] for e in d["entries"])


def _received(d: dict[str, Any] | None, frm: int, op: dict[str, Any]) -> bool:
    return d is not None and any(e["kind"] == "recv" and e["peer"] == frm and e["name"] == op["name"]
                                 and e["step"] == op["step"] and e["end"] is not None for e in d["entries"])


def rank_state(rank: int, dumps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One rank's state: its current operation, whom it waits on and why."""
    d = dumps.get(rank)
    if d is None:
        return {"rank": rank, "state": "missing", "op": None, "waits_on": [], "note": "no dump", "since": None,
                "age_s": None, "step": None, "dump_reason": None, "dump_time": None, "host": None, "pid": None}
    op, state = _current(d)
    waits_on: list[int] = []
    note = ""
    if state == "waiting":
        kind = op["kind"]
        if kind == "recv":
            if _sent(dumps.get(op["peer"]), rank, op):
                state, note = "stuck", f"the message was already sent by rank {op['peer']}"
            else:
                waits_on = [op["peer"]]
        elif kind == "send":
            if not _received(dumps.get(op["peer"]), rank, op):
                waits_on = [op["peer"]]
        elif op["coll_seq"] is not None:
            if op["parts"] == 0:
                state, note = "stuck", "begun but nothing of it posted: stuck on this rank"
            else:
                key = _group_key(op)
                waits_on = [m for m in key[1] if m != rank
                            and not _joined(dumps.get(m), key, op["coll_seq"], op["parts"])]
                if not waits_on:
                    note = "every member has posted it: the transport did not deliver"
        else:
            state, note = "stuck", "queued behind no issued collective"
    since = None
    if op is not None:
        since = op["wait"] if state == "waiting" and op["wait"] is not None else op["start"]
    elif state == "idle":
        since = d["last_progress"]
    return {"rank": rank, "state": state, "op": op, "waits_on": waits_on, "note": note, "since": since,
            "age_s": d["time"] - since if since is not None else None, "step": d.get("step"),
            "dump_reason": d.get("reason"), "dump_time": d.get("time"), "host": d.get("host"), "pid": d.get("pid")}


def diagnose(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> dict[str, Any]:
    """The rank that stopped first, the ranks waiting on it (directly and behind them), and every rank's state."""
    world = world_size or max([d.get("world_size", 1) for d in dumps.values()] + [max(dumps) + 1])
    states = {r: rank_state(r, dumps) for r in range(world)}
    waiting = [r for r, s in states.items() if s["waits_on"]]
    # ranks reachable from the waiting ones by "waits on"
    reach: set[int] = set()
    todo = [m for r in waiting for m in states[r]["waits_on"]]
    while todo:
        r = todo.pop()
        if r not in reach:
            reach.add(r)
            todo += states[r]["waits_on"]
    roots = [r for r in sorted(reach) if not states[r]["waits_on"]]
    if not roots:  # a cycle of waits, or nobody waits: who stopped earliest
        roots = sorted(reach) or [r for r, s in states.items() if s["state"] != "idle"] or list(states)
    culprit = min(roots, key=lambda r: (states[r]["state"] != "missing",
                                        states[r]["since"] if states[r]["since"] is not None else float("inf"), r))
    direct = [r for r in waiting if culprit in states[r]["waits_on"]]
    behind: set[int] = set()
    todo = list(direct)
    while todo:
        r = todo.pop()
        for w in waiting:
            if r in states[w]["waits_on"] and w not in behind and w not in direct and w != culprit:
                behind.add(w)
                todo.append(w)
    return {"world_size": world, "culprit": culprit, "waiting_on_culprit": direct, "waiting_behind": sorted(behind),
            "other_stopped": [r for r in roots if r != culprit], "ranks": [states[r] for r in range(world)]}


def _where(op: dict[str, Any]) -> str:
    """Micro-batch, action and step of an operation, as the runtime names them."""
    parts = []
    action = op["name"] if op["kind"] == "action" else op.get("context")
    if action:
        m, o = _ACTION.match(action), _OVERLAP.match(action)
        if m:
            parts.append(f"micro-batch {m.group(3)}")
        elif o:
            parts.append(f"micro-batches {o.group(2)} (forward) and {o.group(4)} (backward)")
        if op["kind"] != "action":
            parts.append(f"action {action}")
    elif op.get("mb") is not None:
        parts.append(f"micro-batch {op['mb']}")
    if op.get("step") is not None:
        parts.append(f"step {op['step']}")
    return ", ".join(parts)


def describe(op: dict[str, Any]) -> str:
    kind, name = op["kind"], op["name"]
    if kind == "action":
        return f"action {name}"
    if kind == "all_to_all":
        layer = f" of layer {op['layer']}" if op.get("layer") is not None else ""
        return f"all-to-all {name!r}{layer} (group {op['group']} {op['ranks']})"
    if kind == "recv":
        return f"recv {name!r} from rank {op['peer']}"
    if kind == "send":
        return f"send {name!r} to rank {op['peer']}"
    return f"{kind.replace('_', '-')} {name!r} (group {op['group']} {op['ranks']})"


def _short(s: dict[str, Any]) -> str:
    op = s["op"]
    if op is None:
        return {"missing": "no dump", "idle": "outside any recorded operation"}[s["state"]]
    text = describe(op)
    where = _where(op)
    return f"{text}, {where}" if where else text


def format_diagnosis(diag: dict[str, Any]) -> str:
    states = {s["rank"]: s for s in diag["ranks"]}
    c = states[diag["culprit"]]
    age = f"{c['age_s']:.1f} s before its dump" if c.get("age_s") is not None else ""
    if c["state"] == "missing":
        head = "left no dump (dead, or hung where its recorder could not write)"
    elif c["state"] == "idle":
        head = f"outside any recorded operation (last one completed {age})"
    elif c["state"] == "compute":
        head = f"in {_short(c)}, running for {age} (not waiting on any rank)"
    else:
        note = f" ({c['note']})" if c["note"] else ""
        head = f"in-flight {_short(c)}{note}, started {age}"
    lines = [f"rank {c['rank']} stopped first: {head}"]

    def waiters(ranks: list[int]) -> str:
        return ", ".join(f"rank {r} ({_short(states[r])})" for r in ranks)

    lines.append(f"waiting on rank {c['rank']}: {waiters(diag['waiting_on_culprit']) or 'no rank'}")
    if diag["waiting_behind"]:
        lines.append(f"waiting behind them: {waiters(diag['waiting_behind'])}")
    for r in diag["other_stopped"]:
        lines.append(f"also waited on: rank {r} ({states[r]['state']}: {_short(states[r])})")
    lines.append("ranks:")
    for s in diag["ranks"]:
        waits = f" -> waits on {', '.join(map(str, s['waits_on']))}" if s["waits_on"] else ""
        dump = f"; dump: {s['dump_reason']}" if s.get("dump_reason") else ""
        lines.append(f"  rank {s['rank']}: {s['state']}: {_short(s)}{waits}{dump}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.diagnose", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run folder of recipes.train (holding flight/rank_<r>.json)")
    ap.add_argument("--json", action="store_true", help="print the diagnosis as JSON (default: text)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        dumps, notes = load_dumps(ns.run_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    diag = diagnose(dumps)
    diag["notes"] = notes
    if ns.json:
        print(json.dumps(diag, indent=1))
    else:
        print(format_diagnosis(diag))
        for n in notes:
            print(n)
    return OK


if __name__ == "__main__":
    sys.exit(main())
