"""Turn a training checkpoint into an HF DeepSeek-V3 or V4 checkpoint (config.json + safetensors shards + index).

    python -m recipes.export_hf runs/<run>/checkpoints                 # newest valid -> runs/<run>/exports/step_N
    python -m recipes.export_hf runs/<run>/checkpoints/step_000000200 --out /models/mine --dtype bfloat16
    python -m recipes.export_hf runs/<run>/checkpoints --fp8 --out /models/mine --overwrite   # the released layout
    python -m recipes.export_hf /models/DeepSeek-V4-Flash --out /models/v4-transformers      # V4: release -> HF

DeepSeek-V4 (a run of a V4 preset, or a V4 HF checkpoint folder in either layout: DeepSeek's release, FP8 and
MXFP4 dequantised, or transformers'): written in transformers' ``DeepseekV4ForCausalLM`` layout, MTP under the
release's ``mtp.*`` names (transformers skips them); ``--fp8`` writes DeepSeek's released layout and formats instead
(``models.deepseek_v4.save_hf_checkpoint(..., layout="release", quantize=True)``: e4m3 + UE8M0 128x128 scales,
routed experts MXFP4). A V4 folder is loaded whole on the CPU (fine for tests and small models; the released
284B needs that much host memory in ``--dtype``).

Where it writes: ``--out``, by default ``RUN/exports/step_N`` beside the checkpoints folder
(``RUN/checkpoints/step_N`` -> ``RUN/exports/step_N``), which retention never touches (a checkpoint
outside a ``RUN/checkpoints`` folder has no default: ``--out`` is required). An ``--out``
inside the checkpoints folder being read (or any folder holding a ``latest`` pointer), inside a checkpoint
(a folder holding ``metadata.json``), or holding the checkpoint being read is refused: retention, a
rollback or a re-save of the step would delete it.
A non-empty ``--out`` is refused unless ``--overwrite``, and even then only when it holds an HF
checkpoint (``config.json``); its old shards and index are replaced as a whole and its other files
(a ``tokenizer.json``, a README) are kept. The export is written to a temporary folder beside
``--out`` and renamed into place, so a failed export leaves ``--out`` as it was.

Weights: ``--dtype`` ``bfloat16`` or ``float32`` (default: as trained); ``--fp8`` writes the released
V3 layout (block GEMM weights as e4m3 + a ``weight_scale_inv`` per 128x128 block; embedding, head,
norms, router and MTP's ``eh_proj`` unquantised in ``--dtype``, default bfloat16). Other dtypes
(``int8``, ``float16``, ...) are refused: they cannot hold the weights.

The per-rank ``model`` shards of a PP x EP x DP run are stitched into one whole model on the CPU:
pipeline stages contribute their layers, expert-parallel ranks their slice of every stacked expert
tensor (``training.parallel.coords`` + ``training.stages.expert_range`` say which), data-parallel
replicas are read once. Every tensor of the model must be covered, shapes must agree, else a
ValueError names the key. A run with BF16 working weights (``optim.master_dtype = "float32"``) keeps the
model's true weights as the optimizer's FP32 ``master`` states: those replace the BF16 parameters.
``models.deepseek_v3.save_hf_checkpoint`` then writes the HF layout that ``load_hf_checkpoint``,
transformers and the reference inference code read. The checkpoint is only read, never changed.

Exit status: 0 after a complete export (one line names the step, the checkpoint folder and ``--out``);
2 (``accel.cli.BAD_INPUT``) with one line ``error: ...`` for bad input: a missing, incomplete or corrupt
checkpoint, a refused ``--out``, an unsupported ``--dtype``; 1 (``FAILED``), one line, when writing
failed (disk full, ...): ``--out`` is then as it was.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError

from accel.cli import BAD_INPUT, FAILED, OK, ArgumentParser, check_output_dir
from models import deepseek_v4
from models.deepseek_v3 import Transformer
from models.deepseek_v3.checkpoint import INDEX_NAME, save_hf_checkpoint
from models.deepseek_v4.args import hf_model_type
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


def assemble_model(folder: str | Path, dtype: torch.dtype | None = None) -> Transformer | deepseek_v4.Transformer:
    """The whole model of checkpoint ``folder``, on the CPU, from every rank's ``model`` shard, with the FP32
    master weights in place of BF16 working weights when the run kept them (then in float32 by default); a V4
    preset's run gives a ``models.deepseek_v4.Transformer`` (its routed experts stitched from the EP slices alike)."""
    from training.checkpoint.reshard import split_expert_name
    from training.parallel import coords
    from training.stages import expert_range
    from training.trainer import DTYPES, model_args

    folder = Path(folder)
    metadata = read_metadata(folder)
    cfg = train_config_of(metadata)
    args = model_args(cfg)
    masters = cfg.optim.master_dtype != "param"
    build = deepseek_v4.Transformer if isinstance(args, deepseek_v4.ModelArgs) else Transformer
    model = build(args).to(dtype or (DTYPES[cfg.optim.master_dtype] if masters else DTYPES[cfg.run.dtype]))
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


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "bf16": torch.bfloat16,
                 "fp32": torch.float32}
