"""FP8 hand-offs in the model: a consumer fed its input's 1x128 cast by the producer (``x_fp8``) gives the numbers
of the consumer that casts its input itself, bit for bit, and makes no cast of that input of its own.

The precast is ``per_token_cast_to_fp8`` of the input, i.e. what the layer's first GEMMs would cast, so every
GEMM reads the same bytes and scales: outputs and gradients must be equal, not close. Debug preset sizes (dim 64:
K below one 128-block, padded like the GEMMs' own cast).
"""

from __future__ import annotations

import pytest
import torch

import deep_gemm
import fused_ops
import models.deepseek_v3.moe as moe_mod
from accel import registry
from deep_gemm import calc_diff
from models.deepseek_v3 import ModelArgs, Transformer, lm_losses
from models.deepseek_v3.balancing import BalanceConfig
from models.deepseek_v3.layers import MLP
from models.deepseek_v3.mla import MLA
from models.deepseek_v3.moe import Experts, MoE
from models.deepseek_v3.rope import rope_cos_sin
from tests.test_deep_gemm_precast import _count_casts as count_casts
from tests.test_model import randomize
from tests.tolerances import fp8_calc_diff_bound
from training.memory_policy import MemoryPolicy


@pytest.fixture
def act_casts(monkeypatch) -> list[int]:
    """Counts deep_gemm's own activation casts (forward inputs, dgrad's dy, the wgrad's re-cast)."""
    return count_casts(monkeypatch)


def _precast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return deep_gemm.per_token_cast_to_fp8(x.detach().reshape(-1, x.shape[-1]))


def _run_twice(module, x0: torch.Tensor, call, casts: list[int], saved_casts: int):
    """(outputs, input grads, param grads) without and with the precast; the forward with it makes
    ``saved_casts`` fewer casts."""
    results, counts = [], []
    for precast in (False, True):
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        x_fp8 = _precast(x0) if precast else None
        casts[0] = 0
        y = call(x, x_fp8)
        counts.append(casts[0])
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype))
        results.append((y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters() if p.grad is not None}))
    assert counts[0] - counts[1] == saved_casts, counts
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    # (NaN equals nothing: say so first, naming what went non-finite)
    bad = [n for n, t in (("output", y0), ("input grad", gx0), *gp0.items()) if not t.isfinite().all()]
    assert not bad, f"non-finite {bad}"
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert gp0.keys() == gp1.keys() and all(torch.equal(gp0[n], gp1[n]) for n in gp0)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_mla_takes_the_norms_precast(fp8_cache, act_casts, nan_uninitialized):
    args = ModelArgs.preset("debug", fp8=True, fp8_cache_activations=fp8_cache)
    torch.manual_seed(0)
    mla = MLA(args)
    x0 = torch.randn(2, 7, args.dim)
    cos, sin = rope_cos_sin(args, torch.arange(7))
    _run_twice(mla, x0, lambda x, q: mla(x, cos, sin, x_fp8=q), act_casts, saved_casts=2)  # wq_a and wkv_a


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_mlp_takes_the_norms_precast(fp8_cache, act_casts, nan_uninitialized):
    torch.manual_seed(0)
    mlp = MLP(64, 96, fp8=True, fp8_cache=fp8_cache)
    _run_twice(mlp, torch.randn(3, 5, 64), lambda x, q: mlp(x, x_fp8=q), act_casts, saved_casts=1)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_experts_take_the_permutes_precast(fp8_cache, act_casts, nan_uninitialized):
    args = ModelArgs.preset("debug", fp8=True, fp8_cache_activations=fp8_cache, n_routed_experts=3, n_expert_groups=1,
                            n_limited_groups=1)
    torch.manual_seed(0)
    experts = Experts(args)
    experts.reset_parameters(0.05)
    m_indices = deep_gemm.grouped.contiguous_layout([20, 0, 9], "cpu")
    x0 = torch.randn(m_indices.numel(), args.dim)
    weights = torch.rand(m_indices.numel())
    _run_twice(experts, x0, lambda x, q: experts(x, m_indices, weights, x_fp8=q), act_casts, saved_casts=1)


