"""DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM``: logits and every parameter's gradient, and the
lightning indexer's losses (V3.2's warm-up and sparse stages) against a float64 evaluation written here.

Tiny configs with window-only, CSA and HCA layers, hash-routed and scored MoE and 4 hyper-connection streams;
sequences of 260-300 tokens, so HCA (ratio 128) closes two windows and CSA's indexer picks 3 of up to 75
compressed entries (top-k selection acts). 16 indexer heads: no entry scores exactly 0 on every head, so no
ties, whose order ``torch.topk`` (transformers) leaves open and we fix (``select_topk``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_v4 import ModelArgs, Transformer
from models.deepseek_v4.indexer_loss import indexer_loss
from models.deepseek_v4.model import rope_angles
from models.deepseek_v4.names import hf_name

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers >= 5.25 ships DeepSeek-V4")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

CONFIGS = {
    "csa_hca_window": dict(vocab_size=97, dim=32, n_layers=4, n_heads=4, q_lora_rank=16, head_dim=32, rope_head_dim=8,
                           o_groups=2, o_lora_rank=8, window_size=8, compress_ratios=(0, 4, 128, 4),
                           index_n_heads=16, index_head_dim=16, index_topk=3, n_routed_experts=6,
                           n_activated_experts=2, moe_inter_dim=16, n_hash_layers=2),
    "hca_first": dict(vocab_size=61, dim=48, n_layers=3, n_heads=2, q_lora_rank=24, head_dim=64, rope_head_dim=16,
                      o_groups=2, o_lora_rank=12, window_size=16, compress_ratios=(4, 0, 128), index_n_heads=16,
                      index_head_dim=24, index_topk=5, n_routed_experts=5, n_activated_experts=3, moe_inter_dim=24,
                      n_hash_layers=1),
}
SEQ = {"csa_hca_window": (2, 300), "hca_first": (1, 260)}


def _args(name: str) -> ModelArgs:
    return ModelArgs(**CONFIGS[name], hc_mult=4, max_seq_len=1024, original_seq_len=64, rope_factor=4.0,
                     n_mtp_layers=0, init_std=0.1)


def _model(args: ModelArgs, seed: int) -> Transformer:
    """Random weights, with sinks, position biases, mHC biases, norms and router biases away from their
    initial constants so that each of them matters."""
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
            elif name.endswith("_scale"):
                p.uniform_(0.5, 1.5)
            elif "norm.weight" in name:
                p.normal_(1, 0.2)
        for layer in model.layers:
            if not layer.ffn.gate.hash:
                layer.ffn.gate.bias.normal_(0, 0.1)
    return model


def _hf_twin(model: Transformer) -> DeepseekV4ForCausalLM:
    cfg = model.args.to_hf_config()
    cfg = DeepseekV4Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "compress_ratios")})
    cfg._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(cfg).float()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    state = {hf_name(n): t.detach().clone() for n, t in tensors.items() if not n.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return hf


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients_match_transformers(name):
    args = _args(name)
    model = _model(args, seed=len(name))
    hf = _hf_twin(model)
    b, s = SEQ[name]
    tokens = torch.randint(0, args.vocab_size, (b, s))
    ours, theirs = model(tokens), hf(tokens).logits
    # fp32 on both sides with the same operations in nearly the same order: what differs is summation order
    # (experts' index_add, einsum vs matmul), ~1e-7 relative per op, a few hundred ops deep; 1e-4 leaves 100x.
    assert torch.isfinite(ours).all()
    assert _rel(ours, theirs) < 1e-4
    # the compressed branches and the selection act: dropping them changes the logits
    for layer in model.layers:
        assert layer.attn.ratio == 0 or s // layer.attn.ratio >= 2
    # ours in training mode: the indexers' KL losses ride on the attention outputs, and every other parameter's
    # gradient must still be transformers' (the loss reaches the indexers only)
    assert model.training
    probe = torch.randn_like(ours)
    (ours * probe).sum().backward()
    (theirs * probe).sum().backward()
    hf_params = dict(hf.named_parameters())
    checked = 0
    for n, p in model.named_parameters():
        if ".indexer." in n:  # transformers gives the indexer no gradient (top-k); ours (training mode) has its
            continue         # KL loss's only, checked against float64 in test_v4_indexer_training.py
        g_hf = hf_params[hf_name(n)].grad
        assert p.grad is not None and g_hf is not None, n
        assert torch.isfinite(p.grad).all(), n
        assert _rel(p.grad, g_hf) < 1e-4, (n, _rel(p.grad, g_hf))
        checked += 1
    assert checked == sum(".indexer." not in n for n, _ in model.named_parameters())


def test_indexer_selection_matters():
    """A different indexer changes which compressed entries CSA reads, hence the logits."""
    args = _args("csa_hca_window")
    model = _model(args, seed=3)
    tokens = torch.randint(0, args.vocab_size, (1, 200))
    with torch.no_grad():
        before = model(tokens)
        model.layers[1].attn.indexer.weights_proj.weight.normal_()
        assert _rel(model(tokens), before) > 1e-3


# ---------------------------------------------------------------------------------------------------- indexer
def _rope64(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of the last 2 * len(angle) dims as complex multiplication (float64)."""
    rd = 2 * angle.shape[-1]
    z = torch.view_as_complex(x[..., -rd:].contiguous().unflatten(-1, (-1, 2))) * torch.polar(
        torch.ones_like(angle), angle)
    return torch.cat([x[..., :-rd], torch.view_as_real(z).flatten(-2)], dim=-1)


