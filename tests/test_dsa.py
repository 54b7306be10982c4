"""DeepSeek-V3.2 sparse attention (DSA) in the model: the lightning indexer and its loss against float64 math,
the V3.2 checkpoint layout against transformers' ``DeepseekV32ForCausalLM``, V3 -> V3.2 starts, the two
stages' invariants (warm-up == V3, top-k >= length == dense) and cached generation == full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v3.indexer import attention_target, causal_topk, flat_rows, index_scores, indexer_kl
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
    got = indexer_kl(attention_target(q_abs, kv, rows, 0.3, chunk=chunk), q_i, k_i, w, rows, chunk=chunk)
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
    q, k = torch.randn(b, s, hi, d, generator=g), torch.randn(b, n, d, generator=g)
    w = torch.randn(b, s, hi, generator=g)
    scores = index_scores(q, k, w)
    relu = torch.einsum("bshd,bnd->bshn", q.double(), k.double()).clamp_min(0)
    want = torch.einsum("bsh,bshn->bsn", w.double(), relu)
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rope", ["yarn", "default"])
def test_logits_match_transformers_deepseek_v32(rope: str, tmp_path: Path):
    """An HF-saved random V3.2 checkpoint, top-8 of up to 40 keys: our sparse absorbed attention and indexer
    against transformers' DeepseekV32ForCausalLM (indexer in fp32, top-k folded into its attention mask)."""
    from transformers import DeepseekV32ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    overrides = dict(DSA_TINY) if rope == "yarn" else dict(DSA_TINY, rope_factor=1.0, max_seq_len=256)
    args = ModelArgs.preset("debug_tiny", **overrides)
    torch.manual_seed(3)
    model = randomize(Transformer(args)).eval()
    save_hf_checkpoint(model, tmp_path)
    hf = DeepseekV32ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.model.layers[1].self_attn.indexer.k_norm.bias.abs().sum() > 0  # randomize reached the LayerNorm bias
    dense = Transformer(args.replace(index_topk=0))
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if ".indexer." not in k})
    for batch, seq in ((2, 19), (1, 40)):
        tokens = torch.randint(0, args.vocab_size, (batch, seq))
        with torch.no_grad():
            ours, ref, full = model(tokens), hf(tokens).logits, dense.eval()(tokens)
        # fp32 on both sides, the same top-8 keys chosen (a score tie needs all 16 ReLUs at 0), the attention in
        # the absorbed form here and the naive one there: rel err ~1e-6; 1e-4 is the bar. Sparse
        # differs from dense attention (the last check) by ~1e-1: a wrong selection could not pass.
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, f"{rope} b={batch} s={seq}: rel err {rel:.3g}"
        assert ((full - ref).norm() / ref.norm()).item() > 1e-3


