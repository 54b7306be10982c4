"""Timelines of a simulated schedule: Chrome/Perfetto trace JSON and a PNG (one row per rank)."""

from __future__ import annotations

import json
from pathlib import Path

from dualpipe.ir import Overlap
from dualpipe.simulator import SimResult

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868", "FB": "#8172B3"}


def _kind(item) -> str:
    return "FB" if isinstance(item, Overlap) else item.kind


def chrome_trace(result: SimResult, time_unit_us: float = 1000.0) -> dict:
    """Trace-event JSON (open in chrome://tracing or ui.perfetto.dev); one thread per rank.
    Durations are in the costs' unit times ``time_unit_us`` microseconds."""
    events = []
    for rank, row in enumerate(result.timeline):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for iv in row:
            events.append({"name": str(iv.item), "cat": _kind(iv.item), "ph": "X", "pid": 0, "tid": rank,
                           "ts": iv.start * time_unit_us, "dur": (iv.end - iv.start) * time_unit_us})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": result.schedule.name, "ranks": result.schedule.num_ranks}}


def write_trace(result: SimResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))


def write_png(result: SimResult, path: str | Path, title: str | None = None) -> None:
    """Gantt chart: one row per rank, one box per action, coloured by kind (F, B, I, W, F&B)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = result.schedule.num_ranks
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.25), 0.5 * ranks + 1.2))
    for rank, row in enumerate(result.timeline):
        for iv in row:
            kind = _kind(iv.item)
            ax.broken_barh([(iv.start, iv.end - iv.start)], (rank - 0.4, 0.8), facecolors=COLOURS[kind],
                           edgecolor="black", linewidth=0.4)
            label = str(iv.item) if kind != "FB" else f"{iv.item.forward}|{iv.item.backward}"
            ax.text((iv.start + iv.end) / 2, rank, label, ha="center", va="center", fontsize=5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (cost units)")
    ax.set_title(title or f"{result.schedule.name}: makespan {result.makespan:.3g}")
    ax.legend(handles=[Patch(color=c, label=k.replace("FB", "F&B")) for k, c in COLOURS.items()],
              loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # exactly `path`, even without a .png suffix
    plt.close(fig)