def _norm64(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _compress64(c, x: torch.Tensor, angles: torch.Tensor, eps: float) -> torch.Tensor:
    """Window by window: entry i pools window i-1's first half-features with window i's second half (ratio 4)."""
    m, d = c.ratio, c.head_dim
    kv, gate = x @ c.wkv.weight.T, x @ c.wgate.weight.T
    out = []
    for i in range(x.shape[0] // m):
        rows = slice(i * m, (i + 1) * m)
        k, g = kv[rows, d:], gate[rows, d:] + c.ape[:, d:]
        if i > 0:
            prev = slice((i - 1) * m, i * m)
            k = torch.cat([kv[prev, :d], k])
            g = torch.cat([gate[prev, :d] + c.ape[:, :d], g])
        pooled = (torch.softmax(g, dim=0) * k).sum(0)
        out.append(_rope64(_norm64(pooled, c.norm.weight, eps), angles[i * m]))
    return torch.stack(out)


def _reference_indexer_loss(attn, x: torch.Tensor, args: ModelArgs, sparse: bool) -> torch.Tensor:
    """The loss of one sequence ``x [s, dim]``, query by query, in float64 (``attn`` a float64 copy)."""
    s, eps, m = x.shape[0], args.norm_eps, attn.ratio
    angles = rope_angles(args, torch.arange(s), True).double()
    qr = _norm64(x @ attn.wq_a.weight.T, attn.q_norm.weight, eps)
    q = _rope64(_norm64((qr @ attn.wq_b.weight.T).view(s, attn.n_heads, -1), None, eps), angles[:, None])
    kv = _rope64(_norm64(x @ attn.wkv.weight.T, attn.kv_norm.weight, eps), angles)
    ckv = _compress64(attn.compressor, x, angles, eps)
    ix = attn.indexer
    iq = _rope64((qr @ ix.wq_b.weight.T).view(s, ix.n_heads, -1), angles[:, None])
    ik = _compress64(ix.compressor, x, angles, eps)
    iw = (x @ ix.weights_proj.weight.T) / math.sqrt(ix.n_heads)
    total, count = 0.0, 0
    for t in range(s):
        n = (t + 1) // m
        if n == 0:
            continue
        score = (F.relu(iq[t] @ ik[:n].T) / math.sqrt(ix.head_dim) * iw[t][:, None]).sum(0)  # [n]
        cand = score.topk(min(ix.topk, n)).indices.sort().values if sparse else torch.arange(n)
        keys = torch.cat([kv[max(0, t - attn.window + 1): t + 1], ckv[cand]])
        logits = q[t] @ keys.T / math.sqrt(attn.head_dim)  # [h, keys]
        probs = torch.softmax(torch.cat([logits, attn.attn_sink[:, None]], dim=1), dim=1)
        p = probs[:, -1 - len(cand): -1].sum(0)
        p = (p / p.sum()).detach()
        total = total + (p * (p.log() - torch.log_softmax(score[cand], dim=0))).sum()
        count += 1
    return total / count


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sparse", [False, True], ids=["warmup", "sparse"])
def test_indexer_loss_and_gradient_match_float64(sparse):
    args = _args("csa_hca_window")
    model = _model(args, seed=11 + sparse)
    attn = model.layers[1].attn
    s = 96 + 8 * sparse
    x = torch.randn(1, s, args.dim)
    angles = rope_angles(args, torch.arange(s), True)
    loss = indexer_loss(attn, x, angles, sparse=sparse)
    loss.backward()
    ref_attn = copy.deepcopy(attn).double()
    for p in ref_attn.parameters():
        p.grad = None
    ref = _reference_indexer_loss(ref_attn, x[0].double(), args, sparse)
    ref.backward()
    # fp32 against float64: every piece is a short reduction (<= 128 terms) of O(1) values, so fp32 rounding
    # leaves ~1e-6 relative; 1e-4 holds with margin on any CPU.
    assert abs(loss.item() - ref.item()) <= 1e-4 * abs(ref.item())
    assert ref.item() > 0
    ours = dict(attn.named_parameters())
    for n, p in ref_attn.named_parameters():
        if n.startswith("indexer."):
            assert ours[n].grad is not None and torch.isfinite(ours[n].grad).all(), n
            assert _rel(ours[n].grad, p.grad) < 1e-4, (n, _rel(ours[n].grad, p.grad))
        else:  # the main attention is not trained by the indexer's loss
            assert ours[n].grad is None, n


# ---------------------------------------------------------------------------------------------------- MTP
@pytest.mark.timeout(240)
def test_mtp_matches_transformers_building_blocks():
    """transformers has no MTP; its V4 pieces make one: depth 1 at position i is
    ``head(norm(hc_head(block(e_proj(enorm(embed(t[i+1]))) + h_proj(hnorm(h_i))))))`` with ``h`` the main model's
    last streams (captured from transformers' last decoder layer) and ``block`` a transformers decoder layer
    (window-only attention, scored MoE) holding our MTP block's weights."""
    args = _args("csa_hca_window").replace(n_mtp_layers=1)
    model = _model(args, seed=5)
    with torch.no_grad():
        model.mtp[0].ffn.gate.bias.normal_(0, 0.1)
    hf = _hf_twin(model)
    n = args.n_layers
    cfg = DeepseekV4Config(**{k: v for k, v in args.replace(n_layers=n + 1, n_mtp_layers=0).to_hf_config().items()
                              if k not in ("architectures", "compress_ratios")})
    cfg._attn_implementation = "eager"
    block = hf_v4.DeepseekV4DecoderLayer(cfg, n).float()
    head = hf_v4.DeepseekV4HyperHead(cfg).float()
    norms = {k: hf_v4.DeepseekV4RMSNorm(args.dim, args.norm_eps).float() for k in ("enorm", "hnorm", "norm")}
    ours = dict(model.mtp[0].named_parameters())
    ours.update(model.mtp[0].named_buffers())
    block_state = {}
    for name, t in ours.items():
        if name.split(".")[0] in ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head"):
            continue  # MTP's own pieces, used directly below
        block_state[hf_name(f"layers.{n}.{name}").removeprefix(f"model.layers.{n}.")] = t.detach().clone()
    assert not block.load_state_dict(block_state, strict=False).missing_keys
    head.load_state_dict({"hc_fn": ours["hc_head.hc_head_fn"], "hc_base": ours["hc_head.hc_head_base"],
                          "hc_scale": ours["hc_head.hc_head_scale"]})
    for k, module in norms.items():
        module.weight.data.copy_(ours[f"{k}.weight"])
    b, s = 2, 280
    tokens = torch.randint(0, args.vocab_size, (b, s))
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, inp, out: captured.setdefault("h", out))
    with torch.no_grad():
        main = hf(tokens).logits
        hook.remove()
        h = captured["h"][:, :-1]
        nxt = tokens[:, 1:]
        x = F.linear(norms["enorm"](hf.model.embed_tokens(nxt)), ours["e_proj.weight"]).unsqueeze(2) + F.linear(
            norms["hnorm"](h), ours["h_proj.weight"])
        pos = torch.arange(s - 1).unsqueeze(0)
        rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
        emb = {kind: rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x[:, :, 0], attention_mask=None, cache=None,
                                                 position_ids=pos)
        y = block(x, position_embeddings=emb, position_ids=pos, attention_mask=mask, input_ids=nxt)
        theirs = hf.lm_head(norms["norm"](head(y)))
        logits, (mtp,) = model(tokens, return_mtp=True)
    assert _rel(logits, main) < 1e-4
    # the same fp32 operations as the main model's parity: 1e-4 (see above)
    assert _rel(mtp, theirs) < 1e-4, _rel(mtp, theirs)
