"""``recipes.export_hf`` on DeepSeek-V4: a V4 run's per-rank shards, and a V4 HF folder in DeepSeek's released layout
(FP8 + UE8M0, MXFP4), exported to transformers' layout load in transformers' ``DeepseekV4ForCausalLM`` with our
logits; ``recipes.generate`` on the export decodes as transformers does; V3-only paths name a V4 checkpoint in one
line."""

from __future__ import annotations

import json

import pytest
import torch

from models.deepseek_v4 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
from recipes import export_hf
from recipes import generate as generate_cli
from training.checkpoint import CheckpointManager
from training.config import load_config
from training.data import build_tokenizer

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers >= 5.25 ships DeepSeek-V4")
from transformers import DeepseekV4ForCausalLM  # noqa: E402

# a tiny V4 (window, CSA, HCA layers, hash and scored routing, 4 streams, MTP); dims multiples of 32 (MXFP4 blocks)
TINY = dict(dim=64, n_heads=8, moe_inter_dim=32, head_dim=32, q_lora_rank=32, index_head_dim=32, vocab_size=256)


def _randomised(model: Transformer) -> Transformer:
    """Fresh values everywhere (sinks, position and mHC biases, router biases too), so a misplaced tensor shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith(("attn_sink", "ape", "_base")) else 0.1)
        for layer in model.layers:
            if not layer.ffn.gate.hash:
                layer.ffn.gate.bias.normal_(0, 0.1)
    return model


def _logits_in_transformers(path, tokens: torch.Tensor) -> torch.Tensor:
    hf = DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager").float()
    with torch.no_grad():
        return hf(tokens).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.timeout(240)
def test_a_v4_run_exports_to_transformers(tmp_path, capsys):
    """A V4 run's checkpoint (each EP rank's slice of the routed experts, as ``Trainer.state_dict()['model']`` holds
    a V4 model's) is stitched and written in transformers' layout: every tensor back bit for bit, and transformers'
    logits equal ours. fp32 throughout, the same operations: 1e-5 covers summation order (test_v4_checkpoint)."""
    cfg = load_config(None, ["model.preset=debug_v4", *(f"model.overrides.{k}={v}" for k, v in TINY.items()),
                             "parallel.dp=2", "parallel.ep=2", "data.seq_len=160", "data.global_batch=4"])
    torch.manual_seed(0)
    full = _randomised(Transformer(ModelArgs.preset("debug_v4", **TINY)))
    ref = full.state_dict()
    per = full.args.n_routed_experts // 2
    for rank in (1, 0):
        model = {k: (v[rank * per:(rank + 1) * per] if ".experts." in k else v).clone() for k, v in ref.items()}
        CheckpointManager(tmp_path / "ck", rank=rank, world_size=2, async_save=False).save(
            7, {"model": model}, {"full_config": cfg.to_dict(), "config": {"x": 1}})
    assert export_hf.main([str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert "exported step 7" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["n_routed_experts"] == full.args.n_routed_experts
    back = load_hf_checkpoint(None, tmp_path / "hf")
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref[k]), k
    tokens = torch.randint(0, full.args.vocab_size, (2, 150))  # CSA selects (index_topk 8 of 37), HCA closes one
    with torch.no_grad():
        ours = full(tokens)
    assert _rel(_logits_in_transformers(tmp_path / "hf", tokens), ours) < 1e-5


@pytest.mark.timeout(240)
def test_a_released_v4_folder_converts_to_transformers_and_generates_alike(tmp_path, capsys):
    """DeepSeek's released layout, quantised (FP8 + UE8M0, routed experts MXFP4), converted by ``export_hf`` to
    transformers' layout: transformers' logits equal ours from the dequantised release (1e-5: fp32, summation
    order); ``recipes.generate`` on the export prints transformers' greedy tokens; ``--fp8`` writes the release back,
    bit for bit (every value sits on its grid already)."""
    torch.manual_seed(1)
    model = _randomised(Transformer(ModelArgs.preset("debug_v4", **TINY)))
    save_hf_checkpoint(model, tmp_path / "release", layout="release", quantize=True)
    released = load_hf_checkpoint(None, tmp_path / "release")
    assert export_hf.main([str(tmp_path / "release"), "--out", str(tmp_path / "hf")]) == 0
    assert "(an HF folder)" in capsys.readouterr().out
    weights = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.layers.0.self_attn.") for k in weights)  # transformers' names
    tokens = torch.randint(0, 256, (1, 140))
    with torch.no_grad():
        ours = released(tokens)
    assert _rel(_logits_in_transformers(tmp_path / "hf", tokens), ours) < 1e-5

    prompt = "the quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 8 new tokens close a CSA window
    assert generate_cli.main(["--checkpoint", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    hf = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    ids = torch.tensor([list(prompt.encode())])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert printed == prompt + build_tokenizer("byte", "--tokenizer").decode(theirs[0, ids.shape[1]:].tolist())

    assert export_hf.main([str(tmp_path / "hf"), "--out", str(tmp_path / "again"), "--fp8"]) == 0
    for name in ("layers.1.attn.wq_b.weight", "layers.1.ffn.experts.0.w1.weight"):
        a = _tensor(tmp_path / "release", name)
        b = _tensor(tmp_path / "again", name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _tensor(path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    file = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(path / file, "pt") as f:
        return f.get_tensor(key)


def test_v3_only_paths_name_a_v4_checkpoint_in_one_line(tmp_path, capsys):
    """A V3 HF folder is not something export_hf converts; a V4 folder given to V3's loader names V4's."""
    from models.deepseek_v3 import ModelArgs as V3Args

    v3 = tmp_path / "v3"
    v3.mkdir()
    (v3 / "config.json").write_text(json.dumps(V3Args.preset("debug_tiny").to_hf_config()))
    assert export_hf.main([str(v3), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an HF checkpoint folder" in err[0] and not (tmp_path / "x").exists()
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps(ModelArgs.preset("debug_v4").to_hf_config()))
    with pytest.raises(ValueError, match="deepseek_v4"):
        V3Args.from_hf_config(v4)


def test_a_v4_checkpoint_cannot_start_a_v3_run(tmp_path, capsys):
    """``model.init_from`` pointing at a V4 folder with a V3 preset is refused by the launch's checks (the dry run
    too), in one line naming both, before anything runs."""
    from recipes import train

    folder = tmp_path / "v4"
    save_hf_checkpoint(Transformer(ModelArgs.preset("debug_v4")), folder)
    status = train.main(["--config", "recipes/configs/tiny_cpu.toml", "--dry-run", "--set",
                         f"model.init_from={folder}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "is a DeepSeek-V4 checkpoint" in err[0] and "model.preset='debug'" in err[0]
