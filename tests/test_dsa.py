"""DeepSeek-V3.2 sparse attention (DSA) in the model: the lightning indexer and its loss against float64 math,
the V3.2 checkpoint layout against transformers' ``DeepseekV32ForCausalLM``, V3 -> V3.2 starts, the two
stages' invariants (warm-up == V3, top-k >= length == dense) and cached generation == full recompute."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v3.indexer import causal_topk, flat_rows, index_scores, indexer_kl
from tests.test_model import randomize

# debug_tiny with an indexer: 16 heads, so a key scores exactly 0 (every head's ReLU at 0, a tie in the top-k)
# with probability 2^-16, not 2^-4; top-8 of up to 40 keys
DSA_TINY = dict(index_n_heads=16, index_head_dim=16, index_topk=8)


def _kl_float64(q_abs, kv, q_i, k_i, w, rows, sm_scale):
    """The definition, one query at a time in float64: p = mean over heads of the main softmax over the query's
    candidates, q = softmax of I over them, KL(p || q) = sum p log(p / q); mean over queries."""
    total = 0.0
    for t in range(rows.shape[0]):
        keys = rows[t][rows[t] >= 0].long()
        p = (torch.einsum("hc,kc->hk", q_abs[t].double(), kv[keys].double()) * sm_scale).softmax(-1).mean(0)
        scores = (w[t].double()[:, None] * torch.einsum("hd,kd->hk", q_i[t], k_i[keys]).relu()).sum(0)
        total = total + (p * (p.log() - scores.log_softmax(-1))).sum()
    return total / rows.shape[0]


@pytest.mark.parametrize("tokens,keys,topk,chunk", [(13, 29, 7, 4), (40, 40, 40, 256), (9, 17, 17, 3)])
def test_indexer_kl_and_gradients_match_float64(tokens, keys, topk, chunk):
    g = torch.Generator().manual_seed(tokens * 100 + keys)
    h, hi, d, c = 3, 5, 12, 20
    q_abs = torch.randn(tokens, h, c, generator=g, requires_grad=True)
    kv = torch.randn(keys, c, generator=g, requires_grad=True)
    q_i = torch.randn(tokens, hi, d, generator=g, requires_grad=True)
    k_i = torch.randn(keys, d, generator=g, requires_grad=True)
    w = torch.randn(tokens, hi, generator=g, requires_grad=True)
    # distinct candidate rows per query, a random count 1..topk of them valid, -1 (invalid) after
    rows = torch.stack([torch.randperm(keys, generator=g)[:topk] for _ in range(tokens)]).int()
    counts = torch.randint(1, topk + 1, (tokens,), generator=g)
    rows = torch.where(torch.arange(topk)[None, :] < counts[:, None], rows, -1)
    got = indexer_kl(q_abs, kv, q_i, k_i, w, rows, 0.3, chunk=chunk)
    got.backward()
    ref_inputs = [t.detach().double().requires_grad_() for t in (q_i, k_i, w)]
    want = _kl_float64(q_abs.detach(), kv.detach(), *ref_inputs, rows, 0.3)
    want.backward()
    # fp32 products over <= 20 terms and softmaxes over <= 40: relative rounding ~1e-6; a wrong mask, head
    # average or normalisation moves the loss by >1e-2
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()) + 1e-7
    for name, t, ref in zip(("q_i", "k_i", "w"), (q_i, k_i, w), ref_inputs):
        err = (t.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()
        assert err < 1e-5, f"d{name}: {err:.3g}"
    assert q_abs.grad is None and kv.grad is None  # the main attention's side is the target: detached


def test_index_scores_and_causal_topk_match_literal_rule():
    g = torch.Generator().manual_seed(7)
    b, s, n, hi, d, start = 2, 5, 11, 4, 8, 6
    q, k, w = torch.randn(b, s, hi, d, generator=g), torch.randn(b, n, d, generator=g), torch.randn(b, s, hi, generator=g)
    scores = index_scores(q, k, w)
    want = torch.einsum("bsh,bshn->bsn", w.double(), torch.einsum("bshd,bnd->bshn", q.double(), k.double()).clamp_min(0))
    assert torch.allclose(scores.double(), want, rtol=1e-5, atol=1e-6)
    topk = 8
    idx = causal_topk(scores, topk, start_pos=start)
    assert idx.dtype == torch.int32 and idx.shape == (b, s, topk)
    for bi in range(b):
        for i in range(s):
            visible = start + i + 1  # keys 0..start+i
            order = sorted(range(visible), key=lambda j: -want[bi, i, j].item())[:topk]
            got = [j for j in idx[bi, i].tolist() if j >= 0]
            assert sorted(got) == sorted(order)
            assert idx[bi, i].tolist().count(-1) == max(0, topk - visible)
    rows = flat_rows(idx, n)  # batch element 1's keys are rows n.. of the flattened batch
    assert rows.shape == (b * s, topk) and torch.equal(rows[:s], idx[0])
    assert torch.equal(rows[s:], torch.where(idx[1] >= 0, idx[1] + n, -1))


def test_v3_config_unchanged_and_v32_config_round_trips():
    v3 = ModelArgs.preset("debug_tiny")
    cfg = v3.to_hf_config()
    assert cfg["model_type"] == "deepseek_v3" and "index_topk" not in cfg and cfg["rope_interleave"] is True
    v32 = ModelArgs.preset("debug_tiny", **DSA_TINY)
    cfg = v32.to_hf_config()
    assert cfg["model_type"] == "deepseek_v32" and cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (16, 16, 8)
    assert ModelArgs.from_hf_config(cfg, init_std=v32.init_std) == v32  # init_std is not in config.json
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelArgs.preset("debug_tiny", q_lora_rank=0, **DSA_TINY)
    with pytest.raises(ValueError, match="dsa_warmup"):
        ModelArgs.preset("debug_tiny", dsa_warmup=True)


def test_v3_checkpoint_starts_v32_with_fresh_indexer(tmp_path: Path):
    v3 = randomize(Transformer(ModelArgs.preset("debug_tiny")))
    save_hf_checkpoint(v3, tmp_path)
    args = ModelArgs.preset("debug_tiny", **DSA_TINY, dsa_warmup=True)
    with pytest.raises(ValueError, match="missing"):
        load_hf_checkpoint(args, tmp_path)
    model = load_hf_checkpoint(args, tmp_path, fresh_indexer=True)
    ours = model.state_dict()
    for name, t in v3.state_dict().items():
        assert torch.equal(ours[name], t), name
    idx = model.layers[0].attn.indexer
    assert torch.equal(idx.k_norm.weight, torch.ones(16)) and torch.equal(idx.k_norm.bias, torch.zeros(16))
    assert 0.5 * args.init_std < idx.wq_b.weight.std() < 2 * args.init_std
    # the dense warm-up attends as V3 does: same logits as the V3 model
    tokens = torch.randint(0, args.vocab_size, (2, 23))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), v3.eval()(tokens))
    save_hf_checkpoint(model, tmp_path / "v32")
    with pytest.raises(ValueError, match="V3.2 checkpoint"):
        load_hf_checkpoint(args, tmp_path / "v32", fresh_indexer=True)
    again = load_hf_checkpoint(None, tmp_path / "v32")
    assert again.args.index_topk == 8 and torch.equal(again.layers[0].attn.indexer.wk.weight, idx.wk.weight)
