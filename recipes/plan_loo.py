"""``python -m recipes.plan_loo --write benchmarks/planner.md``: the planner against every public run, left out in turn.

Loads ``benchmarks/planner_runs/*.toml`` (``planner.runs``), evaluates each run the planner can express, keeps
the time terms and calibrated figures whose removal would not lower the leave-one-out error
(``planner.loo.select``), and writes the table (per run, per GPU family and system, overall; the selection
steps; the runs kept out of the fit and why) between the ``<!-- loo:begin -->`` / ``<!-- loo:end -->`` markers
of ``--write`` (stdout without it), and the residuals ``recipes.plan`` puts its band with into ``--residuals``
(default ``benchmarks/planner_runs/loo.json``).
Deterministic: the same records and code give the same bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accel.cli import BAD_INPUT, ArgumentParser, check_output_file
from planner.loo import evaluate_run, nested, residuals, select, table
from planner.runs import RUNS_DIR, load_runs
from recipes.plan import base_config

BEGIN, END = "<!-- loo:begin -->", "<!-- loo:end -->"
RESIDUALS = RUNS_DIR / "loo.json"


def build(folder: Path) -> tuple[str, dict]:
    """(the markdown table, the residuals document) of the runs in ``folder``."""
    runs = load_runs(folder)
    fit = [r for r in runs if not r.excluded]
    if not fit:
        raise ValueError(f"runs folder {str(folder)!r}: no run the planner can express")
    parts = [evaluate_run(r, base_config(r.preset, list(r.sets))) for r in fit]
    kept, steps = select(parts)
    return table(parts, [r for r in runs if r.excluded], kept, steps, nested(parts)), residuals(parts, kept)


def splice(document: str, section: str, where: str) -> str:
    """``document`` with the text between the markers replaced by ``section``."""
    if document.count(BEGIN) != 1 or document.count(END) != 1 or document.index(BEGIN) > document.index(END):
        raise ValueError(f"--write {where!r}: expected one {BEGIN} line and one {END} line after it")
    head, rest = document.split(BEGIN)
    return f"{head}{BEGIN}\n{section}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.plan_loo", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=RUNS_DIR, help="folder of run records (*.toml)")
    ap.add_argument("--write", default=None, help="markdown file whose loo markers get the table (default: stdout)")
    ap.add_argument("--residuals", default=str(RESIDUALS), help="JSON file for recipes.plan's error band")
    ns = ap.parse_args(argv)
    try:
        if ns.write and not Path(ns.write).is_file():
            raise ValueError(f"--write {ns.write!r}: no such file")
        check_output_file(ns.residuals, "--residuals")
        text, res = build(ns.runs)
        if ns.write:
            path = Path(ns.write)
            path.write_text(splice(path.read_text(), text, ns.write))
            print(f"wrote the leave-one-out table into {ns.write}")
        else:
            print(text)
        Path(ns.residuals).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        print(f"wrote {ns.residuals} (kept terms: {', '.join(res['terms']) or 'none'})")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
