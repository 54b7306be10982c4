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
