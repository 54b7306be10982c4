"""KV-cache generation: the absorbed MLA decode (latent cache, FlashMLA path for bf16) gives the naive
forward's logits; generation equals re-running the whole prefix; the CLI runs on a saved checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from models.deepseek_v3 import ModelArgs, Transformer, save_hf_checkpoint
from models.deepseek_v3.generate import LatentKVCache, forward_cached, generate
from tests.test_model import randomize

ARGS = ModelArgs.preset("debug_tiny")


def _decode_in_steps(model, tokens, prefill: int, block_table=None):
    b, s = tokens.shape
    cache = LatentKVCache(model, b, s + 3, block_table=block_table)
    outs = [forward_cached(model, tokens[:, :prefill], cache, 0)]
    pos = prefill
    for step in (1, 2, 1, 3):  # mixed chunk sizes: single-token decode and multi-token (MTP-style) steps
        if pos >= s:
            break
        outs.append(forward_cached(model, tokens[:, pos:pos + step], cache, pos))
        pos += step
    while pos < s:
        outs.append(forward_cached(model, tokens[:, pos:pos + 1], cache, pos))
        pos += 1
    return torch.cat(outs, dim=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefill,seq", [(5, 12), (63, 70), (1, 9)])
def test_absorbed_decode_matches_naive_fp32(prefill: int, seq: int):
    model = randomize(Transformer(ARGS), bias_low=-0.5).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, seq))
    with torch.no_grad():
        naive = model(tokens)
    # permuted pages: the cache must follow the block table, not assume contiguous blocks
    blocks = -(-(seq + 3) // 64)
    table = torch.randperm(2 * blocks + 3)[: 2 * blocks].to(torch.int32).view(2, blocks)
    got = _decode_in_steps(model, tokens, prefill, table)
    # fp32 both ways; absorbing wkv_b changes only the summation order: ~1e-7 relative
    rel = ((got - naive).norm() / naive.norm()).item()
    assert rel < 1e-5, rel


@pytest.mark.timeout(120)
def test_absorbed_decode_through_flash_mla_bf16():
    model = randomize(Transformer(ARGS))
    model = model.to(torch.bfloat16).eval()
    for m in model.modules():
        bias = getattr(m, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            m.e_score_correction_bias = bias.float()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 20))
    with torch.no_grad():
        naive = model(tokens).float()
    got = _decode_in_steps(model, tokens, 14).float()
    # bf16 activations with different rounding points (latent vs expanded K/V; 8-bit mantissa): measured
    # ~4e-3 relative; 3e-2 still fails for any masking/position error (those give O(1) differences)
    rel = ((got - naive).norm() / naive.norm()).item()
    assert rel < 3e-2, rel


@pytest.mark.timeout(60)
def test_greedy_generation_equals_full_recompute():
    model = randomize(Transformer(ARGS)).eval()
    prompt = torch.randint(0, ARGS.vocab_size, (2, 6))
    out = generate(model, prompt, max_new_tokens=8)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):  # reference: no cache, whole prefix each step
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_respects_top_k():
    model = randomize(Transformer(ARGS)).eval()
    prompt = torch.randint(0, ARGS.vocab_size, (1, 4))
    a = generate(model, prompt, 6, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, generate(model, prompt, 6))  # top-1 sampling is greedy
    b = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(5))
    c = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(b, c)


def test_bad_generation_input():
    model = Transformer(ARGS).eval()
    with pytest.raises(ValueError, match="prompt"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_len"):
        LatentKVCache(model, 1, ARGS.max_seq_len + 1)
    with pytest.raises(ValueError, match="block_table"):
        LatentKVCache(model, 2, 70, block_table=torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.timeout(120)
def test_generate_cli(tmp_path: Path, capsys):
    from recipes.generate import main

    model = Transformer(ARGS)
    save_hf_checkpoint(model, tmp_path)
    assert main(["--checkpoint", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def f(x):") and "5 tokens" in out.err
    assert main(["--checkpoint", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0"]) == 2


# ------------------------------------------------------------------------------- the CLI's bad input: one line, exit 2
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    save_hf_checkpoint(Transformer(ARGS), path)
    return path


def _corrupt(folder: Path, case: str) -> None:
    if case == "config_garbage":
        (folder / "config.json").write_text("{not json")
    elif case == "config_list":
        (folder / "config.json").write_text("[1, 2]")
    elif case == "config_value":
        (folder / "config.json").write_text((folder / "config.json").read_text().replace(
            '"hidden_size": 32', '"hidden_size": -32'))
    elif case == "index":
        (folder / "model.safetensors.index.json").write_text("garbage")
    elif case == "shard":
        shard = next(folder.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-100])
    elif case == "training_checkpoint":
        (folder / "metadata.json").write_text("{}")
    elif case == "tokenizer":
        (folder / "tokenizer.json").write_text('{"model": 3')


GENERATE_BAD = {  # case: (extra arguments, what the one line must say)
    "missing": (["--checkpoint", "{tmp}/missing"], "is not a folder"),
    "config_garbage": ([], "config.json is not readable JSON"),
    "config_list": ([], "config.json holds a JSON list"),
    "config_value": ([], "config.json: ModelArgs.dim must be > 0, got -32"),
    "index": ([], "model.safetensors.index.json is not a readable safetensors index"),
    "shard": ([], "cannot read {ck}/model-00001-of-00001.safetensors"),
    "tokenizer": (["--tokenizer", "{ck}/tokenizer.json"], "tokenizer.json' is not a valid tokenizer.json"),
    "training_checkpoint": ([], "is a training checkpoint; export it first: python -m recipes.export_hf"),
    "top_k_0": (["--top-k", "0", "--temperature", "1"], "--top-k must be >= 1"),
    "top_k_negative": (["--top-k", "-3"], "--top-k must be >= 1"),
    "top_k_not_int": (["--top-k", "2.5"], "argument --top-k: invalid int value: '2.5'"),
    "temperature": (["--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    "temperature_nan": (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    "max_new_tokens": (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    "prompt_too_long": (["--prompt", "x" * 500],
                        "is 500 tokens; with --max-new-tokens 64 that is 564 positions, more than the model's "
                        "max_seq_len 512"),
    "device": (["--device", "gpu7"], "--device 'gpu7' is not a torch device"),
}


@pytest.mark.parametrize("case", sorted(GENERATE_BAD))
@pytest.mark.timeout(60)
def test_generate_bad_input_is_one_line_and_exit_2(hf_dir, tmp_path, capsys, case):
    import shutil

    from recipes.generate import main

    ck = tmp_path / "ck"
    shutil.copytree(hf_dir, ck)
    _corrupt(ck, case)
    extra, expect = GENERATE_BAD[case]
    argv = ["--checkpoint", str(ck), "--prompt", "def f(x):"] + [a.format(tmp=tmp_path, ck=ck) for a in extra]
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own checks (types, choices) exit from parse_args
        status = exc.code
    out = capsys.readouterr()
    err = out.err.splitlines()
    assert status == 2 and out.out == "" and len(err) == 1, (status, out)
    assert re.match(r"^(python -m recipes.generate: )?error: ", err[0]) and expect.format(ck=ck) in err[0], err[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_generate_corrupt_shard_through_the_real_cli(hf_dir, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    ck = tmp_path / "ck"
    shutil.copytree(hf_dir, ck)
    _corrupt(ck, "shard")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "DSV3_KERNEL_IMPL": "reference"}
    proc = subprocess.run([sys.executable, "-m", "recipes.generate", "--checkpoint", str(ck), "--prompt", "x"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "model-00001-of-00001.safetensors" in proc.stderr, proc.stderr
