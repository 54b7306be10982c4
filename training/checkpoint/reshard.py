"""Resume under another layout: every rank reads what it now owns, by global name and global expert id.

A checkpoint holds, per saved rank, the model tensors of its pipeline stages under the Transformer's
names (routed experts as the rows of that rank's logical expert range, ``E / ep`` experts), and its
optimizer states keyed by parameter name (expert parameters qualified by their range, ``...w1@4-8``;
under ZeRO-1 only the rank's shard). Nothing in it depends on how the next run is laid out, so any
valid (pp, dp, ep, schedule, EPLB, ZeRO-1) can read it:

- :class:`CheckpointIndex` lists where each name lives (which saved ranks, which expert rows);
- a non-expert tensor is read whole from one saved rank that has it; an expert tensor is assembled from
  the row slices of the saved ranks whose ranges overlap this rank's (``safe_open(...).get_slice``:
  only those bytes are read);
- optimizer moments (any dtype: fp32 or BF16, and the host EMA) follow their parameter the same way;
  group hyper-parameters come from the saved optimizer of the same kind (dense or expert);
- LR scheduler, sampler and step are global (the sampler's position is in global batches, so another
  data-parallel size reads the batches the run would have read); the RNG state of saved rank
  ``r mod saved_world``; EPLB's plan only when the saved stage/expert layout is the same (otherwise the
  run starts from the initial plan: EPLB moves experts, not the math).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.deepseek_v3 import ModelArgs
from training.checkpoint import format as fmt
from training.checkpoint.manager import check_config, read_metadata
from training.config import ParallelConfig
from training.optim import is_expert_param
from training.parallel import RankCoords, coords
from training.stages import expert_range

EXPERT_SEP = "@"


def split_expert_name(name: str) -> tuple[str, range | None]:
    """``"a.experts.w1@4-8"`` -> ("a.experts.w1", range(4, 8)); a name without a range -> (name, None)."""
    base, sep, rows = name.rpartition(EXPERT_SEP)
    if not sep:
        return name, None
    start, stop = (int(x) for x in rows.split("-"))
    return base, range(start, stop)


class CheckpointIndex:
    """The saved layout of a checkpoint folder and lazy, sliced reads of its shards."""

    def __init__(self, folder: Path, args) -> None:
        self.folder = Path(folder)
        self.metadata = read_metadata(self.folder)
        full = fmt.decode_tree(self.metadata["full_config"], {})
        self.saved_parallel = ParallelConfig(**full["parallel"])
        self.saved_eplb = bool(full.get("eplb", {}).get("enabled", False))
        self.records = {int(rec["rank"]): rec for rec in self.metadata["ranks"]}
        self.world = len(self.records)
        self.coords = {r: coords(r, self.saved_parallel) for r in self.records}
        self.expert_rows = {r: expert_range(args, c.ep_rank, self.saved_parallel.ep) for r, c in self.coords.items()}
        self._files: dict[tuple[str, int], Any] = {}

    def _file(self, section: str, rank: int):
        key = (section, rank)
        if key not in self._files:
            name = fmt.shard_filename(section, rank)
            if name not in self.records[rank]["files"]:
                raise fmt.CheckpointError(f"checkpoint {self.folder}: rank {rank} saved no tensors for {section!r}")
            self._files[key] = safe_open(str(self.folder / name), framework="pt")
        return self._files[key]

    def read(self, section: str, rank: int, ref: Any, rows: range | None = None) -> Any:
        """The value a skeleton leaf ``ref`` names (a tensor, or its rows ``rows``), else the decoded leaf."""
        if not (isinstance(ref, dict) and "__tensor__" in ref):
            return fmt.decode_tree(ref, {})
        f = self._file(section, rank)
        if rows is None:
            return f.get_tensor(ref["__tensor__"])
        return f.get_slice(ref["__tensor__"])[rows.start:rows.stop]

    def rows_of(self, section: str, rank: int, ref: Any) -> int | None:
        """The first dimension of the tensor a skeleton leaf names (read from the header), or None."""
        if not (isinstance(ref, dict) and "__tensor__" in ref):
            return None
        shape = self._file(section, rank).get_slice(ref["__tensor__"]).get_shape()
        return shape[0] if shape else None

    def skeleton(self, rank: int, section: str) -> Any:
        return self.records[rank]["sections"].get(section)

    def rng(self, rank: int) -> Any:
        return fmt.decode_tree(self.records[rank % self.world].get("extra", {}), {}).get("rng")


def _rows(wanted: range, have: range) -> tuple[range, range] | None:
    """(rows of ``have``'s tensor, rows of the output) where the global ranges overlap, or None."""
    lo, hi = max(wanted.start, have.start), min(wanted.stop, have.stop)
    if lo >= hi:
        return None
    return range(lo - have.start, hi - have.start), range(lo - wanted.start, hi - wanted.start)


def _assemble(parts: list[tuple[range, torch.Tensor]], wanted: range, what: str, folder: Path) -> torch.Tensor:
    """Rows ``wanted`` (global expert ids) from ``(out rows, tensor)`` slices; every row must be covered."""
    covered = sorted((r.start, r.stop) for r, _ in parts)
    pos = 0
    for a, b in covered:
        if a > pos:
            break
        pos = max(pos, b)
    if pos < len(wanted):
        raise fmt.CheckpointMismatchError(f"checkpoint {folder} lacks experts {wanted.start + pos}.. of {what}")
    first = parts[0][1]
    out = torch.empty((len(wanted), *first.shape[1:]), dtype=first.dtype)
    for rows, t in parts:
        out[rows.start:rows.stop] = t
    return out


def model_state(index: CheckpointIndex, wanted: Mapping[str, Any], expert_rows: range | None,
                is_expert: Any) -> dict[str, torch.Tensor]:
    """The tensors named ``wanted`` (this rank's stages), experts as the rows ``expert_rows``."""
    holders: dict[str, list[int]] = {}
    for r in sorted(index.records):
        for k in index.skeleton(r, "model") or {}:
            holders.setdefault(k, []).append(r)
    out: dict[str, torch.Tensor] = {}
    missing = [k for k in wanted if k not in holders]
    if missing:
        raise fmt.CheckpointMismatchError(f"checkpoint {index.folder} has no model tensor {missing[0]!r} "
                                          f"(and {len(missing) - 1} more): another model")
    for k in wanted:
        if not is_expert(k) or expert_rows is None:
            r = holders[k][0]
            out[k] = index.read("model", r, index.skeleton(r, "model")[k])
            continue
        parts, seen = [], set()
        for r in holders[k]:
            have = index.expert_rows[r]
            hit = _rows(expert_rows, have)
            if hit is None or (have.start, have.stop) in seen:  # replicas of the same rows: read once
                continue
            seen.add((have.start, have.stop))
            src, dst = hit
            parts.append((dst, index.read("model", r, index.skeleton(r, "model")[k], src)))
        out[k] = _assemble(parts, expert_rows, k, index.folder)
    return out


def _saved_optimizer_entries(index: CheckpointIndex) -> dict[str, list[tuple[int, int, range | None, Any]]]:
    """Base parameter name -> [(saved rank, optimizer index, expert rows or None, per-parameter skeleton)]."""
    out: dict[str, list[tuple[int, int, range | None, Any]]] = {}
    for r in sorted(index.records):
        for i, opt in enumerate(index.skeleton(r, "optimizer") or []):
            for fqn, skel in opt["state"].items():
                base, rows = split_expert_name(fqn)
                out.setdefault(base, []).append((r, i, rows, skel))
    return out


def _saved_groups(index: CheckpointIndex) -> dict[str, dict[str, Any]]:
    """Base parameter name -> the hyper-parameters of the saved group that held it."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(index.records):
        for opt in index.skeleton(r, "optimizer") or []:
            for group in opt["param_groups"]:
                hyper = fmt.decode_tree({k: v for k, v in group.items() if k != "params"}, {})
                for fqn in group["params"]:
                    out.setdefault(split_expert_name(fqn)[0], hyper)
    return out


def optimizer_state(index: CheckpointIndex, param_groups: list[list[str]]) -> dict[str, Any]:
    """A name-keyed optimizer state (``load_named_optimizer_state``'s input) for parameters named as in
    ``param_groups`` (this rank's groups of one optimizer), assembled from whichever saved ranks hold them.
    Before the first optimizer step nothing was saved; the result then has no per-parameter state."""
    entries = _saved_optimizer_entries(index)
    groups = _saved_groups(index)
    state: dict[str, Any] = {}
    named_groups = []
    for names in param_groups:
        base0 = split_expert_name(names[0])[0]
        if base0 not in groups:
            raise fmt.CheckpointMismatchError(f"checkpoint {index.folder} has no optimizer group holding {base0!r}")
        named_groups.append({**groups[base0], "params": list(names)})
        for fqn in names:
            base, rows = split_expert_name(fqn)
            found = entries.get(base, [])
            if not found:
                continue
            if rows is None:
                r, _, _, skel = found[0]
                state[fqn] = {k: index.read("optimizer", r, v) for k, v in skel.items()}
                continue
            per_key: dict[str, list[tuple[range, torch.Tensor]]] = {}
            scalars: dict[str, Any] = {}
            seen = set()
            for r, _, have, skel in found:
                hit = _rows(rows, have)
                if hit is None or (have.start, have.stop) in seen:
                    continue
                seen.add((have.start, have.stop))
                src, dst = hit
                for k, v in skel.items():
                    if index.rows_of("optimizer", r, v) == len(have):  # moments, EMA: expert rows
                        per_key.setdefault(k, []).append((dst, index.read("optimizer", r, v, src)))
                    elif k not in scalars:  # "step" and other per-parameter scalars: the same on every shard
                        scalars[k] = index.read("optimizer", r, v)
            state[fqn] = {**scalars, **{k: _assemble(p, rows, f"{fqn} {k}", index.folder) for k, p in per_key.items()}}
    return {"state": state, "param_groups": named_groups}


def read_resharded(folder: Path, args: ModelArgs, par: ParallelConfig, at: RankCoords, expect_config: dict[str, Any],
                   model_keys: Iterable[str], optimizer_groups: list[list[list[str]]], eplb: bool
                   ) -> tuple[int, dict[str, Any], Any]:
    """(step, state, RNG state) of ``folder`` for the rank at ``at`` of the layout ``par``, whatever layout
    wrote it: the state as ``Trainer.state_dict`` gives it (model tensors ``model_keys``, this rank's expert
    rows; each optimizer's name-keyed states for its parameter groups ``optimizer_groups``, names from
    ``resume.local_param_groups``); with ``eplb``, the saved plan too when the saved layout gave a rank this
    rank's stage and experts. The RNG state is the saved rank's of this number, if there is one."""
    index = CheckpointIndex(folder, args)
    saved_config = fmt.decode_tree(index.metadata.get("config"), {}) if "config" in index.metadata else None
    if isinstance(saved_config, dict) and "parallel" in saved_config:
        expect_config = {**expect_config, "parallel": saved_config["parallel"]}  # the layout may change, nothing else
    check_config(index.metadata, expect_config, index.folder)
    rows = expert_range(args, at.ep_rank, par.ep) if args.n_routed_experts else None
    model = model_state(index, dict.fromkeys(model_keys), rows, is_expert_param)
    ref = min(index.records)
    state = {"model": model, "optimizer": [optimizer_state(index, groups) for groups in optimizer_groups]}
    for section in ("lr_scheduler", "sampler", "trainer"):
        state[section] = fmt.decode_tree(index.skeleton(ref, section), {})
    saved = index.saved_parallel
    same_experts = (saved.pp, saved.ep, saved.schedule) == (par.pp, par.ep, par.schedule) and index.saved_eplb
    if eplb and same_experts:  # the plan of a saved rank with this rank's stage and experts
        src = next(r for r, sc in index.coords.items() if (sc.pp_rank, sc.ep_rank) == (at.pp_rank, at.ep_rank))
        state["eplb"] = fmt.decode_tree(index.skeleton(src, "eplb"), _AllTensors(index, "eplb", src))
    return int(index.metadata["step"]), state, index.rng(at.rank)


class _AllTensors(Mapping):
    """A saved rank's tensors of one section, read on demand (for ``decode_tree``)."""

    def __init__(self, index: CheckpointIndex, section: str, rank: int) -> None:
        self.index, self.section, self.rank = index, section, rank

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.index.read(self.section, self.rank, {"__tensor__": key})

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0