# ------------------------------------------------------------------ the model, fused ops on (interpreter)


@pytest.fixture
def only_fused_kernels(monkeypatch):
    """Only the fused ops run as Triton kernels (in the interpreter); deep_gemm's GEMMs and casts and the attention
    run their references, as in tests/test_fused_ops_model.py."""
    for name in registry.ops():
        if not name.startswith("fused_ops."):
            monkeypatch.setattr(registry.get(name), "_triton", None)


def _model_run(fused: bool, tokens: torch.Tensor, **overrides):
    """(loss, grads) of a small debug model (a dense layer, an MoE layer of 2 experts top-2 (top-1 would leave
    the router a zero gradient), no MTP: the
    interpreter runs one program per grouped row), FP8 on."""
    torch.manual_seed(1)
    args = ModelArgs.preset("debug", fused_ops=fused, n_layers=2, n_mtp_layers=0, n_routed_experts=2,
                            n_activated_experts=2, n_expert_groups=1, n_limited_groups=1, fp8=True, **overrides)
    model = randomize(Transformer(args))
    with registry.force("auto"):
        policy = MemoryPolicy(model, args)
        with policy.applied():  # as the trainer applies it, whole-block recompute included
            logits = model.final(model.run_layers(model.embed_tokens(tokens[:, :-1]), wrap=policy.recomputed))
        loss = lm_losses(args, logits, [], tokens[:, 1:])["loss"]
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _counted(monkeypatch, module, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


# fused vs unfused with FP8: the fused kernels round at the unfused ops' points and differ by fp32 evaluation order
# only (tests/test_fused_ops_model.py); an FP8 cast of such a value may flip to the next e4m3 step. Counting every
# flip as a further e4m3 rounding of every operand (3 per GEMM's wgrad) bounds calc_diff by the FP8 rule's bound
# for the smallest gradient (64 values); the loss then moves by at most sqrt(2 bound) relative. Measured: equal.
# A wrong row, scale or weight moves gradients by calc_diff > 1e-2.
FP8_FUSED_TOL = fp8_calc_diff_bound(casts=3, reduction=64, samples=64)


@pytest.mark.slow  # ~11 s per case on the 2-core box
@pytest.mark.parametrize("recompute", [("swiglu",), ("v3",), ("block",)], ids=["swiglu", "v3", "block"])
def test_model_hands_the_fused_permutes_cast_to_the_fp8_gemms(recompute, only_fused_kernels, act_casts,
                                                               monkeypatch):
    """FP8 with caching: the one-rank MoE moves its rows once, cast to e4m3 on the way, and ``w13`` reads them (no
    bf16 grouped rows). Against the same fused model without the hand-off (``MoE.takes_fp8_rows`` patched False):
    loss and gradients bit-equal (the same kernels, the same casts), and exactly one GEMM cast fewer per
    hand-off; against the unfused model within ``FP8_FUSED_TOL``. (The SwiGLU's cast hand-off to ``w2`` left the
    model with its run-mode checks: docs/fused_ops.md.)"""
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    permutes = _counted(monkeypatch, moe_mod, "permute_fp8")
    results, casts = [], []
    for fused, handoff in ((True, True), (True, False), (False, False)):
        with monkeypatch.context() as m:
            if not handoff:
                m.setattr(MoE, "takes_fp8_rows", lambda self, device: False)
            permutes[0] = act_casts[0] = 0
            results.append(_model_run(fused, tokens, recompute=recompute))
            casts.append((act_casts[0], permutes[0]))
    (loss, grads), (want_loss, want), (unfused_loss, unfused) = results
    # the routed experts' rows (again in a block's recompute, whose w13 then casts nothing either)
    assert casts[0][1] == (2 if "block" in recompute else 1) and casts[1][1] == 0
    assert casts[1][0] - casts[0][0] == casts[0][1]
    assert torch.equal(loss, want_loss) and grads.keys() == want.keys() == unfused.keys()
    assert all(torch.equal(grads[n], want[n]) for n in want)
    assert abs(float(loss) - float(unfused_loss)) <= (2 * FP8_FUSED_TOL) ** 0.5 * abs(float(unfused_loss))
    worst = max(calc_diff(grads[n], unfused[n]) for n in unfused)
    assert worst < FP8_FUSED_TOL, worst


@pytest.mark.parametrize("capacity", [None, pytest.param(0.6, marks=pytest.mark.slow)],
                         ids=["all", "drops"])  # ~8 and ~11 s on the 2-core box
def test_one_rank_moe_moves_the_norms_precast_rows(capacity, only_fused_kernels, act_casts, nan_uninitialized,
                                                   monkeypatch):
    """``MoE.forward(x, x_fp8)`` on one rank with FP8 caching: the shared experts read the norm's cast and the
    routed experts' rows are that cast moved with its scales (``fused_ops.permute``, e4m3 in and out) instead of
    cast on the way: output and gradients (x, gate, experts) bit-equal to ``MoE.forward(x)``, one GEMM cast fewer
    (the shared ``w13``; the routed ``w13`` casts nothing either way). With a capacity factor dropped assignments
    become padding rows. Memory nothing wrote reads as NaN (``nan_uninitialized``): a bare ``MoE`` leaves its
    gate and experts uninitialised (``Transformer.init_weights`` fills them), so both are initialised here (the
    gate was not: garbage weights, now and then inf, made ``x.grad`` NaN through the router's 0 * inf)."""
    args = ModelArgs.preset("debug", fp8=True, n_routed_experts=2, n_activated_experts=2, n_expert_groups=1,
                            n_limited_groups=1)
    torch.manual_seed(0)
    moe = MoE(args, balance=BalanceConfig(capacity_factor=capacity))
    moe.gate.reset_parameters(0.1)
    moe.experts.reset_parameters(0.05)
    x0 = torch.randn(1, 7, args.dim)
    with registry.force("auto"):
        _run_twice(moe, x0, lambda x, q: moe(x, x_fp8=q), act_casts, saved_casts=1)


# The MoE's output against float64: on each path x, w13, the SwiGLU input and w2 are cast to e4m3 once. SwiGLU passes
# on up's relative error as it is and gate's times g silu'(g) / silu(g) = 1 + g (1 - sigmoid(g)) <= 1.28, so each of
# the two casts behind gate_up (x, w13) counts 1 + 1.28^2: 2 * 2.64 + 2 = 7.3, bounded by 8 casts (the shared expert
# takes the same path). 7 tokens x 64 values. Measured 2.6e-3 against 7.3e-3 (Gaussian values average about half
# the worst-case cast variance the bound takes); a wrong, missing or NaN row moves it to >= 1e-1 or NaN.
MOE_FP8_TOL = fp8_calc_diff_bound(casts=8, reduction=64, samples=7 * 64)


def _moe_float64(moe: MoE, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``moe``'s output for ``x [T, dim]`` in float64, given the experts ``indices [T, k]`` it chose: sigmoid scores
    at those experts, normalised, times ``route_scale``; each expert's SwiGLU; plus the shared expert's."""
    p = {n: t.detach().double() for n, t in moe.named_parameters()}
    x = x.double()

    def swiglu(w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        gate, up = (h @ w13.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.T

    scores = (x @ p["gate.weight"].T).sigmoid().gather(1, indices)
    weights = scores / scores.sum(-1, keepdim=True) * moe.gate.route_scale
    y = swiglu(p["shared_experts.w13.weight"], p["shared_experts.w2.weight"], x)
    for t in range(len(x)):
        for j, e in enumerate(indices[t].tolist()):
            y[t] += weights[t, j] * swiglu(p["experts.w13"][e], p["experts.w2"][e], x[t])
    return y


@pytest.mark.slow
def test_one_rank_moe_with_an_idle_expert_reads_no_unwritten_memory(only_fused_kernels, nan_uninitialized):
    """The one-rank FP8 MoE with fused permutes (``w13`` reading the permute's cast, no bf16 rows) over 7 tokens (odd:
    each expert's block is 7 rows and 121 padding rows) and 3 experts, one of which no token chooses (selection bias
    -10: its biased sigmoid score never beats another's), with all memory nothing wrote reading as NaN: the output
    within ``MOE_FP8_TOL`` of float64; gradients those of the unfused MoE (the same FP8 GEMMs, the rows moved by
    torch) within ``FP8_FUSED_TOL``; the idle expert's weight gradients exactly 0 (its wgrad has no rows)."""
    args = ModelArgs.preset("debug", fp8=True, n_routed_experts=3, n_activated_experts=2, n_expert_groups=1,
                            n_limited_groups=1)
    x0 = torch.randn(7, args.dim, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(7, args.dim, generator=torch.Generator().manual_seed(4))
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        moe = MoE(args.replace(fused_ops=fused))
        moe.gate.reset_parameters(0.1)
        moe.experts.reset_parameters(0.05)
        with torch.no_grad():
            moe.gate.e_score_correction_bias[2] = -10.0
        x = x0.clone().requires_grad_()
        with registry.force("auto"):
            assert moe.takes_fp8_rows(x.device) == fused
            y = moe(x)
            y.backward(dy)
            indices = moe.gate(x0).indices
        assert set(indices.flatten().tolist()) == {0, 1}
        assert calc_diff(y, _moe_float64(moe, x0, indices)) < MOE_FP8_TOL, fused
        grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
        assert not [n for n, g in grads.items() if g is None or not g.isfinite().all()], fused
        assert not grads["experts.w13"][2].any() and not grads["experts.w2"][2].any()
        runs.append(grads)
    fused_grads, unfused_grads = runs
    worst = max(calc_diff(fused_grads[n], unfused_grads[n]) for n in unfused_grads)
    assert worst < FP8_FUSED_TOL, worst


def _saved_bytes(fn) -> tuple[object, int]:
    """(fn(), bytes of the distinct storages autograd saved while it ran)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mla_rotates_the_query_in_place(fp8, only_fused_kernels, monkeypatch):
    """With fused ops MLA rotates the rotary dims of its queries where they sit (``fused_ops.rope_``) instead of
    rotating a copy and concatenating: the same kernel on the same values each way, so output and gradients are
    bit-equal to the out-of-place rotation (``q_is_view``: what a padded FP8 output gets), and no more is kept
    for backward. 16 heads x 24 dims: N = 384, whole 128-blocks, so FP8's output is no view."""
    args = ModelArgs.preset("debug", n_heads=16, fp8=fp8, fused_ops=True)
    torch.manual_seed(0)
    mla = MLA(args)
    assert not mla.q_is_view
    x0 = torch.randn(2, 5, args.dim)
    cos, sin = rope_cos_sin(args, torch.arange(5))
    rotations = _counted(monkeypatch, fused_ops.dispatch, "rope_")  # the in-place kernel, as the model reaches it
    results = []
    for in_place in (True, False):
        mla.q_is_view = not in_place
        rotations[0] = 0
        mla.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with registry.force("auto"):
            y, saved = _saved_bytes(lambda x=x: mla(x, cos, sin))
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)))
        assert rotations[0] == in_place
        results.append((y.detach(), x.grad, {n: p.grad for n, p in mla.named_parameters() if p.grad is not None},
                        saved))
    (y0, gx0, gp0, saved0), (y1, gx1, gp1, saved1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert gp0.keys() == gp1.keys() and all(torch.equal(gp0[n], gp1[n]) for n in gp0)
    assert saved0 <= saved1, (saved0, saved1)