EXPORT_FILES = ("config.json", INDEX_NAME)  # with the *.safetensors shards: what an export consists of


def export(checkpoint: str | Path, out: str | Path | None = None, dtype: str | None = None,
           fp8: bool = False, overwrite: bool = False) -> Path:
    """Export ``checkpoint`` (a checkpoint folder, or a checkpoints root: its newest valid one) to ``out``
    (default ``default_out``); returns ``out``. ValueError for anything refused, before any work."""
    torch_dtype = export_dtype(dtype)
    folder = find_checkpoint(checkpoint)
    target = output_folder(folder, out, overwrite)
    write_export(folder, target, torch_dtype, fp8)
    return target


def export_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r} cannot hold the trained weights; expected bfloat16 or float32 "
                         "(--fp8 for the released block-scaled e4m3 layout)")
    return EXPORT_DTYPES[dtype]


def find_checkpoint(checkpoint: str | Path) -> Path:
    """The step folder to export: ``checkpoint`` itself when it holds ``metadata.json`` (verified), else the
    newest valid checkpoint under it. Read-only: unlike a ``CheckpointManager`` it creates and sweeps nothing
    (a live run may be writing into the folder)."""
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a folder; expected a step_* folder or a checkpoints root")
    if (path / "config.json").is_file() and not (path / fmt.METADATA_FILE).is_file():
        if hf_model_type(path) != "deepseek_v4":
            raise ValueError(f"checkpoint {str(path)!r} is an HF checkpoint folder (config.json, model_type "
                             f"{hf_model_type(path)!r}), not a training checkpoint; export_hf converts training "
                             "checkpoints, and DeepSeek-V4 HF folders between layouts")
        return path
    if (path / fmt.METADATA_FILE).is_file():
        bad = _verify(path)
        if bad is not None:
            raise ValueError(f"checkpoint {path} is invalid: {bad[1]} (file {bad[0]})")
        return path
    latest = fmt.read_pointer(path, fmt.LATEST_FILE)
    steps = [s for s in fmt.committed_steps(path) if latest is None or s <= latest]
    invalid = []
    for step in reversed(steps):
        folder = path / fmt.step_dirname(step)
        bad = _verify(folder)
        if bad is None:
            for line in invalid:
                print(f"warning: {line}; exporting the newest valid one, {folder.name}", file=sys.stderr)
            return folder
        invalid.append(f"checkpoint {folder} is invalid ({bad[1]}; file {bad[0]})")
    if invalid:
        raise ValueError(f"no valid checkpoint under {str(path)!r}: {'; '.join(invalid)}")
    raise ValueError(f"no checkpoint under {str(path)!r}; expected a step_* folder holding "
                     f"{fmt.METADATA_FILE}, or a checkpoints root holding such folders")


def _verify(folder: Path) -> tuple[str, str] | None:
    # CheckpointManager.verify reads only ``verify_mode``: a reader needs no manager, which would start a writer
    # on the root (and, on rank 0, may sweep its staging folders: a live run's save in progress)
    return CheckpointManager.verify(SimpleNamespace(verify_mode="full"), folder)


def default_out(folder: Path) -> Path:
    """``RUN/exports/step_N`` for checkpoint ``RUN/checkpoints/step_N`` (a run folder's layout, as the trainer
    writes it): beside the checkpoints root. Elsewhere there is no default (ValueError: pass ``--out``)."""
    if folder.parent.name != "checkpoints":
        raise ValueError(f"checkpoint {folder} is not in a RUN/checkpoints folder, so there is no default output "
                         "folder (RUN/exports/step_N); pass --out")
    return folder.parent.parent / "exports" / folder.name


