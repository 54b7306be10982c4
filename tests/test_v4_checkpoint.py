"""DeepSeek-V4 checkpoints both ways: transformers' layout and DeepSeek's released one (FP8 + UE8M0, MXFP4).

transformers is the independent reader of the names: it loads both layouts (the released one through its
conversion mapping) and must give our logits. The quantised release files are decoded here bit by bit and
checked against the weights they came from (nearest e2m1 / e4m3 values, smallest power-of-two scales).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.deepseek_v3 import ModelArgs as V3Args
from models.deepseek_v4 import ModelArgs, Transformer
from models.deepseek_v4.checkpoint import FP8_LINEARS, load_hf_checkpoint, save_hf_checkpoint

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers >= 5.25 ships DeepSeek-V4")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402


def _args(**kw) -> ModelArgs:
    # dims are multiples of 32 (MXFP4 blocks); wq_b is 256 x 32 so FP8 spans two 128-row blocks
    return ModelArgs.preset("debug_v4", dim=64, n_heads=8, moe_inter_dim=32, head_dim=32, q_lora_rank=32,
                            index_head_dim=32, init_std=0.1, **kw)


def _model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(_args(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
        for layer in model.layers:
            if not layer.ffn.gate.hash:
                layer.ffn.gate.bias.normal_(0, 0.1)
    return model


def _files(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in set(index.values()):
        out.update(load_file(path / file))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["transformers", "release"])
def test_saved_checkpoint_loads_in_transformers_and_here(tmp_path, layout):
    model = _model()
    tokens = torch.randint(0, model.args.vocab_size, (2, 150))  # 150 tokens: CSA selects, HCA closes a window
    ref = model(tokens)
    save_hf_checkpoint(model, tmp_path, layout=layout, max_shard_bytes=200_000)  # several shards
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    hf = DeepseekV4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float()
    # the same weights and the same fp32 operations: logits agree to fp32 summation-order rounding
    assert ((hf(tokens).logits - ref).norm() / ref.norm()).item() < 1e-5
    # what transformers writes (no MTP) loads here, without MTP layers
    hf.save_pretrained(tmp_path / "by_transformers")
    theirs = load_hf_checkpoint(None, tmp_path / "by_transformers")
    assert theirs.args.n_mtp_layers == 0
    assert ((theirs(tokens) - ref).norm() / ref.norm()).item() < 1e-5
    half = load_hf_checkpoint(None, tmp_path, dtype=torch.bfloat16)  # mHC, sinks, ape, router bias stay fp32
    assert half.embed.weight.dtype == torch.bfloat16 and half.layers[1].attn.compressor.ape.dtype == torch.float32
    assert half.layers[0].hc_attn_fn.dtype == half.layers[1].ffn.gate.bias.dtype == torch.float32
    assert torch.isfinite(half(tokens)).all()
    again = load_hf_checkpoint(None, tmp_path)
    assert again.args.n_mtp_layers == 1  # MTP travels in both layouts (transformers skips it)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _e8m0(t: torch.Tensor) -> torch.Tensor:
    return torch.exp2(t.view(torch.uint8).double() - 127)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 per byte, low nibble first: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
    b = packed.view(torch.uint8).long()
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    sign = 1 - 2 * (nib >> 3).double()
    exp, man = ((nib >> 1) & 3).double(), (nib & 1).double()
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1) * (1 + 0.5 * man))
    return sign * mag


@pytest.mark.timeout(240)
def test_released_format_quantised_and_its_transformers_twin(tmp_path):
    model = _model(seed=1)
    rel, twin = tmp_path / "release", tmp_path / "twin"
    save_hf_checkpoint(model, rel, layout="release", quantize=True)
    cfg = json.loads((rel / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["quantization_config"]["expert_dtype"] == "fp4"
    files = _files(rel)
    ours = dict(model.named_parameters())
    n_fp8 = n_fp4 = 0
    for key, t in files.items():
        if key.endswith(".scale"):
            continue
        if ".ffn.experts." in key:  # MXFP4: [out, in / 2] packed, an E8M0 scale per 32 inputs
            prefix, e, which = key.rsplit(".", 3)[0], int(key.split(".")[-3]), key.split(".")[-2]
            assert t.dtype == torch.float4_e2m1fn_x2
            scale = _e8m0(files[key[: -len("weight")] + "scale"])
            w13, w2 = ours[f"{prefix}.w13"][e].double(), ours[f"{prefix}.w2"][e].double()
            inter = w13.shape[0] // 2
            w = {"w1": w13[:inter], "w3": w13[inter:], "w2": w2}[which].detach()
            x = w.view(w.shape[0], -1, 32) / scale.unsqueeze(-1)
            amax = x.abs().amax(-1)
            assert ((amax >= 4) & (amax < 8)).all()  # OCP MX: scale 2^(floor(log2 amax) - 2)
            q = _e2m1(t).view_as(x)
            x = x.clamp(-6, 6)  # saturating
            grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
            nearest = (x.abs().unsqueeze(-1) - grid).abs().amin(-1)
            assert ((x - q).abs() <= nearest + 1e-12).all(), key  # round to nearest
            n_fp4 += 1
        elif t.dtype == torch.float8_e4m3fn:
            assert FP8_LINEARS.search(key)
            scale = _e8m0(files[key[: -len("weight")] + "scale"])
            full = scale.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            w = ours[key].detach().double()
            x = w / full
            assert (x.abs().amax() <= 448) and ((x.abs() > 0) | (w == 0)).all()
            # e4m3 rounding: half an ulp (2^-4 relative) for normals, 2^-10 absolute in the subnormal range
            err = (t.double() - x).abs()
            assert (err <= torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, 2.0 ** -10))).all(), key
            n_fp8 += 1
        elif key.split(".")[-1].startswith("hc_") or key.endswith(("attn_sink", ".ape", "gate.bias")):
            assert t.dtype == torch.float32, key
        elif t.is_floating_point():
            assert t.dtype == torch.bfloat16, key
    assert n_fp4 == 3 * 8 * (model.args.n_layers + 1) and n_fp8 >= 4 * model.args.n_layers
    # loaded here, the dequantised model; its transformers-layout twin loads in transformers with its logits
    loaded = load_hf_checkpoint(None, rel)
    save_hf_checkpoint(loaded, twin, layout="transformers")
    tokens = torch.randint(0, model.args.vocab_size, (1, 140))
    hf = DeepseekV4ForCausalLM.from_pretrained(twin, attn_implementation="eager").float()
    theirs, mine = hf(tokens).logits, loaded(tokens)
    assert ((theirs - mine).norm() / mine.norm()).item() < 1e-5
    assert torch.equal(load_hf_checkpoint(None, twin)(tokens), mine)
    # written back in the same formats, the same values: MXFP4 bit for bit (OCP's scale rule keeps a block's
    # maximum in [4 s, 8 s)); FP8 bit for bit except where a block's maximum rounded down to 224 s, which the
    # smallest-power-of-two rule then writes as 448 (s / 2) -- the same values
    save_hf_checkpoint(loaded, tmp_path / "again", layout="release", quantize=True)
    again = _files(tmp_path / "again")
    assert again.keys() == files.keys()
    fp8 = {k: k[: -len("weight")] + "scale" for k, t in files.items() if t.dtype == torch.float8_e4m3fn}
    for key, t in files.items():
        assert again[key].dtype == t.dtype, key
        if key not in fp8 and key not in fp8.values():
            assert torch.equal(again[key].view(torch.uint8), t.view(torch.uint8)), key
    for key, scale_key in fp8.items():
        values = [w.double() * _e8m0(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
                  for w, s in ((files[key], files[scale_key]), (again[key], again[scale_key]))]
        assert torch.equal(*values), key


def test_bad_checkpoints_are_named(tmp_path):
    model = _model(seed=2)
    save_hf_checkpoint(model, tmp_path, layout="release")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    file = tmp_path / index["layers.0.attn.wq_a.weight"]
    tensors = load_file(file)
    with pytest.raises(ValueError, match=r"layout='release'"):
        save_hf_checkpoint(model, tmp_path / "x", quantize=True)
    bad = dict(tensors, **{"layers.0.attn.wq_a.weight": tensors["layers.0.attn.wq_a.weight"][:-1]})
    save_file(bad, file)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight has shape"):
        load_hf_checkpoint(None, tmp_path)
    save_file({**tensors, "layers.0.attn.bogus": torch.zeros(1)}, file)
    index_file = tmp_path / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"weight_map": {**index, "layers.0.attn.bogus": file.name}}))
    with pytest.raises(ValueError, match=r"unexpected key.*layers\.0\.attn\.bogus"):
        load_hf_checkpoint(None, tmp_path)
    rest = {k: v for k, v in tensors.items() if k != "layers.0.attn.wq_a.weight"}
    save_file(rest, file)
    index_file.write_text(json.dumps({"weight_map": {k: v for k, v in index.items() if k in rest or k not in tensors}}))
    with pytest.raises(ValueError, match=r"missing.*layers\.0\.attn\.wq_a\.weight \(expected shape \(32, 64\)\)"):
        load_hf_checkpoint(None, tmp_path)
    q = dict(tensors, **{"layers.0.attn.wq_a.weight": tensors["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)})
    save_file(q, file)
    index_file.write_text(json.dumps({"weight_map": index}))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight is quantised"):
        load_hf_checkpoint(None, tmp_path)


def test_config_round_trip_and_v3_points_to_v4(tmp_path):
    for name in ("deepseek_v4_flash", "deepseek_v4_pro", "debug_v4"):
        args = ModelArgs.preset(name)
        assert ModelArgs.from_hf_config(args.to_hf_config()) == args
        # transformers' own serialisation of it reads back the same
        hf_cfg = DeepseekV4Config(**{k: v for k, v in args.to_hf_config().items() if k != "architectures"})
        assert ModelArgs.from_hf_config(hf_cfg.to_dict()) == args.replace(
            compress_ratios=args.compress_ratios[: args.n_layers])
    released = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0],
                "num_hash_layers": 2, "qk_rope_head_dim": 64, "compress_rope_theta": 160000,
                "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                 "beta_fast": 32, "beta_slow": 1}}
    args = ModelArgs.from_hf_config(released)
    assert args.compress_ratios == (0, 4, 128, 4, 0) and args.n_hash_layers == 2 and args.rope_factor == 16
    (tmp_path / "config.json").write_text(json.dumps(released))
    with pytest.raises(ValueError, match=r"DeepSeek-V4 config; read it with models\.deepseek_v4"):
        V3Args.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"compress_ratios.*\[2\]"):
        ModelArgs.from_hf_config({**released, "compress_ratios": [0, 2, 0, 0]})
    with pytest.raises(ValueError, match=r"hidden_act='gelu'; DeepSeek-V4 has 'silu'"):
        ModelArgs.from_hf_config({**released, "hidden_act": "gelu"})
    # fields the model does not use travel through a round trip; a file's quantisation does not
    args = ModelArgs.from_hf_config({**released, "pad_token_id": 7, "quantization_config": {"fmt": "e4m3"}})
    cfg = args.to_hf_config()
    assert cfg["pad_token_id"] == 7 and "quantization_config" not in cfg
