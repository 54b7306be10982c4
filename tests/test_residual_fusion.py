"""The residual adds fused into the next RMSNorm (``RMSNorm(x, residual)``, ``block.norm_consume``): the add of the
attention output in ``ffn_norm``'s kernel, the previous layer's FFN output in ``attn_norm``'s, and the norms'
FP8 casts handed to the GEMMs after them.

Numerics: the fused kernel adds in fp32 and rounds ``h`` to the input dtype (torch's add of two values of that
dtype rounds the same exact sum once: bit-equal), then normalises the rounded ``h`` as the norm alone would (so
the norm recompute, which re-runs the norm alone on the kept ``h``, refills the same bits). Against the unfused
torch norm only the fp32 order of the ``dim``-term sum of squares differs: rstd within ``dim * 2^-24`` relative
(a sum of positive terms; worst case), so an fp32 ``y`` within that, a bf16 ``y`` within one bf16 rounding
(2^-8 relative) on top. The model-level bounds are those of tests/test_fused_ops_model.py (same reasoning).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import deep_gemm
import fused_ops
from accel import registry
from deep_gemm import calc_diff
from models.deepseek_v3 import ModelArgs, Transformer, lm_losses
from models.deepseek_v3.block import Block, norm_consume
from models.deepseek_v3.layers import MLP, Linear, RMSNorm
from recipes.bench_memory import saved_bytes
from tests.test_fused_ops_model import only_fused_kernels  # noqa: F401 (a fixture)
from tests.test_model import randomize

linear_module = importlib.import_module("deep_gemm.linear")  # the module, not deep_gemm.linear the function


def _inputs(dtype: torch.dtype, dim: int = 200) -> tuple[torch.Tensor, torch.Tensor, RMSNorm]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, dim, generator=g).to(dtype)
    residual = (torch.randn(3, 7, dim, generator=g) * 4).to(dtype)
    norm = RMSNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    return x, residual, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_residual_fused_and_unfused(dtype):
    x, residual, norm = _inputs(dtype)
    dim = x.shape[-1]
    # unfused: exactly ``h = x + residual``, then the norm of h (today's numbers, gradients included)
    xs = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    out = norm(*xs)
    assert torch.equal(out.residual, x + residual) and out.fp8 is None
    h = (x + residual).requires_grad_()
    assert torch.equal(out.y, norm(h))
    dy, dh = torch.randn_like(out.y), torch.randn_like(out.residual)
    torch.autograd.backward([out.y, out.residual], [dy, dh])
    torch.autograd.backward([norm(h), h], [dy, dh])
    assert torch.equal(xs[0].grad, h.grad) and torch.equal(xs[1].grad, h.grad)

    norm.fused = True
    registry.get("fused_ops.rmsnorm_fp8").last_impl = None
    with registry.force("auto"):
        fx = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
        fused = norm(*fx, fp8=True)
        alone = norm(fused.residual.detach())
        torch.autograd.backward([fused.y, fused.residual], [dy, dh])
    assert registry.get("fused_ops.rmsnorm_fp8").last_impl == "triton"
    assert torch.equal(fused.residual, x + residual)
    assert torch.equal(fused.y, alone)  # what the norm recompute refills is what the forward made
    q, scales = deep_gemm.per_token_cast_to_fp8(fused.y.detach().reshape(-1, dim))
    assert torch.equal(fused.fp8[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(fused.fp8[1], scales)
    rtol = dim * 2.0**-24 + (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    torch.testing.assert_close(fused.y, out.y, rtol=rtol, atol=0.0)
    # gradients: the same fp32 formula, one rounding; dx within rstd's bound plus one rounding of the dtype
    eps = torch.finfo(dtype).eps
    for got, want in zip(fx, xs):
        torch.testing.assert_close(got.grad, want.grad, rtol=rtol + eps, atol=eps * float(want.grad.abs().max()))
    with pytest.raises(ValueError, match="residual must have"):
        norm(x, residual[:, :3])


def test_norm_recompute_keeps_h_and_refills_the_fused_output():
    """``norm_consume`` with the fused kernel: the recompute keeps only ``h`` (the consumer's saved view of y is
    released), and gives the forward's output and every gradient bit for bit (fp32: the norm backward's and the
    stream's gradients are added in fp32 either way)."""
    x, residual, norm = _inputs(torch.float32, 256)
    norm.fused = True
    lin = Linear(256, 64)
    modules = torch.nn.ModuleList([norm, lin])
    results, kept = [], []
    with registry.force("auto"):
        for recompute in (False, True):
            inputs = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
            modules.zero_grad(set_to_none=True)
            nbytes, (h, out) = saved_bytes(
                lambda inputs=inputs, recompute=recompute: norm_consume(norm, *inputs, lin, recompute), modules)
            (out.square().sum() + h.sum()).backward()
            kept.append(nbytes)
            results.append([out.detach(), h.detach(), *(t.grad for t in inputs), norm.weight.grad, lin.weight.grad])
    rows = x.numel() // 256
    # without recompute: h and rstd (the norm), y (the Linear); with it: h only (y released)
    assert kept == [x.numel() * 4 * 2 + rows * 4, x.numel() * 4], kept
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _blocks(model: Transformer) -> list[list[Block]]:
    """The runs of consecutive blocks: the trunk, then each MTP depth's one block."""
    return [list(model.layers)] + [[m.block] for m in model.mtp]


