"""Snapshot state to CPU memory, then write it in a background thread and commit it atomically.

The training loop pays only for :meth:`Snapshotter.snapshot` (a copy into reused CPU buffers, pinned
and non-blocking when the state lives on a GPU). One background thread then, per rank:

1. writes each section's tensors to ``<root>/.staging-step_N/<section>-rankR.safetensors`` and fsyncs it;
2. writes ``rankR.done.json`` (its file sizes and sha256, JSON skeletons, RNG state) atomically;
3. rank 0 only: waits for every rank's done marker (no collective: the training loop owns the process
   group), merges them into ``metadata.json``, fsyncs, renames the staging folder to ``step_N``, fsyncs
   the root, and replaces the ``latest`` pointer atomically. Then retention runs.

A crash at any moment leaves either the previous ``latest`` or the new one, never a half checkpoint:
staging folders are never loaded and are swept at the next start. At most one save is in flight; a new
one waits for the previous. A failure in the background (a full disk, a dead rank) is kept and raised
in the training loop by the next :meth:`CheckpointWriter.poll`, ``submit`` or ``wait``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import accel
from training.checkpoint import format as fmt

EventHook = Callable[[str, int, str], None]
SaveTensors = Callable[[dict[str, torch.Tensor], Path], None]


class CheckpointWriteError(fmt.CheckpointError):
    """A background checkpoint write failed; the previous committed checkpoint is untouched."""


class Snapshotter:
    """Copies a state tree's tensors into CPU buffers that are reused from one save to the next.

    Reuse is safe because a save starts only after the previous write finished. Buffers are pinned
    when the source is on a device, so the device-to-host copies run asynchronously and all finish
    at one synchronize.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.Size, torch.dtype], torch.Tensor] = {}

    def snapshot(self, tree: Any) -> Any:
        used: set[tuple] = set()
        on_device = [False]
        out = self._copy(tree, "", used, on_device)
        for key in [k for k in self._buffers if k not in used]:
            del self._buffers[key]  # tensors that vanished from the state (a different layout) free their buffer
        if on_device[0]:
            accel.synchronize()
        return out

    def _copy(self, tree: Any, path: str, used: set, on_device: list) -> Any:
        if isinstance(tree, torch.Tensor):
            src = tree.detach()
            key = (path, src.shape, src.dtype)
            n = 1
            while key in used:
                n += 1
                key = (f"{path}#{n}", src.shape, src.dtype)
            used.add(key)
            buf = self._buffers.get(key)
            pin = src.device.type != "cpu"
            if buf is None:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=pin)
            on_device[0] |= pin
            return buf
        if isinstance(tree, dict):
            return {k: self._copy(v, f"{path}/{k}", used, on_device) for k, v in tree.items()}
        if isinstance(tree, list):
            return [self._copy(v, f"{path}/{i}", used, on_device) for i, v in enumerate(tree)]
        if isinstance(tree, tuple) and not isinstance(tree, torch.Size):
            return tuple(self._copy(v, f"{path}/{i}", used, on_device) for i, v in enumerate(tree))
        return _deepcopy_leaf(tree)


def paused_writer(delay_s: float, on_pause: Callable[[Path], None] | None = None) -> SaveTensors:
    """Test instrument: ``safetensors.torch.save_file``'s bytes, written in two halves with a ``delay_s`` pause
    between them (the first half fsynced), so a kill -9 can land inside a shard file."""
    def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
        data = safetensors.torch.save(tensors)
        half = len(data) // 2
        with open(path, "wb") as f:
            f.write(data[:half])
            f.flush()
            os.fsync(f.fileno())
            if on_pause is not None:
                on_pause(path)
            time.sleep(delay_s)
            f.write(data[half:])
    return save


def _deepcopy_leaf(x: Any) -> Any:
    return copy.deepcopy(x)


@dataclass
class SaveJob:
    """Everything one rank writes for one step; the tensors already live in private CPU memory."""

    step: int
    sections: dict[str, tuple[Any, dict[str, torch.Tensor]]]  # name -> (JSON skeleton, tensors)
    rank_extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def encode_sections(state: dict[str, Any]) -> dict[str, tuple[Any, dict[str, torch.Tensor]]]:
    """Split each section of a (snapshotted) state into its JSON skeleton and its tensors."""
    out = {}
    for section, tree in state.items():
        fmt.check_section_name(section)
        tensors: dict[str, torch.Tensor] = {}
        try:
            out[section] = (fmt.encode_tree(tree, tensors), tensors)
        except ValueError as exc:
            raise ValueError(f"section {section!r}: {exc}") from None
    return out