def output_folder(folder: Path, out: str | Path | None, overwrite: bool) -> Path:
    """``out`` (default ``default_out(folder)``) checked: outside every checkpoints folder, writable, and
    empty or (with ``overwrite``) an earlier HF export."""
    option = "--out" if out is not None else "the default output folder"
    target = Path(out).expanduser() if out is not None else default_out(folder)
    resolved, source = target.resolve(), folder.resolve()
    # a training checkpoint's parent is its checkpoints root (retention); an HF folder's parent is anyone's
    for root in (source.parent, source) if (folder / fmt.METADATA_FILE).is_file() else (source,):
        if resolved == root or resolved.is_relative_to(root):
            raise ValueError(f"{option} {str(target)!r} is inside the checkpoint folder {str(root)!r}, whose "
                             "retention deletes what it holds; choose a folder outside it")
    if source.is_relative_to(resolved):
        raise ValueError(f"{option} {str(target)!r} holds the checkpoint being exported ({folder}); choose "
                         "another folder")
    for parent in (resolved, *resolved.parents):
        if (parent / fmt.METADATA_FILE).is_file() or (parent / fmt.LATEST_FILE).is_file():
            raise ValueError(f"{option} {str(target)!r} is inside the checkpoints folder {str(parent)!r}, whose "
                             "retention deletes what it holds; choose a folder outside it")
    check_output_dir(target, option)
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ValueError(f"{option} {str(target)!r} is not empty; pass --overwrite to replace the HF "
                             "checkpoint in it, or choose an empty or new folder")
        if not (target / "config.json").is_file():
            raise ValueError(f"{option} {str(target)!r} is not empty and holds no HF checkpoint (no config.json); "
                             "--overwrite replaces only an earlier export")
    return target


def write_export(folder: Path, out: Path, dtype: torch.dtype | None, fp8: bool) -> None:
    """Assemble checkpoint ``folder`` (or load a V4 HF folder) and write it to a temporary folder beside ``out``,
    then swap it in: a failed export leaves ``out`` untouched; an earlier export's shards are replaced, its other
    files kept. V4 goes to transformers' layout, or with ``fp8`` to DeepSeek's released layout and formats."""
    hf = not (folder / fmt.METADATA_FILE).is_file()
    model = deepseek_v4.load_hf_checkpoint(None, folder, dtype=dtype) if hf else assemble_model(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        if isinstance(model, deepseek_v4.Transformer):
            deepseek_v4.save_hf_checkpoint(model, tmp, layout="release" if fp8 else "transformers", dtype=dtype,
                                           quantize=fp8)
        else:
            save_hf_checkpoint(model, tmp, dtype=dtype, fp8=fp8)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    out.rename(old)  # two renames: at every instant one complete export sits at ``out`` or beside it
    tmp.rename(out)
    for entry in old.iterdir():
        if entry.name not in EXPORT_FILES and entry.suffix != ".safetensors":
            entry.rename(out / entry.name)
    shutil.rmtree(old)


def step_of(folder: Path) -> int | str:
    if not (folder / fmt.METADATA_FILE).is_file():
        return "(an HF folder)"
    step = fmt.parse_step_dirname(folder.name)
    return step if step is not None else read_metadata(folder).get("step", "?")


def _fail(status: int, message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.export_hf", description=__doc__.splitlines()[0],
                        epilog="exit status: 0 exported; 2 bad input (one 'error:' line naming the argument or file);\n"
                               "1 the write failed (--out left as it was)")
    ap.add_argument("checkpoint", help="a step_* checkpoint folder, a checkpoints root (its newest valid one), or a "
                                       "DeepSeek-V4 HF folder")
    ap.add_argument("--out", default=None,
                    help="output folder, outside every checkpoints folder; default: RUN/exports/step_N beside "
                         "RUN/checkpoints")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier HF export in a non-empty --out (its other files are kept)")
    ap.add_argument("--dtype", default=None,
                    help="bfloat16 (bf16) or float32 (fp32) for the weights; default: as trained "
                         "(bfloat16 with --fp8)")
    ap.add_argument("--fp8", action="store_true",
                    help="the released layout: V3's block GEMM weights as e4m3 + 128x128 block scales, the rest "
                         "(embedding, head, norms, router, MTP eh_proj) unquantised; V4's release (e4m3 + UE8M0 "
                         "scales, routed experts MXFP4)")
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dtype = export_dtype(ns.dtype)
        folder = find_checkpoint(ns.checkpoint)
        out = output_folder(folder, ns.out, ns.overwrite)
    except (ValueError, fmt.CheckpointError, OSError) as exc:
        return _fail(BAD_INPUT, str(exc))
    earlier = out.is_dir() and any(out.iterdir())
    try:
        write_export(folder, out, dtype, ns.fp8)
    except (ValueError, fmt.CheckpointError) as exc:  # an incomplete checkpoint, a config this code cannot build
        return _fail(BAD_INPUT, str(exc))
    except (OSError, SafetensorError) as exc:  # the files were verified readable: this is the write (disk full,
        # permissions); safetensors reports its own write errors as SafetensorError
        kept = f"the earlier export in {out} is intact" if earlier else f"nothing was written to {out}"
        return _fail(FAILED, f"the export to {out} failed ({type(exc).__name__}: {exc}); {kept}")
    print(f"exported step {step_of(folder)} (checkpoint {folder}) as an HF checkpoint to {out}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
