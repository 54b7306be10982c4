"""``CheckpointManager``: save (async or sync), retention, find the newest valid checkpoint, load, roll back.

Every rank owns one manager over the same root folder (a filesystem all ranks share). Saves are
collective-free: rank 0 commits once every rank's done marker is there (see ``writer.py``). Finding
and loading happen at start-up in the training loop's own thread, where collectives are fine: the
ranks split the checksum work and agree on one checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

from training.checkpoint import format as fmt
from training.checkpoint.rng import capture_rng_state
from training.checkpoint.writer import CheckpointWriter, EventHook, SaveJob, SaveTensors, Snapshotter, encode_sections

log = logging.getLogger(__name__)
MetricsHook = Callable[[dict[str, Any]], None]


@dataclass
class LoadedCheckpoint:
    """One rank's view of a checkpoint: its decoded sections, its RNG state, and the whole metadata."""

    path: Path
    step: int
    metadata: dict[str, Any]
    state: dict[str, Any]
    rng: dict[str, Any] | None
    saved_rank: int


class CheckpointManager:
    """Save / find / load / retain / roll back the checkpoints under ``root`` for this rank.

    ``keep_last`` newest checkpoints are kept, plus every one whose step is a multiple of
    ``keep_every`` (0: none), plus the ``latest`` and ``stable`` ones and any pinned with :meth:`pin`.
    ``verify`` is ``"full"`` (sizes and sha256) or ``"size"`` (sizes only, for very large checkpoints).
    ``sweep``: rank 0 removes the ``.staging-*`` / trash folders of interrupted saves at start. Only the job
    that owns the run folder (holds its lock, ``training.runlock``) may ask for it, since another job's
    staging folder is a save in progress; readers (exports, tools) never sweep.
    """

    def __init__(self, root: str | Path, *, async_save: bool = True, keep_last: int = 3, keep_every: int = 0,
                 verify: str = "full", commit_timeout_s: float = 600.0, rank: int | None = None,
                 world_size: int | None = None, on_event: EventHook | None = None,
                 metrics: MetricsHook | None = None, save_tensors: SaveTensors | None = None,
                 sweep: bool = False) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the last committed checkpoint is kept), got {keep_last}")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0 (0 keeps no extra checkpoints), got {keep_every}")
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if self._dist else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if self._dist else 1)
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise fmt.CheckpointError(f"checkpoint root {self.root} cannot be created: {exc}") from exc
        self.async_save = async_save
        self.keep_last, self.keep_every, self.verify_mode = keep_last, keep_every, verify
        self.metrics = metrics
        self._lock = threading.Lock()
        self._pinned: set[int] = set()
        self._snapshotter = Snapshotter()
        self._writer = CheckpointWriter(self.root, self.rank, self.world_size, commit_timeout_s=commit_timeout_s,
                                        after_commit=self._apply_retention, on_event=on_event,
                                        save_tensors=save_tensors)
        if sweep and self.rank == 0:
            self._sweep_leftovers()
        self._barrier()

    # ------------------------------------------------------------------------------------------ saving
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None, *,
             sync: bool | None = None) -> float:
        """Snapshot ``state`` (sections -> shards) and write it; returns the seconds the caller was stalled.

        ``meta`` is global information (rank 0's is kept): ``tokens_seen``, ``config`` (its hash is added),
        ``layout`` and anything JSON-able. The RNG states of this rank are captured here. Async mode returns
        once the snapshot is in CPU memory; errors of an earlier background write are raised here.
        """
        t0 = time.perf_counter()
        if not isinstance(state, dict) or not state:
            raise ValueError(f"state must be a non-empty dict of sections, got {type(state).__name__}")
        for name in state:
            fmt.check_section_name(name)
        self._writer.wait()  # at most one save in flight; surfaces its error
        job_meta = dict(meta or {})
        if "config" in job_meta:
            job_meta["config_hash"] = fmt.config_hash(job_meta["config"])
        job_meta = fmt.encode_tree(job_meta, None)
        job = SaveJob(step=step, sections=encode_sections(self._snapshotter.snapshot(state)),
                      rank_extra={"rng": capture_rng_state()}, meta=job_meta)
        use_async = self.async_save if sync is None else not sync
        if use_async:
            self._writer.submit(job)
        else:
            self._writer.write(job)
        return time.perf_counter() - t0

    def poll(self) -> None:
        """Raise the error of a finished background save (call once per step); never blocks."""
        self._writer.poll()

    def wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, committed)."""
        self._writer.wait()

    def close(self) -> None:
        self._writer.close()

    @property
    def last_write_seconds(self) -> float:
        return self._writer.last_write_seconds

    # ------------------------------------------------------------------------------------------ pointers
    def committed_steps(self) -> list[int]:
        return fmt.committed_steps(self.root)

    def latest_step(self) -> int | None:
        return fmt.read_pointer(self.root, fmt.LATEST_FILE)

    def stable_step(self) -> int | None:
        return fmt.read_pointer(self.root, fmt.STABLE_FILE)

    def pin(self, step: int) -> None:
        """Protect ``step`` from retention (e.g. a checkpoint that may become the stable one)."""
        with self._lock:
            self._pinned.add(step)

    def unpin(self, step: int) -> None:
        with self._lock:
            self._pinned.discard(step)

    def mark_stable(self, step: int) -> None:
        """Record ``step`` as the rollback target (rank 0 writes the ``stable`` pointer)."""
        if self.rank == 0:
            if not (self.root / fmt.step_dirname(step) / fmt.METADATA_FILE).is_file():
                raise fmt.CheckpointError(f"cannot mark step {step} stable: it is not committed under {self.root}")
            fmt.write_pointer(self.root, fmt.STABLE_FILE, step)

    def rollback_to(self, step: int) -> None:
        """Make ``step`` the latest again and delete every newer checkpoint (they followed a fault)."""
        try:
            self._writer.wait()
        except fmt.CheckpointError as exc:
            log.warning("checkpoint write in flight at rollback failed (ignored, rolling back): %s", exc)
        if self.rank == 0:
            fmt.write_pointer(self.root, fmt.LATEST_FILE, step)  # pointer first: a crash below still resumes here
            for newer in [s for s in self.committed_steps() if s > step]:
                self._delete(newer)
        self._barrier()

    # ------------------------------------------------------------------------------------------ finding
    def resolve(self, path: str | Path | None) -> Path | None:
        """``"auto"`` / None -> newest valid checkpoint (or None when there is none); else the folder, checked."""
        if path is None or str(path) == "auto":
            return self.find_latest_valid()
        folder = Path(path)
        if not folder.is_dir():
            raise fmt.CheckpointError(f"checkpoint folder {folder} does not exist or is not a folder")
        bad = self._verify_distributed(folder)
        if bad is not None:
            raise fmt.CheckpointCorruptError(f"checkpoint {folder} is invalid: {bad[1]}", Path(bad[0]))
        return folder

    def find_latest_valid(self) -> Path | None:
        """The newest committed checkpoint whose files all verify; falls back with a warning naming the bad file.

        Only folders up to the ``latest`` pointer count (newer ones were never committed or were rolled
        back); without a readable pointer every committed folder is a candidate.
        """
        latest = self.latest_step()
        steps = self.committed_steps()
        if latest is not None:
            steps = [s for s in steps if s <= latest]
        for step in reversed(steps):
            folder = self.root / fmt.step_dirname(step)
            bad = self._verify_distributed(folder)
            if bad is None:
                return folder
            msg = (f"checkpoint {folder} is corrupt ({bad[1]}; bad file: {bad[0]}); falling back to the previous "
                   "checkpoint")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
            self._log_metrics({"event": "checkpoint_fallback", "step": step, "bad_file": bad[0], "reason": bad[1]})
        return None

    def verify(self, folder: Path, saved_ranks: list[int] | None = None) -> tuple[str, str] | None:
        """(bad file, reason) for the first problem in ``folder`` (restricted to ``saved_ranks``), or None."""
        meta_path = folder / fmt.METADATA_FILE
        try:
            metadata = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            return str(meta_path), f"metadata unreadable: {type(exc).__name__}: {exc}"
        try:
            records = metadata["ranks"]
            if metadata.get("format_version") != fmt.FORMAT_VERSION:
                return str(meta_path), f"format_version {metadata.get('format_version')} != {fmt.FORMAT_VERSION}"
        except (KeyError, TypeError):
            return str(meta_path), "metadata lacks 'ranks'"
        for record in records:
            if saved_ranks is not None and record["rank"] not in saved_ranks:
                continue
            for name, entry in sorted(record["files"].items()):
                path = folder / name
                try:
                    size = path.stat().st_size
                except OSError as exc:
                    return str(path), f"missing or unreadable: {exc.strerror}"
                if size != entry["bytes"]:
                    return str(path), f"size {size} bytes, metadata says {entry['bytes']}"
                if self.verify_mode == "full":
                    try:
                        digest = fmt.sha256_file(path)
                    except OSError as exc:
                        return str(path), f"unreadable: {exc}"
                    if digest != entry["sha256"]:
                        return str(path), "sha256 mismatch"
        return None

    def _verify_distributed(self, folder: Path) -> tuple[str, str] | None:
        """Every rank checksums a share of the saved ranks' files; all agree on the first problem found."""
        meta_path = folder / fmt.METADATA_FILE
        try:
            saved_world = int(json.loads(meta_path.read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad: tuple[str, str] | None = (str(meta_path), f"metadata unreadable: {type(exc).__name__}: {exc}")
        else:
            mine = [r for r in range(saved_world) if r % self.world_size == self.rank]
            bad = self.verify(folder, mine) if mine else None
        if self._dist and self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, bad)
            bad = next((b for b in gathered if b is not None), None)
        return tuple(bad) if bad is not None else None

    # ------------------------------------------------------------------------------------------ loading
    def load(self, path: str | Path | None = "auto", *, rank: int | None = None,
             expect_config: Any = None, sections: list[str] | None = None) -> LoadedCheckpoint | None:
        """Load this rank's part (or saved ``rank``'s) of the checkpoint at ``path`` (``"auto"``: newest valid).

        Returns None when ``"auto"`` finds no checkpoint. ``expect_config`` (this run's config) must hash
        like the saved one, else CheckpointMismatchError lists the differing keys.
        """
        folder = self.resolve(path)
        if folder is None:
            return None
        return read_checkpoint(folder, self.rank if rank is None else rank, expect_config=expect_config,
                               sections=sections)

    # ------------------------------------------------------------------------------------------ internals
    def _apply_retention(self, committed_step: int) -> None:
        steps = self.committed_steps()
        keep = set(steps[-self.keep_last:]) | {committed_step}
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for pointer in (fmt.LATEST_FILE, fmt.STABLE_FILE):
            s = fmt.read_pointer(self.root, pointer)
            if s is not None:
                keep.add(s)
        with self._lock:
            keep |= self._pinned
        for step in steps:
            if step not in keep:
                self._delete(step)

    def _delete(self, step: int) -> None:
        folder = self.root / fmt.step_dirname(step)
        trash = self.root / (fmt.TRASH_PREFIX + folder.name)
        try:
            folder.rename(trash)  # one atomic step: a half-deleted folder never looks committed
        except FileNotFoundError:
            return
        fmt.fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep_leftovers(self) -> None:
        for entry in self.root.iterdir():
            if entry.name.startswith((fmt.STAGING_PREFIX, fmt.TRASH_PREFIX)) and entry.is_dir():
                log.info("removing leftover %s from an interrupted save", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def _barrier(self) -> None:
        if self._dist and self.world_size > 1:
            dist.barrier()

    def _log_metrics(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics(record)


def read_metadata(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / fmt.METADATA_FILE
    if not folder.is_dir():
        raise fmt.CheckpointError(f"checkpoint folder {folder} does not exist or is not a folder")
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise fmt.CheckpointError(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise fmt.CheckpointCorruptError(f"{path} is not valid JSON: {exc}", path) from exc


def read_checkpoint(folder: str | Path, rank: int, *, expect_config: Any = None,
                    sections: list[str] | None = None) -> LoadedCheckpoint:
    """Decode saved ``rank``'s sections of an (already verified) checkpoint folder onto the CPU."""
    folder = Path(folder)
    metadata = read_metadata(folder)
    if expect_config is not None:
        check_config(metadata, expect_config, folder)
    records = {rec["rank"]: rec for rec in metadata["ranks"]}
    if rank not in records:
        raise ValueError(f"rank {rank} not in checkpoint {folder}, which was saved by {len(records)} ranks; "
                         "use training.checkpoint.resume to re-partition for a different world size")
    record = records[rank]
    state = {}
    for name, skeleton in record["sections"].items():
        if sections is not None and name not in sections:
            continue
        shard = folder / fmt.shard_filename(name, rank)
        tensors = safetensors.torch.load_file(str(shard)) if shard.name in record["files"] else {}
        state[name] = fmt.decode_tree(skeleton, tensors)
    extra = fmt.decode_tree(record.get("extra", {}), {})
    return LoadedCheckpoint(path=folder, step=int(metadata["step"]), metadata=metadata, state=state,
                            rng=extra.get("rng"), saved_rank=rank)


def check_resumable(folder: str | Path, config: dict[str, Any]) -> None:
    """ValueError naming ``folder`` unless it is a committed checkpoint a run of ``config`` (``numerics_dict``) can
    resume: readable metadata of this format, every rank's files present at their recorded sizes, and the same
    numerics (the parallel layout may differ: resuming reshards). Reads only metadata and file sizes, so a launch
    checks its ``--resume`` before it creates anything."""
    folder = Path(folder)
    try:
        metadata = read_metadata(folder)
        if not isinstance(metadata, dict) or not isinstance(metadata.get("ranks"), list) or not metadata["ranks"]:
            raise fmt.CheckpointCorruptError(f"{folder / fmt.METADATA_FILE} lacks the list of saved ranks",
                                             folder / fmt.METADATA_FILE)
        if metadata.get("format_version") != fmt.FORMAT_VERSION:
            raise fmt.CheckpointCorruptError(f"{folder / fmt.METADATA_FILE}: format_version "
                                             f"{metadata.get('format_version')!r}, expected {fmt.FORMAT_VERSION}",
                                             folder / fmt.METADATA_FILE)
        for record in metadata["ranks"]:
            for name, entry in sorted(record["files"].items()):
                size = (folder / name).stat().st_size if (folder / name).is_file() else None
                if size != entry["bytes"]:
                    raise fmt.CheckpointCorruptError(f"{folder / name} is missing or not {entry['bytes']} bytes "
                                                     "as the metadata records", folder / name)
        saved = fmt.decode_tree(metadata.get("config"), {}) if "config" in metadata else None
        if isinstance(saved, dict) and "parallel" in saved:
            config = {**config, "parallel": saved["parallel"]}  # the layout may change on resume, nothing else
        check_config(metadata, config, folder)
    except (fmt.CheckpointError, fmt.CheckpointMismatchError) as exc:
        raise ValueError(f"--resume {str(folder)!r}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--resume {str(folder)!r}: {folder / fmt.METADATA_FILE} is not checkpoint metadata "
                         f"({type(exc).__name__}: {exc})") from None


def check_config(metadata: dict[str, Any], config: Any, folder: Path) -> None:
    """Raise CheckpointMismatchError when ``config`` does not hash like the checkpoint's config."""
    want = fmt.config_hash(config)
    have = metadata.get("config_hash")
    if have == want:
        return
    saved = fmt.decode_tree(metadata.get("config"), {}) if "config" in metadata else None
    diff = sorted(_diff_keys(saved, config)) if isinstance(saved, dict) and isinstance(config, dict) else []
    raise fmt.CheckpointMismatchError(
        f"checkpoint {folder} was written for another config (hash {str(have)[:12]} vs this run's {want[:12]}); "
        f"differing keys: {', '.join(diff) or 'unknown (no config saved)'}")


def _diff_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in set(a) | set(b):
        va, vb = a.get(k, "<missing>"), b.get(k, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff_keys(va, vb, f"{prefix}{k}.")
        elif fmt.encode_tree(va, None) != fmt.encode_tree(vb, None):
            out.append(f"{prefix}{k}")
    return out


def check_shapes(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], what: str = "model") -> None:
    """ValueError naming every tensor whose presence, shape or dtype differs between two flat state dicts."""
    problems = []
    for k in sorted(set(expected) | set(loaded)):
        if k not in loaded:
            problems.append(f"{k}: missing from checkpoint")
        elif k not in expected:
            problems.append(f"{k}: unexpected in checkpoint")
        elif tuple(expected[k].shape) != tuple(loaded[k].shape) or expected[k].dtype != loaded[k].dtype:
            problems.append(f"{k}: checkpoint {tuple(loaded[k].shape)} {loaded[k].dtype}, "
                            f"expected {tuple(expected[k].shape)} {expected[k].dtype}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise fmt.CheckpointMismatchError(f"{what} state does not match the checkpoint (another config?): {shown}")
