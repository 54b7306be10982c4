"""DeepSeek-V4 model properties transformers cannot check: the presets' sizes against DeepSeek's published
figures, causality of every branch (window, CSA's compressed entries and top-k, HCA, MTP), and bad input."""

from __future__ import annotations

import pytest
import torch

from models.deepseek_v4 import ModelArgs, Transformer


def _counts(args: ModelArgs) -> tuple[float, float]:
    """(total, activated per token) parameters of the main model (MTP excluded; activated: the routed experts
    a token uses, and no embedding table, a lookup), in billions."""
    with torch.device("meta"):
        model = Transformer(args.replace(n_mtp_layers=0))
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    active = total - routed + routed * args.n_activated_experts / args.n_routed_experts - model.embed.weight.numel()
    return total / 1e9, active / 1e9


@pytest.mark.parametrize("name,total,active", [("deepseek_v4_flash", 284, 13), ("deepseek_v4_pro", 1600, 49)])
def test_presets_have_the_published_sizes(name, total, active):
    """DeepSeek's figures: V4-Flash 284B / 13B activated, V4-Pro 1.6T / 49B, rounded as published."""
    got_total, got_active = _counts(ModelArgs.preset(name))
    assert abs(got_total - total) <= 0.02 * total, got_total
    assert abs(got_active - active) <= 0.05 * active, got_active


def _random_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.preset("debug_v4", index_n_heads=4, init_std=0.1))  # 4 heads: ties at 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base")):
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def test_no_position_sees_the_future():
    """Logits at positions < t do not move when tokens >= t change: the window, CSA's compressed entries and
    their top-k selection, HCA's entries and MTP all wait until a window has closed."""
    model = _random_model(0)
    assert set(model.args.compress_ratios) == {0, 4, 128}
    s = 300
    tokens = torch.randint(0, model.args.vocab_size, (2, s))
    logits, (mtp,) = model(tokens, return_mtp=True)
    for t in (1, 127, 128, 130, 257):  # around CSA's and HCA's window ends
        other = tokens.clone()
        other[:, t:] = torch.randint(0, model.args.vocab_size, (2, s - t))
        logits2, (mtp2,) = model(other, return_mtp=True)
        # the same rows through the same shapes: equal up to fp32 rounding of reordered reductions
        assert torch.allclose(logits2[:, :t], logits[:, :t], rtol=1e-5, atol=1e-6), t
        assert torch.allclose(mtp2[:, : t - 1], mtp[:, : t - 1], rtol=1e-5, atol=1e-6), t  # MTP reads token i+1
        assert not torch.allclose(logits2[:, t:], logits[:, t:])
    assert mtp.shape == (2, s - 1, model.args.vocab_size) and torch.isfinite(mtp).all()
    # a prefix alone scores as inside the longer sequence (what generation by recompute relies on), ties in
    # the indexer's top-k included: with 4 indexer heads, entries scoring exactly 0 are common
    for t in (125, 131, 200):
        short = model(tokens[:, :t])
        assert torch.allclose(short, logits[:, :t], rtol=1e-4, atol=1e-5), t


@torch.no_grad()
def test_bf16_runs_with_fp32_routing_and_mhc():
    """A bfloat16 model runs (router scores, mHC weights, the compressor's softmax in fp32) and stays near fp32 at
    the typical token. A sanity bound, not a precision claim: bf16 rounds to 2^-9 relative, the debug model's
    path has ~50 roundings (4 layers x norms, projections, attention, MoE, mHC) and gains of a few, which
    measures 1-8% per token; at some tokens a discrete choice (expert or indexer top-k) flips, hence the
    median. 0.15 catches a wrong dtype path (a bf16 router or Sinkhorn flipping most tokens)."""
    model = _random_model(2)
    tokens = torch.randint(0, model.args.vocab_size, (1, 160))
    ref = model(tokens)
    out = model.to(torch.bfloat16)(tokens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    per_token = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.median().item() < 0.15, per_token.median()


def test_bad_input_is_named():
    model = _random_model(1)
    with pytest.raises(ValueError, match="tokens must be an integer"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, model.args.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="index_head_dim"):
        ModelArgs.preset("debug_v4", index_head_dim=8)
    with pytest.raises(ValueError, match="compress_ratios has 2 entries"):
        ModelArgs.preset("debug_v4", compress_ratios=(0, 4))
