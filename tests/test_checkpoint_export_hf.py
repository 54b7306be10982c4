"""recipes.export_hf: per-rank model shards of an EP-sharded training checkpoint -> one HF checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from models.deepseek_v3 import Transformer, load_hf_checkpoint
from recipes.export_hf import export
from training.checkpoint import CheckpointManager, CheckpointMismatchError


def _config(ep: int):
    from training.config import load_config

    return load_config(Path(__file__).resolve().parents[1] / "recipes/configs/tiny_cpu.toml",
                       ["parallel.pp=1", "parallel.schedule=none", f"parallel.dp={ep}", f"parallel.ep={ep}"])


def _save_like_the_trainer(root, cfg, full: Transformer, drop_key: str | None = None):
    """Each rank saves its experts' slice, as ``Trainer.state_dict()['model']`` holds them."""
    from training.parallel import coords
    from training.stages import expert_range
    from training.trainer import model_args

    args, par = model_args(cfg), cfg.parallel
    ref = full.state_dict()
    managers = [CheckpointManager(root, rank=r, world_size=par.world_size, async_save=False)
                for r in range(par.world_size)]
    for rank in reversed(range(par.world_size)):
        experts = expert_range(args, coords(rank, par).ep_rank, par.ep)
        with torch.device("meta"):
            shaped = Transformer(args, expert_ids=experts).state_dict()
        model = {}
        for k, v in shaped.items():
            model[k] = ref[k][experts.start:experts.stop].clone() if v.shape != ref[k].shape else ref[k].clone()
        if drop_key is not None:
            model.pop(drop_key, None)
        managers[rank].save(10, {"model": model}, {"full_config": cfg.to_dict(), "config": {"x": 1}})


@pytest.mark.timeout(120)
def test_export_stitches_expert_shards_into_an_hf_checkpoint(tmp_path):
    from training.trainer import model_args

    cfg = _config(ep=2)
    torch.manual_seed(0)
    full = Transformer(model_args(cfg))
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()  # fresh values everywhere, so a mis-placed slice cannot match by accident
    _save_like_the_trainer(tmp_path / "ck", cfg, full)
    out = export(tmp_path / "ck", tmp_path / "hf")  # a root: its newest valid checkpoint
    assert json.loads((out / "config.json").read_text())["n_routed_experts"] == full.args.n_routed_experts
    back = load_hf_checkpoint(model_args(cfg), out)
    ref, got = full.state_dict(), back.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k].float(), got[k].float()), k


@pytest.mark.timeout(120)
def test_export_refuses_an_incomplete_checkpoint(tmp_path):
    from training.trainer import model_args

    cfg = _config(ep=2)
    full = Transformer(model_args(cfg))
    key = next(k for k in full.state_dict() if "experts" in k)
    _save_like_the_trainer(tmp_path / "ck", cfg, full, drop_key=key)
    with pytest.raises(CheckpointMismatchError, match="does not cover"):
        export(tmp_path / "ck" / "step_000000010", tmp_path / "hf")
    with pytest.raises(ValueError, match="not a folder"):
        export(tmp_path / "missing")


# ------------------------------------------------------------------------------- the CLI: exports that cannot destroy
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """RUN/checkpoints/step_000000010 of a one-process run (tiny_cpu), as the trainer writes it."""
    from training.trainer import model_args

    cfg = _config(ep=1)
    torch.manual_seed(1)
    run = tmp_path_factory.mktemp("run")
    _save_like_the_trainer(run / "checkpoints", cfg, Transformer(model_args(cfg)))
    return run


def _main(capsys, *argv: str) -> tuple[int, str, list[str]]:
    from recipes.export_hf import main

    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err.splitlines()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.timeout(120)
