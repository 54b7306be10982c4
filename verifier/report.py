"""Plain-text tables and the run context that every report (benchmarks, kernel verification) starts with.

It lives in ``accel`` because both the verification harness (``verifier.verify``) and the benchmark
recipes (``recipes.benchutil``) print through it, and ``accel`` may not import ``recipes``.
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Sequence
from typing import Any

import torch

from accel.backend import backend, device_name, triton_interpreted

CPU_TIMING_NOTE = (
    "cpu run - kernel timings here (and anything under the Triton interpreter) say nothing about a GPU"
)


def context() -> dict[str, Any]:
    """Where the numbers come from: date, backend, device, versions (goes at the top of every report)."""
    ctx = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": backend(),
        "device": device_name(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton_interpreted": triton_interpreted(),
    }
    try:
        import triton

        ctx["triton"] = triton.__version__
    except ImportError:
        ctx["triton"] = None
    return ctx


def format_cell(value: Any) -> str:
    """One table cell: floats with 4 significant digits, None as blank."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an aligned text table (columns default to the first row's keys)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    body = [[format_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in body]
    return "\n".join(lines)
