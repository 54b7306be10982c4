"""Run logging: a tqdm progress bar, a JSONL metrics file, wandb, MFU, the end summary and loss plot.

Only the logging rank (global rank 0, which holds the loss under DualPipeV; the trainer
broadcasts it otherwise) creates a ``MetricsLogger``; the others get ``NullLogger``.

wandb runs offline by default, so a machine without a network still records a run that
``wandb sync`` can upload later; ``--wandb online`` syncs live, ``disabled`` turns it off, and an
explicit ``WANDB_MODE`` in the environment wins over the config (not over the command line).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import accel
from deep_gemm.health import GEMMS, rows

WANDB_MODES = ("offline", "online", "disabled")
SUPERSEDED_FILE = "metrics.superseded.jsonl"


def resolve_wandb_mode(config_mode: str, cli_mode: str | None) -> str:
    """The command line wins, then ``WANDB_MODE``, then the config."""
    if cli_mode:
        mode = cli_mode
    elif os.environ.get("WANDB_MODE"):
        mode = os.environ["WANDB_MODE"].strip().lower()
        mode = {"dryrun": "offline", "run": "online", "disabled": "disabled"}.get(mode, mode)
    else:
        mode = config_mode
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}")
    return mode


def model_flops_per_token(activated_params: int, n_layers: int, n_heads: int, qk_head_dim: int, v_head_dim: int,
                          seq_len: int) -> float:
    """Training FLOPs per token: 6 x activated parameters (fwd 2, bwd 4) plus causal attention.

    Attention scores and the weighted sum cost 2 x seq x (qk + v) per head per layer forward over a
    full (non-causal) square; causal halves it; training multiplies by 3.
    """
    attn = 3 * 2 * n_layers * n_heads * seq_len * (qk_head_dim + v_head_dim) / 2
    return 6.0 * activated_params + attn


class NullLogger:
    """What non-logging ranks use: every call does nothing."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self, summary: dict[str, Any] | None = None) -> None:
        pass