class CheckpointWriter:
    """Writes :class:`SaveJob` s for one rank, in the background (``submit``) or in place (``write``)."""

    def __init__(self, root: str | Path, rank: int = 0, world_size: int = 1, *, commit_timeout_s: float = 600.0,
                 after_commit: Callable[[int], None] | None = None, on_event: EventHook | None = None,
                 save_tensors: SaveTensors | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.commit_timeout_s = commit_timeout_s
        self.after_commit = after_commit
        self.on_event = on_event
        self.save_tensors = save_tensors or (lambda tensors, path: safetensors.torch.save_file(tensors, str(path)))
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._future: concurrent.futures.Future | None = None
        self._future_step: int | None = None
        self.last_write_seconds = 0.0

    # ------------------------------------------------------------------------------------------ public
    def submit(self, job: SaveJob) -> None:
        """Start writing ``job`` in the background (after the previous write finished)."""
        self.wait()
        self._future = self._executor.submit(self._run, job)
        self._future_step = job.step

    def write(self, job: SaveJob) -> None:
        """Write ``job`` in the calling thread (sync mode); raises CheckpointWriteError on failure."""
        self.wait()
        try:
            self._run(job)
        except Exception as exc:
            raise CheckpointWriteError(f"rank {self.rank}: checkpoint of step {job.step} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc

    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def poll(self) -> None:
        """Raise the error of a finished background write, if any; never blocks."""
        if self._future is not None and self._future.done():
            self._collect()

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its error."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
            self._collect()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------ internals
    def _collect(self) -> None:
        future, step = self._future, self._future_step
        self._future = self._future_step = None
        exc = future.exception()
        if exc is not None:
            raise CheckpointWriteError(f"rank {self.rank}: background checkpoint of step {step} failed: "
                                       f"{type(exc).__name__}: {exc}; the previous committed checkpoint is "
                                       "untouched") from exc

    def _event(self, name: str, step: int, detail: str = "") -> None:
        if self.on_event is not None:
            self.on_event(name, step, detail)

    def _run(self, job: SaveJob) -> None:
        t0 = time.perf_counter()
        staging = self.root / (fmt.STAGING_PREFIX + fmt.step_dirname(job.step))
        staging.mkdir(parents=True, exist_ok=True)
        try:
            record = self._write_rank_files(job, staging)
            if self.rank == 0:
                self._commit(job, staging, record)
        except BaseException:
            if self.rank == 0 or self.world_size == 1:
                shutil.rmtree(staging, ignore_errors=True)  # a failed save leaves nothing behind
            raise
        self.last_write_seconds = time.perf_counter() - t0

    def _write_rank_files(self, job: SaveJob, staging: Path) -> dict[str, Any]:
        files: dict[str, dict[str, Any]] = {}
        skeletons: dict[str, Any] = {}
        for section, (skeleton, tensors) in job.sections.items():
            skeletons[section] = skeleton
            if not tensors:
                continue
            name = fmt.shard_filename(section, self.rank)
            path = staging / name
            self.save_tensors({k: v.contiguous() for k, v in tensors.items()}, path)
            # safetensors creates its files 0600; give them the mode the JSON beside them gets (the umask's):
            # a folder is made 0777 & ~umask, a file 0666 & ~umask
            os.chmod(path, stat.S_IMODE(staging.stat().st_mode) & 0o666)
            fmt.fsync_file(path)
            files[name] = {"bytes": path.stat().st_size, "sha256": fmt.sha256_file(path)}
            self._event("file_written", job.step, name)
        record = {"rank": self.rank, "files": files, "sections": skeletons,
                  "extra": fmt.encode_tree(job.rank_extra, None)}
        fmt.atomic_write_bytes(staging / fmt.done_marker_filename(self.rank), fmt.dumps(record))
        self._event("rank_done", job.step, str(self.rank))
        return record

    def _commit(self, job: SaveJob, staging: Path, own_record: dict[str, Any]) -> None:
        records = [own_record] + [self._await_marker(staging, r, job.step) for r in range(1, self.world_size)]
        metadata = dict(job.meta)
        metadata.update({"format_version": fmt.FORMAT_VERSION, "step": job.step, "world_size": self.world_size,
                         "software": fmt.software_versions(), "ranks": records,
                         "files": {n: e for rec in records for n, e in rec["files"].items()}})
        fmt.atomic_write_bytes(staging / fmt.METADATA_FILE, fmt.dumps(metadata))
        for r in range(self.world_size):
            (staging / fmt.done_marker_filename(r)).unlink()
        fmt.fsync_dir(staging)
        self._event("staged", job.step)
        final = self.root / fmt.step_dirname(job.step)
        trash = None
        if final.exists():  # the same step saved again after a rollback: swap, then drop the old one
            trash = self.root / (fmt.TRASH_PREFIX + final.name)
            shutil.rmtree(trash, ignore_errors=True)
            final.rename(trash)
        staging.rename(final)
        fmt.fsync_dir(self.root)
        self._event("renamed", job.step)
        fmt.write_pointer(self.root, fmt.LATEST_FILE, job.step)
        self._event("committed", job.step)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        if self.after_commit is not None:
            self.after_commit(job.step)

    def _await_marker(self, staging: Path, rank: int, step: int) -> dict[str, Any]:
        path = staging / fmt.done_marker_filename(rank)
        deadline = time.monotonic() + self.commit_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 waited {self.commit_timeout_s:.0f}s for rank {rank} to finish its part of "
                                   f"the checkpoint of step {step} ({path.name} missing): rank {rank} is dead, "
                                   "stalled or does not share this filesystem")
            time.sleep(0.02)
        return json.loads(path.read_text())

