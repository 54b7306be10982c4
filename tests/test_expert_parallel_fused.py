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

from accel import registry
from models.deepseek_v3.balancing import BalanceConfig
from models.deepseek_v3.expert_parallel import ExpertParallel
from tests.dist_utils import run_distributed
from tests.test_expert_parallel import TOKENS, _args, _ep_moe, _full_moe, _grads, _inputs
from tests.tolerances import assert_reorder_close

FUSED_EP_OPS = ("fused_ops.route", "fused_ops.route_backward", "fused_ops.gather_rows", "fused_ops.permute_gather",
                "fused_ops.unpermute_sum")


def _run(rank, world, dim, balance, fused, fp8):
    args = _args(dim).replace(fused_ops=fused)
    full = _full_moe(args, balance)
    moe = _ep_moe(args, balance, full, dist.group.WORLD)
    moe.ep = ExpertParallel(args.n_routed_experts, dist.group.WORLD, fp8_dispatch=fp8, fused=fused)
    x_all, g_all = _inputs(world, dim)
    x = x_all[rank].clone().requires_grad_()
    y = moe(x)
    (y * g_all[rank]).sum().backward()
    return dict(y=y.detach(), x_grad=x.grad, grads=_grads(moe), received=int(moe.received_rows or 0))


def _fused_vs_unfused_rank(rank, world, dim, balance_kwargs, fp8):
    # fused_ops' kernels in the interpreter (every thread, the comm thread too); every other op its reference
    os.environ["DSV3_KERNEL_IMPL"] = "auto"
    for name in registry.ops():
        if not name.startswith("fused_ops."):
            registry.get(name)._triton = None
    balance = BalanceConfig(**balance_kwargs)
    unfused = _run(rank, world, dim, balance, False, fp8)
    for name in FUSED_EP_OPS:
        registry.get(name).last_impl = None
    fused = _run(rank, world, dim, balance, True, fp8)
    return dict(unfused=unfused, fused=fused, impls={n: registry.get(n).last_impl for n in FUSED_EP_OPS})


def _check(world, dim, balance_kwargs, fp8=False):
    results = run_distributed(_fused_vs_unfused_rank, world, dim, balance_kwargs, fp8, timeout=200)
    args = _args(dim)
    n = max(dim, 2 * args.moe_inter_dim, world * TOKENS * args.n_activated_experts)
    for r, res in enumerate(results):
        assert all(impl == "triton" for impl in res["impls"].values()), res["impls"]
        got, want = res["fused"], res["unfused"]
        assert got["received"] == want["received"]  # the same routing: the same rows travelled
        assert_reorder_close(got["y"], want["y"], reduction=n, depth=4, msg=f"rank {r} y")
        assert_reorder_close(got["x_grad"], want["x_grad"], reduction=n, depth=8, msg=f"rank {r} x_grad")
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert_reorder_close(got["grads"][name], g, reduction=n, depth=8, msg=f"rank {r} {name}")
    return results


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fused_ep_matches_unfused_ep_with_node_limit_and_dropped_tokens():
    _check(2, 32, dict(strategy="aux_free+seq_aux", alpha=0.1, capacity_factor=1.0, num_nodes=4, max_nodes=2))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fused_ep_matches_unfused_ep_with_fp8_dispatch():
    _check(2, 160, dict(strategy="none"), fp8=True)  # 160 = one full and one partial 1x128 scale tile