def supersede_after(path: Path, step: int) -> int:
    """Move the lines of ``path`` (a ``metrics.jsonl``) logged after ``step`` to ``metrics.superseded.jsonl``
    beside it; returns how many moved. All of them move when ``step`` is 0 (a new run).

    A run resumed from step N after a kill logs steps N+1.. again; the lines the killed run wrote for them
    (and any torn last line) belong to a timeline that no checkpoint continues. Moving them keeps
    ``metrics.jsonl`` one line per step, in the order the surviving timeline ran, while nothing is lost.
    The superseded lines are appended first and ``metrics.jsonl`` is then replaced atomically, so a kill
    in between at worst leaves a line in both files, never in neither. The run folder's lock
    (``training.runlock``) guarantees no other job is appending meanwhile."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            record_step = None  # torn (killed mid-write): superseded too
        if step > 0 and record_step is not None and record_step <= step:
            keep.append(line)
        elif line.strip():
            moved.append(line if line.endswith("\n") else line + "\n")
    if not moved:
        return 0
    with (path.parent / SUPERSEDED_FILE).open("a", encoding="utf-8") as out:
        out.writelines(moved)
        out.flush()
        os.fsync(out.fileno())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    return len(moved)


class MetricsLogger:
    """Progress bar + ``metrics.jsonl`` + wandb, for one run folder.

    Opening it at ``start_step`` first moves the lines an earlier job logged after that step to
    ``metrics.superseded.jsonl`` (``supersede_after``), so that a resumed run's stream has each step once."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, config: dict[str, Any], wandb_mode: str,
                 project: str, run_name: str, progress: bool = True, flops_per_token: float | None = None,
                 fp8: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.superseded = supersede_after(self.path, start_step)
        if self.superseded:
            print(f"metrics: {self.superseded} line(s) an earlier job logged after step {start_step} moved to "
                  f"{self.run_dir / SUPERSEDED_FILE}", flush=True)
        self._file = self.path.open("a", encoding="utf-8")
        self.total_steps, self.flops_per_token, self.fp8 = total_steps, flops_per_token, fp8
        self.device_name = accel.device_name()
        self.history: list[dict[str, Any]] = []
        self._fp8_post = ""
        self._bar = None
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc=run_name, unit="step", dynamic_ncols=True)
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # here: it takes seconds to import, and most runs do not log to it

            self._wandb = wandb.init(project=project, name=run_name, dir=str(self.run_dir), config=config,
                                     mode=wandb_mode, reinit="finish_previous")

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation against the device's dense peak from ``accel.specs`` (None on CPU)."""
        if self.flops_per_token is None:
            return None
        return accel.mfu(tokens_per_s * self.flops_per_token, self.device_name, fp8=self.fp8)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step's scalar metrics (non-scalars, like per-expert loads, go to JSONL only)."""
        record = {"step": step, "time": time.time(), **metrics}
        if "tokens_per_s" in metrics and "mfu" not in metrics:
            mfu = self.mfu(metrics["tokens_per_s"])
            if mfu is not None:
                record["mfu"] = mfu
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        self.history.append({"step": step, **scalars})
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None:
            post = {"loss": f"{record.get('loss', float('nan')):.4f}"}
            if "tokens_per_s" in record:
                post["tok/s"] = f"{record['tokens_per_s']:.0f}"
            if "lr" in record:
                post["lr"] = f"{record['lr']:.2e}"
            if "fp8_underflow_max" in record:  # held from the last health step: FP8 health beside the loss
                self._fp8_post = f"{record['fp8_underflow_max']:.2%}"
            if self._fp8_post:
                post["fp8 underflow"] = self._fp8_post
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)

    def plot(self, path: Path | None = None) -> Path | None:
        """PNG of the training loss (and MTP / validation loss where logged) against the step."""
        if not self.history:
            return None
        import matplotlib  # here: slow to import, and the Agg backend must be chosen before pyplot loads

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = path or self.run_dir / "loss.png"
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (("loss", "train loss"), ("mtp_loss", "MTP loss"), ("valid_loss", "valid loss")):
            pts = [(h["step"], h[key]) for h in self.history if key in h and math.isfinite(h[key])]
            if pts:
                ax.plot(*zip(*pts), label=label, marker="o" if key == "valid_loss" else None)
        ax.axhline(math.log(256), color="grey", ls=":", lw=1, label="ln 256 (uniform bytes)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if summary is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
            if self._wandb is not None:
                for k, v in summary.items():
                    if isinstance(v, (int, float, str)):
                        self._wandb.summary[k] = v
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self._file.close()


def fp8_health_metrics(counts: dict[str, list[float]], step: int, warn: float,
                       warned: dict[str, float]) -> tuple[dict[str, Any], list[str]]:
    """One FP8-health report (``deep_gemm.health`` counts, all ranks merged) as metrics, and its warnings.

    Scalars (wandb and the progress bar): the worst layer's underflow, hidden underflow and subnormal share per
    GEMM (``fp8_{fwd,dgrad,wgrad}_underflow_max`` ...) and over all, and the widest tile amax range.
    ``fp8_health`` (metrics.jsonl only): per layer, per ``gemm.operand``, every statistic. A warning names each
    layer, GEMM and operand whose share of nonzero values that round to 0 exceeds ``warn``: the first time, and
    again each time it has doubled since (``warned``, the caller's record of the shares last warned about, is
    updated), so a run is told when a layer crosses the line or gets worse, not at every report."""
    table = rows(counts)
    if not table:
        return {}, []
    out: dict[str, Any] = {}
    for gemm in GEMMS:
        mine = [r for r in table if r.gemm == gemm]
        if mine:
            out[f"fp8_{gemm}_underflow_max"] = max(r.underflow for r in mine)
            out[f"fp8_{gemm}_hidden_underflow_max"] = max(r.hidden for r in mine)
            out[f"fp8_{gemm}_subnormal_max"] = max(r.subnormal for r in mine)
    out["fp8_underflow_max"] = max(r.underflow for r in table)
    out["fp8_floored_tiles_max"] = max(r.floored for r in table)
    out["fp8_log2_amax_min"] = min(r.log2_amax_min for r in table)
    out["fp8_log2_amax_max"] = max(r.log2_amax_max for r in table)
    per_layer: dict[str, dict[str, dict[str, Any]]] = {}
    for r in table:
        per_layer.setdefault(r.layer, {})[f"{r.gemm}.{r.operand}"] = {
            "underflow": r.underflow, "hidden_underflow": r.hidden, "subnormal": r.subnormal,
            "floored_tiles": r.floored, "log2_amax": [r.log2_amax_min, r.log2_amax_mean, r.log2_amax_max]}
    out["fp8_health"] = per_layer
    warnings = []
    for r in table:
        key = f"{r.layer} {r.gemm} {r.operand}"
        if r.underflow > warn and r.underflow >= 2 * warned.get(key, 0.0):
            warned[key] = r.underflow
            warnings.append(f"FP8 health at step {step}: {key}: {r.underflow:.2%} of nonzero values round to 0 in "
                            f"the cast ({r.hidden:.2%} in tiles at the scale floor), {r.subnormal:.2%} subnormal; "
                            f"threshold {warn:.2%} (logging.fp8_underflow_warn)")
    return out, warnings


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run summary as aligned ``key: value`` lines."""
    width = max(len(k) for k in summary)
    lines = []
    for k, v in summary.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        lines.append(f"  {k.ljust(width)} : {v}")
    return "\n".join(lines)