def test_sparse_with_topk_over_length_is_dense_attention():
    """With index_topk >= the sequence every causal key is selected: the sparse absorbed path (forward and
    gradients) equals the dense naive one, which a wrong absorption, scale or row offset would break."""
    args = ModelArgs.preset("debug_tiny", **dict(DSA_TINY, index_topk=64))
    torch.manual_seed(5)
    sparse = randomize(Transformer(args))
    warm = Transformer(args.replace(dsa_warmup=True))
    warm.load_state_dict(sparse.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 21))
    outs = []
    for m in (sparse, warm):
        m.eval()
        logits = m(tokens)
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = outs
    # fp32, the same math with the key up-projection folded into q: ~1e-6 relative
    assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert set(ga) == set(gb)
    for name in ga:
        err = ((ga[name] - gb[name]).norm() / gb[name].norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: {err:.3g}"


def test_generation_with_indexer_cache_equals_full_recompute():
    """Prefill then token-by-token decode through the latent + indexer-key cache (FlashMLA's sparse decoding over
    the paged cache) gives the logits of running the whole sequence at once (each query's top-k over its prefix)."""
    from models.deepseek_v3.generate import LatentKVCache, forward_cached

    args = ModelArgs.preset("debug_tiny", **DSA_TINY)
    torch.manual_seed(11)
    model = randomize(Transformer(args)).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(tokens)
    # pages out of order, and the page nobody owns poisoned: sparse decoding must read only the selected slots
    cache = LatentKVCache(model, 2, 30, block_table=torch.tensor([[2], [0]], dtype=torch.int32))
    for pages in cache.k_cache.values():
        pages[1] = float("nan")
    steps = [forward_cached(model, tokens[:, :17], cache, 0)]
    for i in range(17, 30):
        steps.append(forward_cached(model, tokens[:, i:i + 1], cache, i))
    got = torch.cat(steps, dim=1)
    # fp32, the same selection (scores from the same keys) and attention over the same rows: ~1e-6 relative
    assert ((got - full).norm() / full.norm()).item() < 1e-5
    assert cache.index_k[0][:, :30].abs().sum() > 0


def test_fp8_selection_agrees_with_fp32_selection():
    """The FP8 scoring path (Hadamard-rotated e4m3 q and k, DeepGEMM's fp8_mqa_logits, select_topk) picks the
    same causal keys as the fp32 scores, up to near-ties: e4m3 keeps 3 mantissa bits (each operand within
    2^-4 relative of its row's scale), so keys whose fp32 scores are that close may swap across the top-k
    boundary; measured ~97% agreement on random inputs, 90% is asserted (a wrong scale, rotation, causal range
    or batch offset gives ~k/s = 10-30%)."""
    from models.deepseek_v3.indexer import select_rows

    g = torch.Generator().manual_seed(2)
    b, s, hi, d, topk = 2, 150, 8, 64, 16
    q, k = torch.randn(b, s, hi, d, generator=g), torch.randn(b, s, d, generator=g)
    w = torch.randn(b, s, hi, generator=g)
    exact, fp8 = select_rows(q, k, w, topk, chunk=64), select_rows(q, k, w, topk, fp8=True, chunk=37)
    assert torch.equal(exact < 0, fp8 < 0)  # the same causal counts: -1 exactly where fewer than k keys exist
    agree = [len(set(a.tolist()) & set(c.tolist()) - {-1}) / max(1, int((a >= 0).sum())) for a, c in zip(exact, fp8)]
    assert sum(agree) / len(agree) > 0.9
    assert all(set(r[r >= 0].tolist()) <= set(range(i - i % s, i + 1)) for i, r in enumerate(fp8))


def test_memory_model_warmup_keeps_gradients_and_moments_of_the_indexers_only():
    """The memory model of the DSA warm-up: weights as the sparse stage, gradients and AdamW moments of the
    indexer parameters alone (what ``freeze_all_but_indexers`` leaves to the optimizer), counted on the model."""
    from planner.memory import estimate
    from tests import matrix
    from training.trainer import model_args

    sets = ["model.overrides.index_topk=4", "model.overrides.index_n_heads=4", "model.overrides.index_head_dim=16"]
    warm = matrix.config(matrix.reference_overrides((False, 1)) + sets + ["model.overrides.dsa_warmup=true"])
    sparse = matrix.config(matrix.reference_overrides((False, 1)) + sets)
    w, s = estimate(warm).ranks[0].items, estimate(sparse).ranks[0].items
    model = Transformer(model_args(warm))
    indexer = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    assert w["weights"] == s["weights"] and s["gradients"] == s["weights"]
    assert w["gradients"] == indexer * 4 and w["optimizer"] == 2 * indexer * 4  # fp32 grads, two fp32 moments


def test_fp8_save_writes_the_released_v32_layout(tmp_path: Path):
    """``fp8=True`` writes the indexer as DeepSeek-V3.2-Exp ships it: ``wq_b`` and ``wk`` as e4m3 + 128x128 block
    scales, ``weights_proj`` and ``k_norm`` unquantised; loading dequantises back to within e4m3's rounding."""
    from safetensors import safe_open

    model = randomize(Transformer(ModelArgs.preset("debug_tiny", **DSA_TINY)))
    save_hf_checkpoint(model, tmp_path, fp8=True)
    keys = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            keys.update({k: h.get_tensor(k).dtype for k in h.keys()})
    prefix = "model.layers.1.self_attn.indexer"
    assert keys[f"{prefix}.wq_b.weight"] == keys[f"{prefix}.wk.weight"] == torch.float8_e4m3fn
    assert f"{prefix}.wk.weight_scale_inv" in keys and f"{prefix}.weights_proj.weight_scale_inv" not in keys
    assert keys[f"{prefix}.weights_proj.weight"] == keys[f"{prefix}.k_norm.bias"] == torch.bfloat16
    back = load_hf_checkpoint(None, tmp_path).layers[1].attn.indexer
    ref = model.layers[1].attn.indexer
    # e4m3: 3 mantissa bits, so each element within 2^-4 of its block's scale (amax / 448 * 448 = amax) relatively
    assert (back.wk.weight - ref.wk.weight).abs().max() <= ref.wk.weight.abs().max() * 2 ** -4


def test_released_v32_config_is_the_v32_preset():
    """DeepSeek-V3.2-Exp's config.json is V3's with the V3.2 architecture names and the three index fields."""
    from tests.test_model import RELEASED_V3_CONFIG

    released = {**RELEASED_V3_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
    args = ModelArgs.from_hf_config(released)
    assert args.replace(extra={}) == ModelArgs.preset("deepseek_v32_671b")
    counts = args.param_counts()  # V3's 671.0B plus 61 indexers of ~12.6M parameters
    v3 = ModelArgs.preset("deepseek_v3_671b").param_counts()
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert counts["total"] - v3["total"] == 61 * per_layer == counts["activated"] - v3["activated"]


def test_planner_dsa_terms_match_their_definitions():
    """``dsa_ops``' FLOPs against the sums they stand for: the sparse core over each causal query's min(i + 1, k)
    keys at ``2 h (576 + 512)`` per key, the indexer logits over every causal key at ``2 H_I D_I``; and the sparse
    stage is cheaper than dense attention at long sequences, not at short ones."""
    from planner.costs import OpTimer, Workload, block_durations, dsa_ops, mean_keys
    from planner.system import load_system

    for s, k in ((7, 3), (4096, 2048), (1000, 1000), (300, 512)):
        assert mean_keys(s, k) == pytest.approx(sum(min(i + 1, k) for i in range(s)) / s, rel=1e-12)
    args = ModelArgs.preset("deepseek_v32_671b")
    s = 8192
    ops = {op.name: op for op in dsa_ops(args, s, s, fp8=True)}
    keys = sum(min(i + 1, 2048) for i in range(s))
    assert ops["attention"].flops == pytest.approx(2 * keys * 128 * (576 + 512), rel=1e-12)
    assert ops["index_logits"].flops == pytest.approx(2 * s * (s + 1) / 2 * 64 * 128, rel=1e-12)
    timer = OpTimer(load_system("H800"))
    dense, sparse = ModelArgs.preset("deepseek_v3_671b", fp8=True), args.replace(fp8=True)

    def step(a: ModelArgs, seq: int) -> float:
        d = block_durations(timer, a, 5, Workload(1, seq, 8, True, ("norm", "mla_up")))
        return d.f + d.i + d.w

    assert step(sparse, 131072) < 0.5 * step(dense, 131072) and step(sparse, 4096) > step(dense, 4096)


def test_warmup_loss_remade_per_chunk_equals_the_stored_target():
    """The dense warm-up's KL, whose target is remade a chunk at a time from the query latents (each row's own
    RoPE position and sequence), equals the KL over explicitly listed causal rows with a stored target, in value
    and in every indexer gradient; and ``dense_indexer_kl`` matches the float64 definition."""
    from models.deepseek_v3.indexer import causal_rows, dense_indexer_kl
    from models.deepseek_v3.rope import rope_cos_sin

    args = ModelArgs.preset("debug_tiny", **DSA_TINY, dsa_warmup=True)
    torch.manual_seed(4)
    mla = randomize(Transformer(args)).layers[1].attn
    b, s = 2, 13
    x = torch.randn(b, s, args.dim)
    cos, sin = rope_cos_sin(args, torch.arange(s))
    q_latent, (c_kv, k_pe) = mla._q_latent(x), mla._kv_latent(x, cos, sin)
    results = []
    for rows in (None, causal_rows(0, b * s, s)):
        mla.zero_grad()
        q_i, k_i, w = mla._index(x, q_latent.detach(), cos, sin)
        loss = mla._indexer_loss(q_latent.detach(), c_kv.detach(), k_pe.detach(), cos, sin, q_i, k_i, w, rows)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in mla.indexer.named_parameters()}))
    (a, ga), (c, gc) = results
    # fp32, the same products in other chunkings: ~1e-7 relative
    assert abs(a - c) <= 1e-5 * abs(c) and a > 0
    for name in gc:
        assert ((ga[name] - gc[name]).norm() / gc[name].norm()).item() < 1e-4, name

    g = torch.Generator().manual_seed(9)
    t, h, hi, d, n = 10, 3, 4, 8, 20
    q_abs, kv = torch.randn(t, h, n, generator=g), torch.randn(t, n, generator=g)
    q_i = torch.randn(t, hi, d, generator=g, requires_grad=True)
    k_i, w = torch.randn(t, d, generator=g, requires_grad=True), torch.randn(t, hi, generator=g, requires_grad=True)
    rows = causal_rows(0, t, 5)  # two sequences of 5

    def target(start: int, count: int):
        cand = causal_rows(start, count, 5)
        return attention_target(q_abs[start:start + count], kv, cand, 0.7), cand

    got = dense_indexer_kl(target, q_i, k_i, w, chunk=3)
    got.backward()
    ref = [v.detach().double().requires_grad_() for v in (q_i, k_i, w)]
    want = _kl_float64(q_abs, kv, *ref, rows, 0.7)
    want.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for v, r in zip((q_i, k_i, w), ref):
        assert ((v.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item() < 1e-5


@pytest.mark.parametrize("warmup", [True, False])
def test_recompute_kinds_give_identical_gradients(warmup: bool):
    """Both stages under every recompute kind, applied from outside as the trainer applies them (the memory policy's
    saved-tensor hooks and its whole-block wrapper; the indexer loss's own chunk recompute nested inside):
    gradients equal to no recompute bit for bit (the same fp32 ops, the same backward graph), and the indexer's
    statistics (loss and recall sums and call counts) are those of one forward: a block's replay does not count
    again."""
    from training.memory_policy import MemoryPolicy

    grads, stats = {}, {}
    for kinds in ((), ("block",), ("norm", "mla_up"), ("swiglu",)):
        args = ModelArgs.preset("debug_tiny", **DSA_TINY, dsa_warmup=warmup, recompute=kinds)
        torch.manual_seed(0)
        model = randomize(Transformer(args)).train()
        policy = MemoryPolicy(model, args)
        tokens = torch.randint(0, args.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
        with policy.applied():
            logits = model.final(model.run_layers(model.embed_tokens(tokens), wrap=policy.recomputed))
        logits.square().mean().backward()
        grads[kinds] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        stats[kinds] = [(dict(m.indexer.stats.sums), dict(m.indexer.stats.calls)) for m in
                        (layer.attn for layer in model.layers)]
    base, base_stats = grads.pop(()), stats.pop(())
    assert any(".indexer." in n for n in base)
    assert all(calls and all(int(c) == 1 for c in calls.values()) for _, calls in base_stats)
    for kinds, got in grads.items():
        assert got.keys() == base.keys(), kinds
        for name, g in got.items():
            assert torch.equal(g, base[name]), (kinds, name)
        for (sums, calls), (want_sums, want_calls) in zip(stats[kinds], base_stats):
            assert calls.keys() == want_calls.keys() and all(int(calls[k]) == int(want_calls[k]) for k in calls)
            assert all(torch.equal(sums[k], want_sums[k]) for k in want_sums), kinds
