"""DeepSeek-V4 generation: greedy decoding equals transformers' generate across CSA and HCA window closures,
sampling is seeded, and ``recipes.generate`` runs a V4 checkpoint."""

from __future__ import annotations

import pytest
import torch

from models.deepseek_v4 import ModelArgs, Transformer, save_hf_checkpoint
from models.deepseek_v4.generate import generate
from recipes import generate as generate_cli
from training.data import build_tokenizer

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers >= 5.25 ships DeepSeek-V4")
from transformers import DeepseekV4ForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(ModelArgs.preset("debug_v4", vocab_size=256, init_std=0.2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("v4")
    save_hf_checkpoint(model, path, layout="release")
    return model, path


@pytest.mark.timeout(240)
def test_greedy_generation_equals_transformers(v4_dir):
    model, path = v4_dir
    hf = DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager").float()
    prompt = torch.randint(0, model.args.vocab_size, (2, 125))  # 12 new tokens close a CSA window and HCA's first
    ours = generate(model, prompt, 12)
    # an explicit all-ones mask: else transformers takes prompt tokens equal to pad_token_id for padding
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    theirs = hf.generate(prompt, output_logits=True, return_dict_in_generate=True, **kw)  # its KV-cached decode
    assert torch.equal(ours, theirs.sequences)
    with torch.no_grad():
        full = model(ours)[:, prompt.shape[1] - 1: -1]
    steps = torch.stack(theirs.logits, dim=1)
    # incremental decode against our whole-sequence fp32 forward: the same math in other shapes, so reductions
    # in another order, ~1e-6 relative (measured); 1e-4 leaves margin
    assert ((steps - full).norm() / full.norm()).item() < 1e-4


def test_sampling_is_seeded_and_stops_at_eos(v4_dir):
    model, _ = v4_dir
    prompt = torch.randint(0, model.args.vocab_size, (2, 9))
    a = generate(model, prompt, 5, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 5, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (2, 14)
    greedy = generate(model, prompt, 5)
    eos = int(greedy[0, 9])
    stopped = generate(model, prompt[:1], 5, eos_id=eos)
    assert stopped.shape == (1, 10) and int(stopped[0, -1]) == eos
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        generate(model, prompt, 1, top_k=0)


def test_generate_cli_runs_a_v4_checkpoint(v4_dir, capsys):
    model, path = v4_dir
    assert generate_cli.main(["--checkpoint", str(path), "--prompt", "hello", "--max-new-tokens", "4"]) == 0
    ids = torch.tensor([list(b"hello")])
    expected = generate(model, ids, 4)[0, 5:].tolist()
    out = capsys.readouterr().out
    assert out.startswith("hello") and len(out.rstrip("\n").encode("utf-8", "surrogateescape")) >= 5
    assert out.rstrip("\n") == "hello" + build_tokenizer("byte", "--tokenizer").decode(expected)
