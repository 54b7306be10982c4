"""FP8 hand-offs in the model: a consumer fed its input's 1x128 cast by the producer (``x_fp8``) gives the numbers
of the consumer that casts its input itself, bit for bit, and makes no cast of that input of its own.

The precast is ``per_token_cast_to_fp8`` of the input, i.e. what the layer's first GEMMs would cast, so every
GEMM reads the same bytes and scales: outputs and gradients must be equal, not close. Debug preset sizes (dim 64:
K below one 128-block, padded like the GEMMs' own cast).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import deep_gemm
from models.deepseek_v3 import ModelArgs
from models.deepseek_v3.layers import MLP
from models.deepseek_v3.mla import MLA
from models.deepseek_v3.moe import Experts
from models.deepseek_v3.rope import rope_cos_sin

linear_mod = importlib.import_module("deep_gemm.linear")


@pytest.fixture
def act_casts(monkeypatch) -> list[int]:
    """Counts deep_gemm's own activation casts (forward inputs, dgrad's dy, the wgrad's re-cast)."""
    calls = [0]
    real = linear_mod._act_cast

    def counting(x, recipe):
        calls[0] += 1
        return real(x, recipe)

    monkeypatch.setattr(linear_mod, "_act_cast", counting)
    return calls


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
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert gp0.keys() == gp1.keys() and all(torch.equal(gp0[n], gp1[n]) for n in gp0)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_mla_takes_the_norms_precast(fp8_cache, act_casts):
    args = ModelArgs.preset("debug", fp8=True, fp8_cache_activations=fp8_cache)
    torch.manual_seed(0)
    mla = MLA(args)
    x0 = torch.randn(2, 7, args.dim)
    cos, sin = rope_cos_sin(args, torch.arange(7))
    _run_twice(mla, x0, lambda x, q: mla(x, cos, sin, x_fp8=q), act_casts, saved_casts=2)  # wq_a and wkv_a


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_mlp_takes_the_norms_precast(fp8_cache, act_casts):
    torch.manual_seed(0)
    mlp = MLP(64, 96, fp8=True, fp8_cache=fp8_cache)
    _run_twice(mlp, torch.randn(3, 5, 64), lambda x, q: mlp(x, x_fp8=q), act_casts, saved_casts=1)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["nocache", "cache"])
def test_experts_take_the_permutes_precast(fp8_cache, act_casts):
    args = ModelArgs.preset("debug", fp8=True, fp8_cache_activations=fp8_cache, n_routed_experts=3, n_expert_groups=1,
                            n_limited_groups=1)
    torch.manual_seed(0)
    experts = Experts(args)
    experts.reset_parameters(0.05)
    m_indices = deep_gemm.grouped.contiguous_layout([20, 0, 9], "cpu")
    x0 = torch.randn(m_indices.numel(), args.dim)
    weights = torch.rand(m_indices.numel())
    _run_twice(experts, x0, lambda x, q: experts(x, m_indices, weights, x_fp8=q), act_casts, saved_casts=1)
