"""The model with ``fused_ops`` on (its norms, SwiGLUs, RoPE, MoE permute / unpermute and router through the
fused kernels, here in Triton's interpreter) against the same model with them off (the unfused torch ops),
and what the fused pieces keep for backward.

Tolerance: in fp32 the fused kernels round at the same points as the ops they replace and differ only in
fp32 evaluation order (sums of <= 64 terms here: 64 * 2^-24 ~ 4e-6 relative per op at worst, ~5e-7
typically); through three layers, MTP and the loss that stays below 1e-5 relative on the loss and
calc_diff 1e-8 on gradients (calc_diff squares relative errors: (1e-5)^2 ~ 1e-10, with margin). A wrong
rotation, row, weight or gradient term moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch

from accel import registry
from deep_gemm import calc_diff
from models.deepseek_v3 import ModelArgs, Transformer, lm_losses
from models.deepseek_v3.indexer import Indexer
from models.deepseek_v3.rope import rope_cos_sin
from planner import memory_measure
from tests.test_model import randomize

FUSED_OPS = ("fused_ops.rmsnorm", "fused_ops.swiglu", "fused_ops.rope", "fused_ops.permute_gather",
             "fused_ops.unpermute_sum", "fused_ops.route", "fused_ops.rmsnorm_backward", "fused_ops.swiglu_backward",
             "fused_ops.route_backward")


@pytest.fixture
def only_fused_kernels(monkeypatch):
    """Every other kernel op (deep_gemm's GEMMs, flash_mla's attention) runs its reference, so only the fused ops
    differ between the two runs and the interpreter runs nothing else (it would take minutes)."""
    for name in registry.ops():
        if not name.startswith("fused_ops."):
            monkeypatch.setattr(registry.get(name), "_triton", None)


def _loss_and_grads(fused: bool, tokens: torch.Tensor, **overrides):
    torch.manual_seed(1)
    # 4 experts in 2 groups (group-limited routing on), top-2: the grouped layout pads each expert to 128 rows
    # and the interpreter runs one program per row, so few experts keep this test short
    args = ModelArgs.preset("debug", fused_ops=fused, n_layers=2, n_routed_experts=4, n_expert_groups=2,
                            n_limited_groups=1, **overrides)
    model = randomize(Transformer(args))
    with registry.force("auto"):  # the fused ops' Triton kernels (in the interpreter) where fused
        logits, mtp = model.forward_with_mtp(tokens[:, :-1])
        loss = lm_losses(args, logits, mtp, tokens[:, 1:])["loss"]
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # ~10 s per case on the 2-core box
@pytest.mark.parametrize("recompute", [(), ("v3", "swiglu")], ids=["plain", "recompute"])
def test_fused_model_matches_the_unfused_model(recompute, only_fused_kernels):
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    before = {name: registry.reference_call_count(name) for name in FUSED_OPS}
    for name in FUSED_OPS:
        registry.get(name).last_impl = None
    loss, grads = _loss_and_grads(True, tokens, recompute=recompute)
    for name in FUSED_OPS:  # each ran as its kernel: no fall-back to its reference
        assert registry.get(name).last_impl == "triton", name
        assert registry.reference_call_count(name) == before[name], name
    want_loss, want = _loss_and_grads(False, tokens, recompute=recompute)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert grads.keys() == want.keys()
    worst = max(calc_diff(grads[n], want[n]) for n in want)
    assert worst < 1e-8, worst


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("recompute", [(), ("v3",)], ids=["plain", "v3"])
def test_fused_ops_keep_no_more_activation_memory_per_token(recompute, fp8):
    """The memory model's own measurement (``planner.memory_measure``, GPU path on the meta device) of one MoE
    block: what it keeps for backward and its transient peak, with and without the fused ops."""
    args = ModelArgs.preset("debug", recompute=recompute, fp8=fp8)
    fused = memory_measure.block(args.replace(fused_ops=True), 1, 2, 64, 2, True)
    unfused = memory_measure.block(args.replace(fused_ops=False), 1, 2, 64, 2, True)
    assert fused.saved <= unfused.saved, (fused, unfused)
    assert fused.transient <= unfused.transient, (fused, unfused)


def test_indexer_rope_through_fused_ops(only_fused_kernels):
    """V3.2's lightning indexer rotates its half-split RoPE dims through fused_ops when on: same queries, keys and
    gradients as the unfused rotation (one fp32 rotation and one rounding either way; 1e-6 relative)."""
    args = ModelArgs.preset("debug", index_n_heads=4, index_head_dim=16, index_topk=8)
    torch.manual_seed(3)
    indexer = Indexer(args)
    cos, sin = rope_cos_sin(args, torch.arange(5))
    q_resid, x = torch.randn(2, 5, args.q_lora_rank), torch.randn(2, 5, args.dim)
    results = []
    registry.get("fused_ops.rope").last_impl = None
    for fused in (True, False):
        indexer.fused = fused
        inputs = [q_resid.clone().requires_grad_(), x.clone().requires_grad_()]
        with registry.force("auto"):
            q, k = indexer.queries(inputs[0], cos, sin), indexer.keys(inputs[1], cos, sin)
            (q.square().sum() + k.sum()).backward()
        results.append((q.detach(), k.detach(), inputs[0].grad, inputs[1].grad))
    assert registry.get("fused_ops.rope").last_impl == "triton"
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
