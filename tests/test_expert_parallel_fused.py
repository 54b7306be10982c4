"""Expert parallelism with ``fused_ops`` (the router, row gather, regroup, ungroup and scatter-back as Triton
kernels, in the interpreter here) against the same EP run with the unfused torch ops, on 2 gloo ranks.

Reference: the unfused EP run of the same MoE on the same inputs (itself checked against a one-process MoE by
tests/test_expert_parallel.py). The row movements are copies in both (bit-equal), so what differs is fp32
evaluation order: the router's sigmoid and normalisation (a few fp32 ulps, same picks: the inputs are drawn
away from ties by the decisive gate of test_expert_parallel), the SwiGLU kernel, and the sums over a token's
top-k rows (forward) and its sent rows' gradients (backward, fp32 in the kernel where torch's ``index_add``
adds in the rows' dtype). Bounded like test_expert_parallel's single-process comparison by
tests/tolerances.py from the magnitudes and the longest reduction. The routing weights' gradients travel as
the rows' dtype in both (fp32 here).
"""

import os

import pytest
import torch
import torch.distributed as dist

import deep_gemm
import models.deepseek_v3.moe as moe_module
from accel import registry
from models.deepseek_v3.balancing import BalanceConfig
from models.deepseek_v3.expert_parallel import ExpertParallel
from tests.dist_utils import run_distributed
from tests.test_expert_parallel import TOKENS, _args, _ep_moe, _full_moe, _grads, _inputs
from tests.tolerances import assert_reorder_close

_GROUPED_LINEAR = moe_module.grouped_linear
FUSED_EP_OPS = ("fused_ops.route", "fused_ops.route_backward", "fused_ops.gather_rows", "fused_ops.permute_gather",
                "fused_ops.unpermute_sum")


def _spy_on_w13(moe) -> list[bool | str]:
    """For each w13 grouped GEMM handed a precast: whether it is DeepGEMM's cast of the GEMM's input (real rows),
    or "stand-in" when that input has no storage (the GEMM reads only the cast)."""
    seen = []

    def spy(x, weight, m_indices, **kwargs):
        if weight is moe.experts.w13 and kwargs.get("x_fp8") is not None and x.stride(0) == 0:
            seen.append("stand-in")
        elif weight is moe.experts.w13 and kwargs.get("x_fp8") is not None:
            (q, sf), valid = kwargs["x_fp8"], m_indices >= 0
            q_dg, sf_dg = deep_gemm.per_token_cast_to_fp8(x.detach())
            seen.append(torch.equal(q.view(torch.uint8)[valid], q_dg.view(torch.uint8)[valid])
                        and torch.equal(sf[valid], sf_dg[valid]))
        return _GROUPED_LINEAR(x, weight, m_indices, **kwargs)

    moe_module.grouped_linear = spy  # (each rank is a process of its own; each run replaces the last run's spy)
    return seen


def _run(rank, world, dim, balance, fused, fp8, model):
    args = _args(dim).replace(fused_ops=fused, **model)
    fp8_gemms = args.fp8
    full = _full_moe(args, balance)
    moe = _ep_moe(args, balance, full, dist.group.WORLD)
    precasts = _spy_on_w13(moe)
    moe.ep = ExpertParallel(args.n_routed_experts, dist.group.WORLD, fp8_dispatch=fp8, fused=fused)
    x_all, g_all = _inputs(world, dim)
    x = x_all[rank].clone().requires_grad_()
    # with FP8 GEMMs, x's 1x128 cast as its norm would hand it on: the sender moves it instead of casting
    y = moe(x, deep_gemm.per_token_cast_to_fp8(x.detach().view(-1, dim)) if fp8_gemms else None)
    (y * g_all[rank]).sum().backward()
    return dict(y=y.detach(), x_grad=x.grad, grads=_grads(moe), received=int(moe.received_rows or 0),
                precasts=precasts)


