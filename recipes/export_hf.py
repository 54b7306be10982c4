"""Turn a training checkpoint into an HF DeepSeek-V3 checkpoint (config.json + safetensors shards + index).

    python -m recipes.export_hf runs/<run>/checkpoints            # newest valid checkpoint -> <folder>/hf
    python -m recipes.export_hf runs/<run>/checkpoints/step_000000200 --out /models/mine --dtype bfloat16

The per-rank ``model`` shards of a PP x EP x DP run are stitched into one whole model on the CPU:
pipeline stages contribute their layers, expert-parallel ranks their slice of every stacked expert
tensor (``training.parallel.coords`` + ``training.stages.expert_range`` say which), data-parallel
replicas are read once. Every tensor of the model must be covered, shapes must agree, else a
ValueError names the key. A run with BF16 working weights (``optim.master_dtype = "float32"``) keeps the
model's true weights as the optimizer's FP32 ``master`` states: those replace the BF16 parameters.
``models.deepseek_v3.save_hf_checkpoint`` then writes the HF layout that ``load_hf_checkpoint``,
transformers and the reference inference code read.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from accel.cli import HelpFormatter
from models.deepseek_v3 import Transformer
from models.deepseek_v3.checkpoint import save_hf_checkpoint
from training.checkpoint import CheckpointManager, CheckpointMismatchError
from training.checkpoint import format as fmt
from training.checkpoint.manager import read_metadata
from training.checkpoint.resume import LazyShard, gather_named_optimizer_state


def train_config_of(metadata: dict[str, Any]):
    """The ``TrainConfig`` a checkpoint was written under (``full_config`` in its metadata)."""
    from training.config import dump_toml, load_config

    if "full_config" not in metadata:
        raise ValueError("checkpoint metadata has no 'full_config': it was not written by training.trainer, "
                         "so the model shape is unknown; expected a checkpoint of recipes.train")
    table = fmt.decode_tree(metadata["full_config"], {})
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(dump_toml(table))
    try:
        return load_config(f.name)
    finally:
        Path(f.name).unlink()


def assemble_model(folder: str | Path, dtype: torch.dtype | None = None) -> Transformer:
    """The whole model of checkpoint ``folder``, on the CPU, from every rank's ``model`` shard, with the FP32
    master weights in place of BF16 working weights when the run kept them (then in float32 by default)."""
    from training.checkpoint.reshard import split_expert_name
    from training.parallel import coords
    from training.stages import expert_range
    from training.trainer import DTYPES, model_args

    folder = Path(folder)
    metadata = read_metadata(folder)
    cfg = train_config_of(metadata)
    args = model_args(cfg)
    masters = cfg.optim.master_dtype != "param"
    model = Transformer(args).to(dtype or (DTYPES[cfg.optim.master_dtype] if masters else DTYPES[cfg.run.dtype]))
    full = model.state_dict(keep_vars=False)
    covered: dict[str, torch.Tensor] = {k: torch.zeros(v.shape[0] if v.dim() else 1, dtype=torch.bool)
                                        for k, v in full.items()}
    par = cfg.parallel
    for record in metadata["ranks"]:
        skeleton = record["sections"].get("model")
        if skeleton is None:
            continue
        name = fmt.shard_filename("model", record["rank"])
        experts = expert_range(args, coords(record["rank"], par).ep_rank, par.ep) if par.ep > 1 else None
        tensors = fmt.decode_tree(skeleton, LazyShard(folder / name))
        for key, value in tensors.items():
            _place(full, covered, key, value, experts, f"rank {record['rank']}'s model shard")
    missing = [k for k, c in covered.items() if not bool(c.all())]
    if missing:
        raise CheckpointMismatchError(f"checkpoint {folder} does not cover {len(missing)} model tensors, e.g. "
                                      f"{missing[:4]}; expected every pipeline stage and expert slice to be saved")
    # (a checkpoint taken before the first optimizer step has no masters: the BF16 weights are the masters then)
    if masters and any("optimizer" in r["sections"] for r in metadata["ranks"]):
        for part in gather_named_optimizer_state(folder, "optimizer", state_keys=["master"]):
            for fqn, state in part["state"].items():
                key, rows = split_expert_name(fqn)
                _place(full, covered, key, state["master"], rows, "the optimizer's master weights")
    return model


def _place(full: dict[str, torch.Tensor], covered: dict[str, torch.Tensor], key: str, value: torch.Tensor,
           experts: range | None, source: str) -> None:
    if key not in full:
        raise CheckpointMismatchError(f"{source} has {key!r}, which this model config lacks")
    target = full[key]
    if value.shape == target.shape:
        with torch.no_grad():
            target.copy_(value)
        covered[key][:] = True
    elif experts is not None and value.dim() >= 1 and value.shape[0] == len(experts) \
            and value.shape[1:] == target.shape[1:]:
        with torch.no_grad():
            target[experts.start:experts.stop].copy_(value)
        covered[key][experts.start:experts.stop] = True
    else:
        raise CheckpointMismatchError(f"{source}: {key!r} has shape {tuple(value.shape)}, the model "
                                      f"expects {tuple(target.shape)} (or an expert slice of it)")


def export(checkpoint: str | Path, out: str | Path | None = None, dtype: str | None = None,
           fp8: bool = False) -> Path:
    """Export ``checkpoint`` (a checkpoint folder, or a checkpoints root: its newest valid one) to ``out``."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a folder; expected a step_* folder or a checkpoints root")
    if not (path / fmt.METADATA_FILE).is_file():
        found = CheckpointManager(path).find_latest_valid()
        if found is None:
            raise ValueError(f"no valid checkpoint under {str(path)!r}")
        path = found
    else:
        bad = CheckpointManager(path.parent).verify(path)
        if bad is not None:
            raise fmt.CheckpointCorruptError(f"checkpoint {path} is invalid: {bad[1]}", Path(bad[0]))
    torch_dtype = getattr(torch, dtype) if dtype else None
    if dtype and not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"--dtype {dtype!r} is not a torch dtype; expected e.g. bfloat16 or float32")
    model = assemble_model(path)
    out = Path(out) if out else path / "hf"
    save_hf_checkpoint(model, out, dtype=torch_dtype, fp8=fp8)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m recipes.export_hf", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("checkpoint", help="a step_* checkpoint folder, or a checkpoints root (newest valid one)")
    ap.add_argument("--out", default=None, help="output folder (default: <checkpoint>/hf)")
    ap.add_argument("--dtype", default=None, help="cast floating weights (e.g. bfloat16); default: as trained")
    ap.add_argument("--fp8", action="store_true", help="store GEMM weights as e4m3 + 128x128 block scales")
    ns = ap.parse_args(argv)
    out = export(ns.checkpoint, ns.out, ns.dtype, ns.fp8)
    print(f"HF checkpoint written to {out}")


if __name__ == "__main__":
    main()
