"""Shared output for benchmark recipes: a side-by-side terminal table, a JSON dump, the run's context."""

from __future__ import annotations

import datetime
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import accel


def context() -> dict[str, Any]:
    """Where the numbers come from: date, backend, device, versions (goes at the top of every report)."""
    ctx = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": accel.backend(),
        "device": accel.device_name(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton_interpreted": accel.triton_interpreted(),
    }
    try:
        import triton

        ctx["triton"] = triton.__version__
    except ImportError:
        ctx["triton"] = None
    return ctx


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an aligned text table; floats get 4 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def print_report(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 json_path: str | Path | None = None, notes: Sequence[str] = ()) -> None:
    """Print the context, the table and the notes; write them all as JSON when ``json_path`` is given."""
    ctx = context()
    print(f"== {title} ==")
    print(", ".join(f"{k}={v}" for k, v in ctx.items()))
    if ctx["backend"] == "cpu":
        print("note: cpu run - kernel timings here (and anything under the Triton interpreter) say nothing about a GPU")
    print(format_table(rows, columns))
    for n in notes:
        print(f"note: {n}")
    if json_path:
        Path(json_path).write_text(json.dumps({"title": title, "context": ctx, "rows": list(rows),
                                               "notes": list(notes)}, indent=2, default=str))
