"""Resume helpers: name-keyed optimizer states, re-partitioning them for another data-parallel size, restarts.

PyTorch optimizers key their state by parameter *index*, and a ZeRO-1 shard's indices depend on how
many data-parallel ranks split the parameters. A checkpoint keyed by parameter *name* (FQN) can be
read back under any partitioning: each rank asks for the names it now owns and the loader picks them
from whichever saved rank's shard holds them, reading only those tensors (safetensors is lazy).
This is the same idea as ``torch.distributed.checkpoint``'s FQN-keyed optimizer state dicts, kept
within our own file format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from training.checkpoint import format as fmt
from training.checkpoint.manager import read_metadata

log = logging.getLogger(__name__)


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named: ``{"state": {fqn: {...}}, "param_groups": [...]}``.

    ``names`` maps ``id(parameter)`` to its name. Works for a ZeRO shard's local optimizer (``zero.optim``):
    only the parameters it owns appear.
    """
    sd = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    groups = []
    for group, sd_group in zip(optimizer.param_groups, sd["param_groups"]):
        fqns = []
        for p, idx in zip(group["params"], sd_group["params"]):
            if id(p) not in names:
                raise ValueError(f"optimizer parameter of shape {tuple(p.shape)} has no name in `names`; "
                                 "expected a name for every parameter the optimizer holds")
            index_to_name[idx] = names[id(p)]
            fqns.append(names[id(p)])
        groups.append({**{k: v for k, v in sd_group.items() if k != "params"}, "params": fqns})
    return {"state": {index_to_name[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                               named: dict[str, Any]) -> None:
    """Load a name-keyed state (possibly merged from another partitioning) into ``optimizer``.

    Group hyper-parameters come from the saved group of the same index; per-parameter state by name.
    A parameter the optimizer holds but the checkpoint lacks is an error (wrong checkpoint or config).
    """
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint optimizer has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(optimizer.param_groups)}; expected the same grouping")
    state: dict[int, Any] = {}
    groups = []
    index = 0
    missing = []
    for group, saved in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in group["params"]:
            fqn = names[id(p)]
            if fqn in named["state"]:
                state[index] = named["state"][fqn]
            elif _has_state(named):
                missing.append(fqn)
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    if missing:
        raise fmt.CheckpointMismatchError(f"optimizer state missing for {len(missing)} parameters: "
                                          f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _has_state(named: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken after the first optimizer step (before it there is no state)."""
    return bool(named["state"])


class _LazyShard(Mapping):
    """A safetensors file as a read-on-demand mapping (only the tensors asked for are read)."""

    def __init__(self, path: Path | None) -> None:
        self._file = safe_open(str(path), framework="pt") if path is not None else None
        self._keys = set(self._file.keys()) if self._file is not None else set()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def gather_named_optimizer_state(folder: str | Path, section: str, wanted: Iterable[str] | None = None) -> Any:
    """Merge a name-keyed optimizer section over every saved rank, reading only the ``wanted`` names.

    The section may hold one named state or a list of them (one per optimizer); the result has the
    same shape. Use it when the data-parallel size (or any partitioning) changed since the save.
    """
    folder = Path(folder)
    metadata = read_metadata(folder)
    wanted_set = set(wanted) if wanted is not None else None
    merged: Any = None
    is_list = False
    for record in metadata["ranks"]:
        skeleton = record["sections"].get(section)
        if skeleton is None:
            continue
        name = fmt.shard_filename(section, record["rank"])
        shard = _LazyShard(folder / name if name in record["files"] else None)
        is_list = isinstance(skeleton, list)
        parts = skeleton if is_list else [skeleton]
        if merged is None:
            merged = [{"state": {}, "param_groups": None} for _ in parts]
        for out, part in zip(merged, parts):
            for fqn, s in part["state"].items():
                if wanted_set is None or fqn in wanted_set:
                    out["state"][fqn] = fmt.decode_tree(s, shard)
            if out["param_groups"] is None:
                out["param_groups"] = fmt.decode_tree(part["param_groups"], {})
    if merged is None:
        raise fmt.CheckpointError(f"checkpoint {folder} has no section {section!r}")
    return merged if is_list else merged[0]


def restart_count() -> int:
    """How many times torchrun (``--max-restarts``) has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