def _fused_vs_unfused_rank(rank, world, dim, balance_kwargs, fp8, model, unfused_kernels):
    # fused_ops' kernels in the interpreter (every thread, the comm thread too); every other op its reference
    os.environ["DSV3_KERNEL_IMPL"] = "auto"
    for name in registry.ops():
        if not name.startswith("fused_ops.") or name in unfused_kernels:
            registry.get(name)._triton = None
    balance = BalanceConfig(**balance_kwargs)
    unfused = _run(rank, world, dim, balance, False, fp8, model)
    fused_ops = [name for name in registry.ops() if name.startswith("fused_ops.")]
    for name in fused_ops:
        registry.get(name).last_impl = None
    fused = _run(rank, world, dim, balance, True, fp8, model)
    return dict(unfused=unfused, fused=fused, ran={n for n in fused_ops if registry.get(n).last_impl == "triton"})


def _check(world, dim, balance_kwargs, fp8=False, model=None, ops=FUSED_EP_OPS, unfused_kernels=()):
    results = run_distributed(_fused_vs_unfused_rank, world, dim, balance_kwargs, fp8, model or {}, unfused_kernels,
                              timeout=200)
    args = _args(dim)
    n = max(dim, 2 * args.moe_inter_dim, world * TOKENS * args.n_activated_experts)
    for r, res in enumerate(results):
        assert set(ops) <= res["ran"], res["ran"]
        got, want = res["fused"], res["unfused"]
        assert got["received"] == want["received"]  # the same routing: the same rows travelled
        assert_reorder_close(got["y"], want["y"], reduction=n, depth=4, msg=f"rank {r} y")
        assert_reorder_close(got["x_grad"], want["x_grad"], reduction=n, depth=8, msg=f"rank {r} x_grad")
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert_reorder_close(got["grads"][name], g, reduction=n, depth=8, msg=f"rank {r} {name}")
    return results


@pytest.mark.dist
@pytest.mark.slow  # ~16 s on the 2-core box
@pytest.mark.timeout(300)
def test_fused_ep_matches_unfused_ep_with_node_limit_and_dropped_tokens():
    """test_expert_parallel's config that drops tokens (asserted there): dropped slots (row -1) add nothing."""
    _check(2, 32, dict(strategy="aux_free+seq_aux", alpha=0.1, capacity_factor=1.0, num_nodes=4, max_nodes=2))


FP8_DISPATCH_OPS = ("fused_ops.permute_gather_fp8", "fused_ops.gather_dequant_fp8", "fused_ops.gather_rows",
                    "fused_ops.unpermute_sum")
PRECAST_OPS = ("fused_ops.permute_gather", "fused_ops.gather_dequant_fp8", "fused_ops.gather_rows",
               "fused_ops.unpermute_sum")


@pytest.mark.dist
@pytest.mark.slow  # ~10 s; the FP8-GEMM case below runs the same path in `make test-fast`
@pytest.mark.timeout(300)
def test_fused_ep_matches_unfused_ep_with_fp8_dispatch():
    """The rows travel packed by the sender's gather + cast kernel and land straight in the grouped layout."""
    _check(2, 160, dict(strategy="none"), fp8=True, ops=FP8_DISPATCH_OPS)  # 160: a full and a partial 1x128 tile


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True], ids=["fp8", "fp8_cache"])
def test_fused_fp8_dispatch_hands_the_grouped_gemm_its_own_cast(cache):
    """FP8 GEMMs: the sender moves x's precast (no cast), w13 reads the cast the landing kernel made instead of
    casting the grouped rows itself (checked bit for bit against DeepGEMM's cast of them; under ``fp8_cache`` the
    GEMM reads only that cast, so the bf16 grouped rows are a stand-in, never written). The router and SwiGLU
    run their references here, so every FP8 cast sees the unfused run's inputs: a cast that differed by one e4m3
    step (2^-3 relative) would be far outside the reorder bound."""
    results = _check(2, 160, dict(strategy="none"), fp8=True, model=dict(fp8=True, fp8_cache_activations=cache),
                     ops=PRECAST_OPS,
                     unfused_kernels=("fused_ops.route", "fused_ops.route_backward", "fused_ops.swiglu",
                                      "fused_ops.swiglu_fp8", "fused_ops.swiglu_backward"))
    for res in results:
        assert not res["unfused"]["precasts"] and res["fused"]["precasts"] == ["stand-in" if cache else True]
        assert "fused_ops.permute_gather_fp8" not in res["ran"]  # the precast moved, never cast again