def _forward_backward(fused: bool, tokens: torch.Tensor, monkeypatch, handoff: bool = True, **overrides):
    """Loss and gradients of the debug model (as tests/test_fused_ops_model.py), and what its forward called:
    ``fused_ops.rmsnorm`` with a residual, with ``fp8``, and deep_gemm's own activation casts. ``handoff=False``:
    the norms hand no FP8 cast on."""
    torch.manual_seed(1)
    args = ModelArgs.preset("debug", fused_ops=fused, n_layers=2, n_routed_experts=4, n_expert_groups=2,
                           n_limited_groups=1, **overrides)
    model = randomize(Transformer(args))
    for run in _blocks(model):
        for block in run:
            block.norm_fp8 = block.norm_fp8 and handoff
    calls = {"residual": 0, "fp8": 0, "casts": 0}
    rmsnorm, act_cast = fused_ops.rmsnorm, linear_module._act_cast

    def counting_norm(x, weight, residual=None, eps=1e-6, fp8=False):
        calls["residual"] += residual is not None
        calls["fp8"] += fp8
        return rmsnorm(x, weight, residual, eps, fp8)

    def counting_cast(x, recipe):
        calls["casts"] += 1
        return act_cast(x, recipe)

    with monkeypatch.context() as patch, registry.force("auto"):
        patch.setattr(fused_ops, "rmsnorm", counting_norm)
        patch.setattr(linear_module, "_act_cast", counting_cast)
        logits, mtp = model.forward_with_mtp(tokens[:, :-1])
        forward = dict(calls)
        loss = lm_losses(args, logits, mtp, tokens[:, 1:])["loss"]
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, forward, model


# 5-21 s each on the 2-core box (an FP8 case runs the model three times), so in `make test` only: each recompute
# mode once, FP8 under V3's policy (the norm recomputed, its cast a forward transient). The others are covered
# elsewhere: no recompute in bf16 and V3's policy + SwiGLU recompute by tests/test_fused_ops_model.py (whose
# fast case runs these fused adds too); FP8 without the norm recompute, the casts handed on, against the unfused
# model, by tests/test_fp8_handoff.py's model test ("swiglu").
_MODES = [pytest.param(recompute, fp8, id=f"{'+'.join(recompute) or 'none'}-{'fp8' if fp8 else 'bf16'}",
                       marks=pytest.mark.slow)
          for recompute, fp8 in [(("v3",), True), (("norm",), False), (("block",), False)]]


@pytest.mark.parametrize("recompute, fp8", _MODES)
def test_model_with_fused_residual_adds_matches_the_unfused_model(recompute, fp8, only_fused_kernels,  # noqa: F811
                                                                  monkeypatch):
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    loss, grads, calls, model = _forward_backward(True, tokens, monkeypatch, recompute=recompute, fp8=fp8)
    want_loss, want, unfused_calls, _ = _forward_backward(False, tokens, monkeypatch, recompute=recompute, fp8=fp8)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert grads.keys() == want.keys()
    worst = max(calc_diff(grads[n], want[n]) for n in want)
    assert worst < 1e-8, worst

    # the adds ran inside the norms: each run of consecutive blocks (the trunk, each MTP depth) adds every
    # attention output in ffn_norm and every FFN output but the last in the next attn_norm; a whole-block
    # recompute adds its input before the checkpoint (so that it keeps one tensor)
    runs = _blocks(model)
    inner = sum(len(run) - 1 for run in runs) if "block" not in recompute else 0
    assert calls["residual"] == sum(len(run) for run in runs) + inner
    assert unfused_calls["residual"] == 0
    if not fp8:
        assert calls["fp8"] == 0
        return
    # FP8: each block norm hands its cast on (no expert parallelism here), the same bits as the casts it
    # replaces: one per wq_a and wkv_a after attn_norm, and after ffn_norm the dense FFN's w13 or the shared
    # experts' w13 (the routed rows are cast on their way either way)
    blocks = [b for run in runs for b in run]
    assert calls["fp8"] == 2 * len(blocks)
    saved = sum(1 + bool(b.attn.q_lora_rank) for b in blocks)
    saved += sum(isinstance(b.ffn, MLP) or getattr(b.ffn, "shared_experts", None) is not None for b in blocks)
    plain_loss, plain, plain_calls, _ = _forward_backward(True, tokens, monkeypatch, handoff=False,
                                                          recompute=recompute, fp8=fp8)
    assert plain_calls["fp8"] == 0 and plain_calls["casts"] - calls["casts"] == saved
    assert torch.equal(loss, plain_loss) and all(torch.equal(grads[n], plain[n]) for n in plain)
