"""Training config: TOML loading, --set overrides, validation that names the key, hashing."""

import pytest
import tomllib

from training.checkpoint import format as fmt
from training.config import (
    TrainConfig,
    check_world_size,
    dump_toml,
    load_config,
    numerics_dict,
    parse_override,
)

DEMO = "recipes/configs/tiny_cpu.toml"
PIPE = ["parallel.schedule=dualpipev", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2"]


def test_demo_config_is_the_issue_layout():
    cfg = load_config(DEMO)
    p = cfg.parallel
    assert (p.pp, p.dp, p.ep, p.schedule) == (2, 2, 2, "dualpipev")
    assert cfg.run.nproc == p.world_size == 4
    assert cfg.model.fp8 and cfg.balance.strategy == "aux_free" and cfg.data.source == "bundled"
    assert cfg.checkpoint.async_save and cfg.checkpoint.interval > 0


@pytest.mark.parametrize("path", ["recipes/configs/debug_gpu.toml", "recipes/configs/deepseek_v3_671b.toml"])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.parallel.world_size == cfg.run.nproc


def test_671b_config_is_v3_layout():
    cfg = load_config("recipes/configs/deepseek_v3_671b.toml")
    p, o = cfg.parallel, cfg.optim
    assert (p.pp, p.ep, p.schedule, p.zero1) == (16, 64, "dualpipe", True)
    assert cfg.model.fp8 and (o.betas, o.weight_decay, o.clip_grad) == ((0.9, 0.95), 0.1, 1.0)
    assert cfg.global_batch_at(cfg.run.steps - 1) == 15360  # (its schedules: tests/test_schedule.py)


def test_overrides_parse_as_toml_values():
    assert parse_override("optim.lr=3e-4") == (["optim", "lr"], 3e-4)
    assert parse_override("model.fp8=false") == (["model", "fp8"], False)
    assert parse_override("optim.betas=[0.8, 0.9]") == (["optim", "betas"], [0.8, 0.9])
    assert parse_override("data.source=/tmp/x.bin") == (["data", "source"], "/tmp/x.bin")  # bare string
    cfg = load_config(DEMO, ["optim.lr=3e-4", "model.overrides.n_layers=6", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 3e-4 and cfg.model.overrides["n_layers"] == 6 and cfg.optim.betas == (0.8, 0.9)


@pytest.mark.parametrize("override, names", [
    ("optim.lrr=1", "optim.lrr"),  # unknown key, with a suggestion
    ("optimizer.lr=1", "optimizer"),  # unknown section
    ("optim.lr=fast", "optim.lr"),  # wrong type
    ("data.micro_batch=true", "data.micro_batch"),
    ("parallel.ep=3", "parallel.ep"),  # must divide dp
    ("parallel.schedule=gpipe", "parallel.schedule"),
    ("data.global_batch=4", "data.global_batch"),  # 1 micro-batch per rank: too few for dualpipev at pp=2
    ("data.global_batch=6", "data.global_batch"),  # not a multiple of dp x micro_batch
    ("optim.min_lr=1.0", "optim.lr"),
    ("data.batch_ramp_start=8", "data.batch_ramp_start"),  # below 2 x pp micro-batches per dp rank
    ("run.dtype=float16", "run.dtype"),
    ("model.fp8_recipe=fp4", "model.fp8_recipe"),  # blockwise | mxfp8
])
def test_bad_values_name_the_key(override, names):
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        load_config(DEMO, [override])


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"did you mean 'optim\.lr'"):
        load_config(DEMO, ["optim.lrr=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_world_size_must_be_pp_times_dp():
    cfg = load_config(DEMO)
    check_world_size(cfg.parallel, 4)
    with pytest.raises(ValueError, match=r"world size 3 != parallel.pp x parallel.dp = 2 x 2 = 4"):
        check_world_size(cfg.parallel, 3)


def test_batch_ramp_respects_the_schedule():
    cfg = load_config(DEMO, ["data.global_batch=64", "data.batch_ramp_start=16", "data.batch_ramp_steps=10"])
    sizes = [cfg.global_batch_at(s) for s in range(12)]
    assert sizes[0] == 16 and sizes[-1] == 64 and sizes == sorted(sizes)
    for s in range(12):  # every ramp step is a valid DualPipeV micro-batch count (>= 2 x pp) per dp rank
        assert cfg.microbatches_at(s) >= 4 and cfg.global_batch_at(s) % (cfg.parallel.dp * cfg.data.micro_batch) == 0


def test_toml_round_trip_and_hash():
    cfg = load_config(DEMO, ["optim.lr=1e-3"])
    again = load_config(None, [])
    assert fmt.config_hash(numerics_dict(cfg)) != fmt.config_hash(numerics_dict(again))
    text = cfg.to_toml()
    table = tomllib.loads(text)
    assert table["optim"]["lr"] == 1e-3 and table["parallel"]["schedule"] == "dualpipev"
    assert dump_toml({"a": {"x": 1, "y": None}}).strip() == "[a]\nx = 1"  # None (TOML has no null) = default
    # logging, checkpointing and the step count do not change the numerics: same hash
    same = load_config(DEMO, ["optim.lr=1e-3", "logging.wandb=disabled", "run.steps=7", "checkpoint.interval=3"])
    assert fmt.config_hash(numerics_dict(same)) == fmt.config_hash(numerics_dict(cfg))


def test_defaults_are_valid():
    cfg = TrainConfig()
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.weight_decay == 0.1 and cfg.optim.clip_grad == 1.0


def test_fp8_recipe_reaches_the_fp8_layers():
    from models.deepseek_v3 import Transformer
    from training.trainer import model_args

    args = model_args(load_config(DEMO, ["model.fp8=true", "model.fp8_recipe=mxfp8", "model.preset=debug_tiny"]))
    assert args.fp8 == "mxfp8" and args.fp8_cache
    assert Transformer(args).layers[0].attn.wkv_b.fp8 == "mxfp8"
    assert model_args(load_config(DEMO, ["model.fp8=false", "model.fp8_recipe=mxfp8"])).fp8 is False
