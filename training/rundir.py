"""Which run folder a launch uses, the ``--resume`` argument checked before any work, and the saved config.

``--resume auto`` without ``--run-dir`` continues the newest run under ``run.runs_root`` whose saved
``config.toml`` hashes like this launch's (``fmt.config_hash`` of ``numerics_dict``, as the checkpoint's
``config_hash``: the settings that change the numerics; steps, logging and checkpointing may differ) and
that has a committed checkpoint; without one it starts a new run folder and says so.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path

from training.checkpoint import format as fmt
from training.checkpoint.manager import check_resumable
from training.config import TrainConfig, load_config, numerics_dict

CONFIG_FILE = "config.toml"


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.runs_root) / f"{cfg.run.name}-{stamp}-{os.getpid()}"


def check_resume(resume: str | None, cfg: TrainConfig | None = None) -> None:
    """``--resume`` is ``auto`` or a checkpoint folder (one with ``metadata.json``); ValueError otherwise. With
    ``cfg``, a folder must also be a committed checkpoint of this config's numerics (``check_resumable``): all
    checked before a launch creates its run folder."""
    if resume is None or resume == "auto":
        return
    path = Path(resume).expanduser()
    expected = "expected 'auto' or a checkpoint folder such as RUN/checkpoints/step_000000100"
    if not path.exists():
        raise ValueError(f"--resume {resume!r}: no such folder; {expected}")
    if path.is_dir() and (path / fmt.METADATA_FILE).is_file():
        if cfg is not None:
            check_resumable(path, numerics_dict(cfg))
        return
    hint = ""
    if path.is_dir() and (path / "checkpoints").is_dir():
        hint = f" (a run folder: to continue it use --run-dir {resume} --resume auto)"
    raise ValueError(f"--resume {resume!r} is not a checkpoint folder (no {fmt.METADATA_FILE}){hint}; {expected}")


def newest_run_of(cfg: TrainConfig) -> tuple[Path, int] | None:
    """(run folder, latest committed step) of the newest run under ``run.runs_root`` with ``cfg``'s
    config hash and a committed checkpoint; newest = its ``config.toml`` written last (each launch writes it)."""
    root = Path(cfg.run.runs_root)
    if not root.is_dir():
        return None
    want = fmt.config_hash(numerics_dict(cfg))
    found: list[tuple[float, str, Path, int]] = []
    for run in root.iterdir():
        saved = run / CONFIG_FILE
        try:
            if not saved.is_file():
                continue
            step = fmt.read_pointer(run / "checkpoints", fmt.LATEST_FILE)
            if step is None or fmt.config_hash(numerics_dict(load_config(saved))) != want:
                continue
            found.append((saved.stat().st_mtime, run.name, run, step))
        except (OSError, ValueError):  # unreadable, or a config this version no longer accepts: not ours
            continue
    if not found:
        return None
    _, _, run, step = max(found)
    return run, step


def choose_run_dir(cfg: TrainConfig, run_dir: str | None, resume: str | None,
                   announce: Callable[[str], None] = print) -> Path:
    """``run_dir`` when given; else, for ``--resume auto``, the newest run of this config (or a new folder,
    announced); else a new folder ``<run.runs_root>/<run.name>-<time>-<pid>``."""
    if run_dir:
        return Path(run_dir)
    if resume != "auto":
        return default_run_dir(cfg)
    found = newest_run_of(cfg)
    if found is not None:
        announce(f"resume auto: continuing {found[0]} (newest run of this config, step {found[1]})")
        return found[0]
    new = default_run_dir(cfg)
    announce(f"resume auto: no earlier run of this config under {cfg.run.runs_root}/; starting a new run in {new}")
    return new


def check_fresh(run_dir: str | os.PathLike, resume: str | None) -> None:
    """A launch without ``--resume`` must not start over in a folder whose checkpoints belong to an earlier run:
    its metrics, retention and rollback pointers would mix with theirs. ValueError naming ``--run-dir``.
    Checked under the folder's lock, so a live job's folder is reported as locked instead."""
    if resume is not None:
        return
    step = fmt.read_pointer(Path(run_dir) / "checkpoints", fmt.LATEST_FILE)
    if step is not None:
        raise ValueError(f"--run-dir {str(run_dir)!r} already holds an earlier run's checkpoints (latest step {step}); "
                         "continue it with --resume auto, or choose another --run-dir")


def write_config(run_dir: str | os.PathLike, cfg: TrainConfig) -> Path:
    """``run_dir/config.toml`` replaced atomically (temp file + rename): never half-written."""
    target = Path(run_dir) / CONFIG_FILE
    tmp = target.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    tmp.write_text(cfg.to_toml())
    os.replace(tmp, target)
    return target