def _plan_rank(rank, world):
    """A MoE block with fused ops and FP8 dispatch (the rows to send and the rows that land are stand-ins without
    storage) run as the overlapped pipeline runs it (``plan.layer_pieces``, the reverse all-to-alls posted by the
    plan, with and without whole-block recompute) and as its plain forward and ``backward()``."""
    from models.deepseek_v3 import Block
    from models.deepseek_v3.args import ModelArgs
    from models.deepseek_v3.moe import MoE
    from models.deepseek_v3.plan import Run, layer_pieces
    from models.deepseek_v3.rope import rope_cos_sin
    from training.memory_policy import MemoryPolicy
    from training.stages import expert_range

    os.environ["DSV3_KERNEL_IMPL"] = "auto"
    for name in registry.ops():  # the interpreter runs the expert-parallel kernels only (the rest: seconds each)
        if name not in FP8_DISPATCH_OPS + ("fused_ops.permute_gather",):
            registry.get(name)._triton = None
    out = {}
    for recompute, path, fp8 in (((), "block", False), ((), "stage", False), (("block",), "stage", False),
                                 ((), "block", True), ((), "stage", True)):
        torch.manual_seed(0)
        args = ModelArgs.preset("debug_tiny", recompute=recompute, fused_ops=True, fp8=fp8)
        block = Block(args, layer_id=1)
        block.ffn = MoE(args, 1, expert_range(args, rank, world))
        block.ffn.ep = ExpertParallel(args.n_routed_experts, dist.group.WORLD, fp8_dispatch=True, fused=True)
        precasts = []  # the plain block hands no cast to the send (both paths): the dispatch casts on the way

        def send(x, seq_len=None, x_fp8=None, real=block.ffn.send, seen=precasts):
            seen.append(x_fp8 is not None)
            return real(x, seq_len, x_fp8)

        block.ffn.send = send
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        g = torch.Generator().manual_seed(10 + rank)
        h = torch.randn(2, 6, args.dim, generator=g).requires_grad_()
        cos, sin = rope_cos_sin(args, torch.arange(6))
        registry.get("fused_ops.gather_dequant_fp8").last_impl = None
        if path == "stage":
            run = Run(layer_pieces(block, cos, sin, wrap=MemoryPolicy(block, args).recomputed), h=h)
            y = run.forward()["h"]
            run.backward(h=torch.randn(y.shape, generator=g))
        else:
            y = block(h, cos, sin)
            (y * torch.randn(y.shape, generator=g)).sum().backward()
        assert registry.get("fused_ops.gather_dequant_fp8").last_impl == "triton"
        assert precasts and set(precasts) == {False}, (recompute, path, fp8, precasts)  # (recompute: twice)
        out[(recompute, path, fp8)] = (y.detach(), h.grad, {n: p.grad.clone() for n, p in block.named_parameters()
                                                       if p.grad is not None})
    return out


@pytest.mark.dist
@pytest.mark.slow  # ~25 s on the 2-core box (the interpreter runs the grouped layout's padded rows)
@pytest.mark.timeout(300)
def test_fused_fp8_dispatch_through_the_overlapped_plan_and_recompute():
    """Same kernels, same order of every sum: only the schedule differs, so the results agree to fp32 rounding
    of the few reductions whose split the schedule may change (rtol 1e-5, as tests/test_model_recompute.py)."""
    for rank_out in run_distributed(_plan_rank, 2, timeout=250):
        for key, (y, gh, grads) in rank_out.items():
            base = rank_out[((), "block", key[2])]
            torch.testing.assert_close(y, base[0], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k} y: {m}")
            torch.testing.assert_close(gh, base[1], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k} dh: {m}")
            assert grads.keys() == base[2].keys(), key
            for n in grads:
                torch.testing.assert_close(grads[n], base[2][n], rtol=1e-5, atol=1e-7,
                                           msg=lambda m, k=key, n=n: f"{k} {n}: {m}")
