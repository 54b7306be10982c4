"""HF-format checkpoint IO: bit-exact round trips, FP8 dequantisation, streaming a stage or an expert
slice (other shards never opened), and errors that name the key and the expected shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deep_gemm
from models.deepseek_v3 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v3.checkpoint import INDEX_NAME, dequantize_fp8_blocks
from tests.test_model import randomize

ARGS = ModelArgs.preset("debug_tiny")


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Transformer, Path]:
    torch.manual_seed(3)
    model = randomize(Transformer(ARGS))
    path = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(model, path, max_shard_bytes=40_000)  # many shards: layers land in different files
    return model, path


def test_layout_has_released_key_names(saved):
    model, path = saved
    index = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    assert len(set(index.values())) > 3
    mtp = f"model.layers.{ARGS.n_layers}"
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
                "model.layers.1.mlp.shared_experts.up_proj.weight", f"{mtp}.enorm.weight", f"{mtp}.hnorm.weight",
                f"{mtp}.eh_proj.weight", f"{mtp}.shared_head.norm.weight", f"{mtp}.shared_head.head.weight",
                f"{mtp}.embed_tokens.weight", f"{mtp}.mlp.experts.0.gate_proj.weight"):
        assert key in index, key
    t = _all_tensors(path)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    e = model.layers[1].ffn.experts
    torch.testing.assert_close(t["model.layers.1.mlp.experts.5.up_proj.weight"], e.w13[5, ARGS.moe_inter_dim:],
                               rtol=0, atol=0)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["rope_scaling"]["type"] == "yarn"


def test_round_trip_is_bit_exact(saved, tmp_path):
    model, path = saved
    loaded = load_hf_checkpoint(None, path)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    save_hf_checkpoint(loaded, tmp_path)
    first, second = _all_tensors(path), _all_tensors(tmp_path)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))


def test_bf16_checkpoint_keeps_router_bias_fp32(saved, tmp_path):
    model, _ = saved
    save_hf_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    loaded = load_hf_checkpoint(None, tmp_path, dtype=torch.bfloat16)
    assert loaded.layers[1].attn.wkv_b.weight.dtype == torch.bfloat16
    assert loaded.layers[1].ffn.gate.e_score_correction_bias.dtype == torch.float32


def test_fp8_blocks_dequantised_on_load(saved, tmp_path):
    model, _ = saved
    save_hf_checkpoint(model, tmp_path, fp8=True)
    t = _all_tensors(tmp_path)
    w = t["model.layers.1.self_attn.kv_b_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn
    assert t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (1, 1)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router unquantised, as released
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    loaded = load_hf_checkpoint(None, tmp_path)
    # independent dequantisation: per 128x128 block, value * scale_inv
    want = w.float() * t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].item()
    assert torch.equal(loaded.layers[1].attn.wkv_b.weight, want)
    orig = model.layers[1].attn.wkv_b.weight
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4, so the tensor's rel err is well under 7%
    assert ((loaded.layers[1].attn.wkv_b.weight - orig).norm() / orig.norm()).item() < 0.07


# The released DeepSeek-V3 checkpoint: FP8 (e4m3 + weight_scale_inv) exactly for the decoder blocks' attention
# projections and MLP / expert projections; everything else BF16 (MTP's eh_proj included), the router bias FP32.
_RELEASED_FP8 = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                           r"o_proj)|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight")


def test_fp8_save_writes_the_released_layout(saved, tmp_path):
    model, _ = saved
    save_hf_checkpoint(model, tmp_path, fp8=True)
    t = _all_tensors(tmp_path)
    eh_proj = f"model.layers.{ARGS.n_layers}.eh_proj.weight"
    assert t[eh_proj].dtype == torch.bfloat16 and f"{eh_proj}_scale_inv" not in t
    weights = [k for k in t if not k.endswith("_scale_inv")]
    assert sum(bool(_RELEASED_FP8.fullmatch(k)) for k in weights) > 20
    for key in weights:
        if _RELEASED_FP8.fullmatch(key):
            assert t[key].dtype == torch.float8_e4m3fn and t[f"{key}_scale_inv"].dtype == torch.float32, key
        else:
            want = torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16
            assert t[key].dtype == want and f"{key}_scale_inv" not in t, key
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the unquantised eh_proj is the trained one rounded to BF16, nothing else
    assert torch.equal(t[eh_proj], model.mtp[0].eh_proj.weight.detach().bfloat16())


def test_exports_with_an_fp8_eh_proj_still_load(saved, tmp_path):
    """Exports written before eh_proj stayed BF16 hold it as e4m3 + weight_scale_inv: dequantised on load."""
    model, path = saved
    eh_proj = f"model.layers.{ARGS.n_layers}.eh_proj.weight"

    def quantise(t):
        t[eh_proj], t[f"{eh_proj}_scale_inv"] = deep_gemm.per_block_cast_to_fp8(t[eh_proj].float())

    _rewrite(tmp_path, path, quantise)
    t = _all_tensors(tmp_path)
    loaded = load_hf_checkpoint(None, tmp_path)
    assert torch.equal(loaded.mtp[0].eh_proj.weight, dequantize_fp8_blocks(t[eh_proj], t[f"{eh_proj}_scale_inv"]))
    assert torch.equal(loaded.layers[1].attn.wkv_b.weight, model.layers[1].attn.wkv_b.weight)


def test_fp8_training_keeps_eh_proj_a_bf16_gemm():
    with torch.device("meta"):
        model = Transformer(ARGS.replace(fp8=True))
    assert model.layers[1].attn.wkv_b.fp8 and model.mtp[0].block.attn.wo.fp8  # the blocks' GEMMs are FP8
    assert not model.mtp[0].eh_proj.fp8 and not model.mtp[0].eh_proj.fp8_cache  # as in V3: eh_proj is not


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (7, 129)])
def test_fp8_block_codec(shape):
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # wildly different column scales
    q, s = deep_gemm.per_block_cast_to_fp8(w)  # what save_hf_checkpoint(fp8=True) writes
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8_blocks(q, s)
    blocks_max = torch.nn.functional.pad(w.abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
    # per element: error <= half an e4m3 step at the block's scale (amax/448 * 2^-3 * 2^exp) -> <= amax/16
    bound = blocks_max.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)).amax(dim=(1, 3)) / 16
    full = bound.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert ((back - w).abs() <= full + 1e-12).all()
    with pytest.raises(ValueError, match="scale_inv"):
        dequantize_fp8_blocks(q, s[:, :1] if s.shape[1] > 1 else torch.ones(2, 2))


def test_streams_only_one_stage_and_expert_slice(saved, tmp_path):
    model, path = saved
    # copy only the shards that hold layer 2 (and nothing else): a stage loader must not need the rest
    index = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    experts = range(4, 6)
    needed_keys = {k for k in index if k.startswith("model.layers.2.")
                   and (".mlp.experts." not in k or int(k.split(".")[5]) in experts)}
    needed_files = {index[k] for k in needed_keys}
    for f in needed_files:
        (tmp_path / f).write_bytes((path / f).read_bytes())
    (tmp_path / INDEX_NAME).write_text((path / INDEX_NAME).read_text())
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert len(needed_files) < len(set(index.values()))
    with torch.device("meta"):
        stage = Transformer(ARGS, expert_ids=experts)
    stage.materialize([stage.layers[2]], "cpu", init=False)
    for p in stage.layers[2].parameters():
        p.data.fill_(float("nan"))  # anything not loaded stays NaN and fails below
    load_hf_checkpoint(stage, tmp_path)
    ref = model.layers[2]
    got = stage.layers[2]
    assert torch.equal(got.ffn.experts.w13, ref.ffn.experts.w13[4:6])
    assert torch.equal(got.ffn.experts.w2, ref.ffn.experts.w2[4:6])
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters()):
        if ".experts." not in n:
            assert torch.equal(a, b), n
    assert stage.layers[0].attn.wo.weight.is_meta and stage.embed.weight.is_meta


def _rewrite(path: Path, src: Path, edit) -> None:
    tensors = _all_tensors(src)
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text((src / "config.json").read_text())


def test_missing_key_names_key_and_shape(saved, tmp_path):
    _, path = saved
    _rewrite(tmp_path, path, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight \(expected shape \(32, 16\)"):
        load_hf_checkpoint(None, tmp_path)


def test_extra_key_is_an_error(saved, tmp_path):
    _, path = saved
    _rewrite(tmp_path, path, lambda t: t.update({"model.layers.9.mlp.gate.weight": torch.zeros(8, 32)}))
    with pytest.raises(ValueError, match=r"unexpected key.*model\.layers\.9\.mlp\.gate\.weight"):
        load_hf_checkpoint(None, tmp_path)


def test_shape_mismatch_names_key_and_expected_shape(saved, tmp_path):
    _, path = saved
    _rewrite(tmp_path, path, lambda t: t.update({"model.layers.2.mlp.experts.3.up_proj.weight": torch.zeros(16, 31)}))
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight has shape \(16, 31\); expected \(16, 32\)"):
        load_hf_checkpoint(None, tmp_path)


def test_integer_dtype_is_an_error(saved, tmp_path):
    _, path = saved
    _rewrite(tmp_path, path, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype torch\.int32"):
        load_hf_checkpoint(None, tmp_path)


def test_fp8_without_scale_is_an_error(saved, tmp_path):
    _, path = saved

    def drop_scale(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].to(
            torch.float8_e4m3fn)

    _rewrite(tmp_path, path, drop_scale)
    with pytest.raises(ValueError, match=r"o_proj\.weight is FP8 but .*weight_scale_inv is missing"):
        load_hf_checkpoint(None, tmp_path)


def test_config_mismatch_is_caught_by_shapes(saved, tmp_path):
    _, path = saved
    other = ARGS.replace(kv_lora_rank=24)
    with pytest.raises(ValueError, match="expected"):
        load_hf_checkpoint(other, path)
