"""DeepSeek-V3.1+ checkpoints (``quantization_config.scale_fmt: "ue8m0"``): power-of-two block scales, stored as fp32
or as float8_e8m0fnu, dequantised exactly on load; a scale that is not a power of two is a one-line error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.deepseek_v3 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
from tests.test_model import randomize

KEY = "model.layers.1.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def ue8m0_checkpoint(tmp_path_factory):
    torch.manual_seed(5)
    model = randomize(Transformer(ModelArgs.preset("debug_tiny")))
    path = tmp_path_factory.mktemp("ue8m0")
    save_hf_checkpoint(model, path, fp8=True, scale_fmt="ue8m0")
    return model, path


def _shard_of(path, key):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return path / index[key]


def test_ue8m0_checkpoint_loads_exactly(ue8m0_checkpoint):
    model, path = ue8m0_checkpoint
    assert json.loads((path / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    t = load_file(_shard_of(path, KEY))
    w, s = t[KEY], t[f"{KEY}_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn
    # each scale: the smallest power of two >= the block's amax / 448 (float64 math on the trained weight)
    orig = model.layers[1].attn.wkv_b.weight.detach().double()
    amax = orig.abs().max().item()
    mant, exp = math.frexp(max(amax, 1e-4) / 448)
    assert s.item() == (math.ldexp(1.0, exp - 1) if mant == 0.5 else math.ldexp(1.0, exp))
    loaded = load_hf_checkpoint(None, path)
    # independent float64 dequantisation: e4m3 value x 2^e is exact, so the fp32 load must equal it bit for bit
    assert torch.equal(loaded.layers[1].attn.wkv_b.weight.double(), w.double() * s.double())
    # within e4m3's bound of the trained weight: relative 2^-4 (normal) or 2^-10 x scale (subnormal)
    err = (loaded.layers[1].attn.wkv_b.weight.double() - orig).abs()
    assert (err <= 2.0 ** -4 * orig.abs() + 2.0 ** -10 * s.item()).all()


def test_e8m0_dtype_scales_load_like_fp32_ones(ue8m0_checkpoint, tmp_path):
    """Checkpoints may store the scales as float8_e8m0fnu (one exponent byte): the same weights come back."""
    _, path = ue8m0_checkpoint
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = _shard_of(tmp_path, KEY)
    t = load_file(shard)
    t = {k: v.to(torch.float8_e8m0fnu) if k.endswith("_scale_inv") else v for k, v in t.items()}
    save_file(t, str(shard), metadata={"format": "pt"})
    a, b = load_hf_checkpoint(None, path), load_hf_checkpoint(None, tmp_path)
    assert torch.equal(a.layers[1].attn.wkv_b.weight, b.layers[1].attn.wkv_b.weight)


def test_ue8m0_checkpoint_with_other_scales_is_an_error(ue8m0_checkpoint, tmp_path):
    _, path = ue8m0_checkpoint
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = _shard_of(tmp_path, KEY)
    t = load_file(shard)
    t[f"{KEY}_scale_inv"] = t[f"{KEY}_scale_inv"] * 1.5
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{KEY}_scale_inv: scale_fmt is 'ue8m0' but .* not all powers of two"):
        load_hf_checkpoint(None, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "e5m2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' or absent"):
        load_hf_checkpoint(None, tmp_path)
