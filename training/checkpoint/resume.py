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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from models.deepseek_v3 import ModelArgs
from training.checkpoint import format as fmt
from training.checkpoint.manager import read_metadata
from training.optim import is_expert_param, split_zero
from training.stages import expert_range

log = logging.getLogger(__name__)


def local_param_names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """Names of the parameters whose states this rank holds (its ZeRO shard, or all)."""
    return [name for group in local_param_groups(optimizer, names) for name in group]


def local_param_groups(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]]:
    """``local_param_names`` per parameter group."""
    local, _ = split_zero(optimizer)
    return [[names[id(p)] for p in g["params"]] for g in local.param_groups]


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named: ``{"state": {fqn: {...}}, "param_groups": [...]}``.

    ``names`` maps ``id(parameter)`` to its name. For a ``ZeroRedundancyOptimizer`` only this rank's shard
    is saved (no gather), with the group hyper-parameters of the outer optimizer: an LR scheduler updates
    those, and the shard's copy lags one step behind until the next ``step()``.
    """
    local, zero = split_zero(optimizer)
    sd = local.state_dict()
    index_to_name: dict[int, str] = {}
    groups = []
    outer = zero.param_groups if zero is not None else [{}] * len(sd["param_groups"])
    for group, sd_group, outer_group in zip(local.param_groups, sd["param_groups"], outer):
        fqns = []
        for p, idx in zip(group["params"], sd_group["params"]):
            if id(p) not in names:
                raise ValueError(f"optimizer parameter of shape {tuple(p.shape)} has no name in `names`; "
                                 "expected a name for every parameter the optimizer holds")
            index_to_name[idx] = names[id(p)]
            fqns.append(names[id(p)])
        hyper = {k: v for k, v in sd_group.items() if k != "params"}
        hyper.update({k: v for k, v in outer_group.items() if k != "params" and k in hyper})
        groups.append({**hyper, "params": fqns})
    return {"state": {index_to_name[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                               named: dict[str, Any]) -> None:
    """Load a name-keyed state (possibly merged from another partitioning) into ``optimizer``.

    Group hyper-parameters come from the saved group of the same index; per-parameter state by name.
    A parameter the optimizer holds but the checkpoint lacks is an error (wrong checkpoint or config).
    A ``ZeroRedundancyOptimizer`` gets its shard's states and the hyper-parameters on both levels.
    """
    optimizer, zero = split_zero(optimizer)
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
    if zero is not None:
        for outer_group, saved in zip(zero.param_groups, saved_groups):
            outer_group.update({k: v for k, v in saved.items() if k != "params"})


def _has_state(named: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken after the first optimizer step (before it there is no state)."""
    return bool(named["state"])


class LazyShard(Mapping):
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


def gather_named_optimizer_state(folder: str | Path, section: str, wanted: Iterable[str] | None = None,
                                 state_keys: Iterable[str] | None = None) -> Any:
    """Merge a name-keyed optimizer section over every saved rank, reading only the ``wanted`` names (and of
    their per-parameter states only ``state_keys``, e.g. ``["master"]``; parameters without any are left out).

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
        shard = LazyShard(folder / name if name in record["files"] else None)
        is_list = isinstance(skeleton, list)
        parts = skeleton if is_list else [skeleton]
        if merged is None:
            merged = [{"state": {}, "param_groups": None} for _ in parts]
        for out, part in zip(merged, parts):
            for fqn, s in part["state"].items():
                if state_keys is not None:
                    s = {k: v for k, v in s.items() if k in state_keys}
                if (wanted_set is None or fqn in wanted_set) and s:
                    out["state"][fqn] = fmt.decode_tree(s, shard)
            if out["param_groups"] is None:
                out["param_groups"] = fmt.decode_tree(part["param_groups"], {})
    if merged is None:
        raise fmt.CheckpointError(f"checkpoint {folder} has no section {section!r}")
    return merged if is_list else merged[0]


def restart_count() -> int:
    """How many times torchrun (``--max-restarts``) has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def param_names(stages: Sequence[nn.Module], args: ModelArgs, ep_rank: int, ep_size: int) -> dict[int, str]:
    """``id(param) -> name`` that is the same on every rank holding the same tensor, whatever the DP size.

    Model-level names (``layers.3.attn.wq_a.weight``); routed-expert tensors hold one expert range per
    EP rank, so their names carry it (``...experts.w1@0-4``). Under EPLB a rank holds physical slots,
    but checkpoints keep the logical layout, so the name carries the rank's logical range as without EPLB
    (``expert_range(args, ep_rank, ep_size)``).
    """
    names: dict[int, str] = {}
    for st in stages:
        for name, p in st.named_parameters():
            if id(p) in names:
                continue
            if is_expert_param(name):
                ids = _expert_ids(st, name)
                if ids is not None and not isinstance(ids, range):  # EPLB slots: saved as the logical range
                    ids = expert_range(args, ep_rank, ep_size)
                name = f"{name}@{ids.start}-{ids.stop}" if ids is not None else name
            names[id(p)] = name
    return names


def _expert_ids(stage, param_name: str) -> range | None:
    module = stage
    for part in param_name.split(".")[:-1]:
        module = getattr(module, part)
        if hasattr(module, "expert_ids"):
            return module.expert_ids
    return None
