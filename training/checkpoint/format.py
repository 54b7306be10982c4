"""On-disk format of a training checkpoint: names, the state-tree encoding, hashing, durable file writes.

A checkpoint is one folder ``<root>/step_000000100/`` holding

- ``<section>-rank00003.safetensors``: the tensors of one top-level section of rank 3's state
  (``model``, ``optimizer``, ``expert_bias``, ...). Sections without tensors get no shard.
- ``metadata.json``: step, tokens seen, config and its hash, parallel layout, software versions,
  and per rank: the JSON skeleton of every section (non-tensor values such as optimizer hyper-parameters,
  LR-scheduler and sampler state live here), the RNG states, and every file's size and sha256.

The tree encoding keeps what ``json`` alone would lose (int dict keys, tuples, bytes, numpy arrays,
dtypes), so ``decode(encode(x)) == x`` for an optimizer ``state_dict()`` or an RNG state. The encoding
is deterministic: the same state always gives the same bytes (async and sync saves are identical).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import torch

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
STABLE_FILE = "stable"
STEP_PREFIX = "step_"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_STEP_RE = re.compile(r"^step_(\d{9,})$")
_HASH_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint fails verification; ``bad_file`` names the offending file."""

    def __init__(self, message: str, bad_file: Path) -> None:
        super().__init__(message)
        self.bad_file = bad_file


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for another model config (hash or tensor shapes differ)."""


def step_dirname(step: int) -> str:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_filename(section: str, rank: int) -> str:
    return f"{section}-rank{rank:05d}.safetensors"


def done_marker_filename(rank: int) -> str:
    return f"rank{rank:05d}.done.json"


def check_section_name(name: Any) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.]+", name):
        raise ValueError(f"state section names must be non-empty strings of [A-Za-z0-9_.], got {name!r}")
    return name


# ----------------------------------------------------------------------------------------------- tree encoding
_SCALARS = (str, int, float, bool, type(None))


def encode_tree(tree: Any, tensors: dict[str, torch.Tensor] | None, path: str = "") -> Any:
    """JSON-able skeleton of ``tree``; every tensor is moved into ``tensors`` under a unique key.

    With ``tensors=None`` tensors are inlined into the JSON (base64), for small ones such as RNG states.
    """
    if isinstance(tree, torch.Tensor) and tensors is None:
        flat = tree.detach().cpu().contiguous().reshape(-1)
        return {"__inline_tensor__": {"dtype": str(tree.dtype).removeprefix("torch."), "shape": list(tree.shape),
                                      "data": base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()}}
    if isinstance(tree, torch.Tensor):
        key = path or "_"
        n = 1
        while key in tensors:
            n += 1
            key = f"{path}#{n}"
        tensors[key] = tree
        return {"__tensor__": key}
    if isinstance(tree, bool) or isinstance(tree, _SCALARS):
        return tree
    if isinstance(tree, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in tree):
            return {k: encode_tree(v, tensors, f"{path}/{k}" if path else k) for k, v in tree.items()}
        return {"__dict__": [[encode_tree(k, None, path), encode_tree(v, tensors, f"{path}/{k}" if path else str(k))]
                             for k, v in tree.items()]}
    if isinstance(tree, list):
        return [encode_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]
    if isinstance(tree, tuple):  # includes torch.Size
        return {"__tuple__": [encode_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]}
    if isinstance(tree, bytes):
        return {"__bytes__": base64.b64encode(tree).decode()}
    if isinstance(tree, np.ndarray):
        return {"__ndarray__": {"dtype": str(tree.dtype), "shape": list(tree.shape),
                                "data": base64.b64encode(np.ascontiguousarray(tree).tobytes()).decode()}}
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, torch.dtype):
        return {"__dtype__": str(tree).removeprefix("torch.")}
    raise ValueError(f"checkpoint state at {path or '<root>'!r} has a value of type {type(tree).__name__}; "
                     "expected tensors, dicts, lists, tuples, bytes, numpy arrays, str/int/float/bool/None")


def decode_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tree`."""
    if isinstance(skeleton, list):
        return [decode_tree(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        key = skeleton["__tensor__"]
        if key not in tensors:
            raise CheckpointError(f"tensor {key!r} named in the metadata is missing from its shard")
        return tensors[key]
    if "__dict__" in skeleton:
        return {_hashable(decode_tree(k, tensors)): decode_tree(v, tensors) for k, v in skeleton["__dict__"]}
    if "__tuple__" in skeleton:
        return tuple(decode_tree(v, tensors) for v in skeleton["__tuple__"])
    if "__bytes__" in skeleton:
        return base64.b64decode(skeleton["__bytes__"])
    if "__ndarray__" in skeleton:
        spec = skeleton["__ndarray__"]
        return np.frombuffer(base64.b64decode(spec["data"]), dtype=spec["dtype"]).reshape(spec["shape"]).copy()
    if "__inline_tensor__" in skeleton:
        spec = skeleton["__inline_tensor__"]
        data = base64.b64decode(spec["data"])
        if not data:
            return torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(getattr(torch, spec["dtype"])).reshape(spec["shape"]).clone()
    if "__dtype__" in skeleton:
        return getattr(torch, skeleton["__dtype__"])
    return {k: decode_tree(v, tensors) for k, v in skeleton.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def config_hash(config: Any) -> str:
    """sha256 of the canonical JSON of a config (sorted keys): equal configs hash equally across runs."""
    return hashlib.sha256(json.dumps(encode_tree(config, None), sort_keys=True).encode()).hexdigest()


def dumps(obj: Any) -> bytes:
    """Deterministic JSON bytes for metadata files."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


# ----------------------------------------------------------------------------------------------- durable files
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX needs the directory itself fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_pointer(root: Path, name: str) -> int | None:
    """The step a pointer file (``latest`` / ``stable``) names, or None when absent or unreadable."""
    try:
        text = (root / name).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return parse_step_dirname(text)


def write_pointer(root: Path, name: str, step: int) -> None:
    atomic_write_bytes(root / name, (step_dirname(step) + "\n").encode())


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "safetensors": safetensors.__version__, "numpy": np.__version__, "format_version": str(FORMAT_VERSION)}
    try:
        versions["dsv3-toolkit"] = version("dsv3-toolkit")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        pass
    return versions


def committed_steps(root: Path) -> list[int]:
    """Steps of the folders in ``root`` that are complete (renamed into place, metadata present), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        step = parse_step_dirname(entry.name)
        if step is not None and (entry / METADATA_FILE).is_file():
            steps.append(step)
    return sorted(steps)