def test_export_cli_default_folder_permissions_and_report(run_dir, capsys):
    step = run_dir / "checkpoints" / "step_000000010"
    before = _tree(run_dir / "checkpoints")
    status, out, err = _main(capsys, run_dir / "checkpoints")
    assert status == 0 and err == []
    target = run_dir / "exports" / "step_000000010"  # beside checkpoints/, where retention never looks
    assert out.strip() == f"exported step 10 (checkpoint {step}) as an HF checkpoint to {target}"
    assert _tree(run_dir / "checkpoints") == before  # the checkpoint is only read
    shards = list(target.glob("*.safetensors"))
    assert shards and (target / "config.json").is_file()
    json_mode = (target / "config.json").stat().st_mode & 0o777
    assert json_mode == (target / "model.safetensors.index.json").stat().st_mode & 0o777
    assert {s.stat().st_mode & 0o777 for s in shards} == {json_mode}
    assert [p.name for p in (run_dir / "exports").iterdir()] == ["step_000000010"]  # no temporary folder left
    status, _, err = _main(capsys, run_dir / "checkpoints")  # again: the default folder is now non-empty
    assert status == 2 and len(err) == 1 and "is not empty; pass --overwrite" in err[0]


@pytest.mark.parametrize("case", ["into_step", "into_root", "over_run", "not_empty", "not_an_export", "int8",
                                  "float16", "no_checkpoint", "corrupt_shard", "no_default"])
@pytest.mark.timeout(120)
def test_export_cli_refusals_are_one_line_and_change_nothing(run_dir, tmp_path, capsys, case):
    ck = run_dir / "checkpoints"
    step = ck / "step_000000010"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    argv, expect = {
        "into_step": ([ck, "--out", step / "hf"], "inside the checkpoint folder"),  # the old default
        "into_root": ([step, "--out", ck / "exports"], "inside the checkpoint folder"),
        "over_run": ([ck, "--out", run_dir, "--overwrite"], "holds the checkpoint being exported"),
        "not_empty": ([ck, "--out", tmp_path / "full"], "is not empty; pass --overwrite"),
        "not_an_export": ([ck, "--out", tmp_path / "full", "--overwrite"], "holds no HF checkpoint"),
        "int8": ([ck, "--out", tmp_path / "o", "--dtype", "int8"], "--dtype 'int8' cannot hold"),
        "float16": ([ck, "--out", tmp_path / "o", "--dtype", "float16"], "expected bfloat16 or float32"),
        "no_checkpoint": ([tmp_path / "missing", "--out", tmp_path / "o"], "is not a folder"),
        "corrupt_shard": ([tmp_path / "ck", "--out", tmp_path / "o"], "sha256 mismatch"),
        "no_default": ([tmp_path / "ck"], "is not in a RUN/checkpoints folder, so there is no default"),
    }[case]
    if case in ("corrupt_shard", "no_default"):
        import shutil

        shutil.copytree(ck, tmp_path / "ck")
    if case == "corrupt_shard":
        shard = next((tmp_path / "ck" / "step_000000010").glob("model-*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = _tree(run_dir), _tree(tmp_path)
    status, out, err = _main(capsys, *argv)
    assert status == 2 and out == "" and len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert (_tree(run_dir), _tree(tmp_path)) == before
    assert not (tmp_path / "o").exists() and not (step / "hf").exists()


@pytest.mark.timeout(120)
def test_export_overwrite_replaces_an_earlier_export_whole(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    stale = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name in [*stale, "config.json", "model.safetensors.index.json"]:
        (out / name).write_text("stale")
    (out / "tokenizer.json").write_text("{}")  # not part of an export: kept
    status, _, err = _main(capsys, run_dir / "checkpoints", "--out", out, "--overwrite", "--dtype", "bf16")
    assert status == 0 and err == []
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
                     "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # neither the new nor the old copy left beside
    assert load_hf_checkpoint(None, out).embed.weight.dtype == torch.float32  # loads (fp32 by default)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.timeout(120)
def test_failed_export_leaves_the_folder_as_it_was(run_dir, tmp_path, capsys, monkeypatch):
    import recipes.export_hf as export_hf

    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")

    def disk_full(model, path, **kw):
        Path(path).mkdir()
        (Path(path) / "model-00001-of-00001.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_hf, "save_hf_checkpoint", disk_full)
    status, _, err = _main(capsys, run_dir / "checkpoints", "--out", out, "--overwrite")
    assert status == 1 and len(err) == 1 and "No space left on device" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and _tree(out) == {"config.json": b"old"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_export_into_the_checkpoint_is_refused_by_the_real_cli(run_dir):
    import os
    import subprocess
    import sys

    step = run_dir / "checkpoints" / "step_000000010"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "recipes.export_hf", str(step), "--out", str(step / "hf")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "inside the checkpoint folder" in proc.stderr, proc.stderr
    assert not (step / "hf").exists()
