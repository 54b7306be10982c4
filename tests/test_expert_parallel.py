"""Expert parallelism: an EP run (gloo, EP = 2 and 4) matches the single-process MoE in outputs and gradients.

Reference: the same MoE with every expert in one process, run once per rank's micro-batch (the
balance losses and capacity are per micro-batch in both), gradients accumulated. Tolerances: the
EP run multiplies the same fp32 rows by the same weights but in differently sized GEMMs and sums
rows of other ranks in another order, so results differ by summation order only: bounded from the
magnitudes and reduction lengths by tests/tolerances.py (any x86 CPU, any BLAS, any thread count).
"""

import pytest
import torch
import torch.distributed as dist

import deep_gemm
from models.deepseek_v3.args import PRESETS, ModelArgs
from models.deepseek_v3.balancing import BalanceConfig, collect_load_metrics, update_expert_biases
from models.deepseek_v3.expert_parallel import ExpertParallel
from models.deepseek_v3.moe import MoE
from tests.dist_utils import run_distributed
from tests.tolerances import assert_reorder_close
from training.stages import expert_range

TOKENS = 12  # per rank: 2 sequences of 6


def _args(dim=32, experts=8):
    return ModelArgs(**{**PRESETS["debug_tiny"], "dim": dim, "n_routed_experts": experts})


def _full_moe(args, balance, seed=0):
    torch.manual_seed(seed)
    moe = MoE(args, balance=balance)
    for name, p in moe.named_parameters():
        torch.nn.init.normal_(p, std=0.5 if name.startswith("gate") else 0.1)  # decisive routing
    return moe


def _inputs(world, dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, 2, TOKENS // 2, dim, generator=g)
    grad = torch.randn(world, 2, TOKENS // 2, dim, generator=g)
    return x, grad


def _ep_moe(args, balance, full, group, fp8=False):
    moe = MoE(args, balance=balance, expert_ids=expert_range(args, dist.get_rank(group), dist.get_world_size(group)))
    moe.ep = ExpertParallel(args.n_routed_experts, group, fp8_dispatch=fp8)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            src = dict(full.named_parameters())[name]
            p.copy_(src[moe.experts.expert_ids.start:moe.experts.expert_ids.stop] if name.startswith("experts.")
                    else src)
    return moe


def _grads(moe):
    return {n: p.grad.detach().clone() for n, p in moe.named_parameters() if p.grad is not None}


def _ep_rank(rank, world, dim, balance_kwargs, fp8):
    args, balance = _args(dim), BalanceConfig(**balance_kwargs)
    full = _full_moe(args, balance)
    moe = _ep_moe(args, balance, full, dist.group.WORLD, fp8)
    x_all, g_all = _inputs(world, dim)
    x = x_all[rank].clone().requires_grad_()
    y = moe(x)
    (y * g_all[rank]).sum().backward()
    metrics = collect_load_metrics(moe, reset=False)
    bias_before = moe.gate.e_score_correction_bias.clone()
    if balance.uses_bias:
        update_expert_biases(moe, gamma=0.01, group=dist.group.WORLD)
    out = dict(y=y.detach(), x_grad=x.grad, grads=_grads(moe), experts=moe.experts.expert_ids, metrics=metrics,
               bias=moe.gate.e_score_correction_bias - bias_before)
    if world == 4:  # bad input: 6 experts over 4 ranks
        try:
            ExpertParallel(6, dist.group.WORLD)
        except ValueError as exc:
            out["error"] = str(exc)
    return out


def _reference(world, dim, balance_kwargs, fp8):
    args, balance = _args(dim), BalanceConfig(**balance_kwargs)
    full = _full_moe(args, balance)
    x_all, g_all = _inputs(world, dim)
    ys, x_grads = [], []
    for r in range(world):
        x = x_all[r].clone().requires_grad_()
        if fp8:  # the routed experts see the e4m3 round trip of x; gate and shared experts see x itself
            flat = x.view(-1, dim)
            routing = full.route(flat, seq_len=TOKENS // 2)
            q, s = deep_gemm.per_token_cast_to_fp8(flat.detach())
            deq = q.float() * s.repeat_interleave(128, 1)[:, :dim]
            x_q = flat + (deq - flat).detach()  # straight-through, as the dispatch's backward
            xg, mi, state = full.permute(x_q, routing)
            y = full.unpermute(full.experts(xg, mi), state, routing.weights) + full.shared(flat)
            y = y.view_as(x)
        else:
            y = full(x)
        (y * g_all[r]).sum().backward()
        ys.append(y.detach())
        x_grads.append(x.grad)
    counts = full.balancer.counts_for_update.clone()
    return ys, x_grads, _grads(full), counts


def _check(world, dim, balance_kwargs, fp8=False):
    results = run_distributed(_ep_rank, world, dim, balance_kwargs, fp8, timeout=150)
    ys, x_grads, grads, counts = _reference(world, dim, balance_kwargs, fp8)
    args = _args(dim)
    # Longest sum: a GEMM's K (dim, or 2 x moe_inter_dim in dgrad) or a weight grad over every rank's rows.
    # y runs gate, w13, w2 and the top-k combine; x_grad adds their backward; weight grads one more sum.
    n = max(dim, 2 * args.moe_inter_dim, world * TOKENS * args.n_activated_experts)
    for r, res in enumerate(results):
        assert_reorder_close(res["y"], ys[r], reduction=n, depth=4, msg=f"rank {r} y")
        assert_reorder_close(res["x_grad"], x_grads[r], reduction=n, depth=8, msg=f"rank {r} x_grad")
        sl = slice(res["experts"].start, res["experts"].stop)
        for name in ("experts.w13", "experts.w2"):
            assert_reorder_close(res["grads"][name], grads[name][sl], reduction=n, depth=8, msg=f"rank {r} {name}")
    for name, want in grads.items():
        if not name.startswith("experts."):  # replicated params: ranks' grads sum to the reference
            assert_reorder_close(sum(res["grads"][name] for res in results), want, reduction=n, depth=8, msg=name)
    if BalanceConfig(**balance_kwargs).uses_bias:  # bias update saw the global batch on every rank
        want = 0.01 * torch.sign(counts.mean() - counts)
        for res in results:
            torch.testing.assert_close(res["bias"], want)
    return results


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_ep2_matches_single_process_with_balance_loss_capacity_and_node_limit():
    kwargs = dict(strategy="aux_free+seq_aux", alpha=0.1, capacity_factor=1.0, num_nodes=4, max_nodes=2)
    results = _check(2, 32, kwargs)
    assert sum(res["metrics"]["moe/root/dropped"] for res in results) > 0  # capacity really dropped tokens


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_ep4_matches_single_process_and_rejects_indivisible_experts():
    results = _check(4, 32, dict(strategy="aux_free+z_loss"))
    assert "6 (physical) experts are not divisible by the expert-parallel size 4" in results[0]["error"]


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_ep2_fp8_dispatch_matches_single_process_on_quantized_tokens():
    _check(2, 160, dict(strategy="none"), fp8=True)  # 160 = one full and one partial 1x128 scale tile


def _peer_late_rank(rank, world):
    """Rank 0 posts its dispatch, and later its combine, before rank 1 has posted either: the posting
    must not wait for the peer (the exchange runs on the comm thread), or the side-channel barrier
    below times out. Grad mode travels with the work: y has a grad_fn under autograd, none under no_grad."""
    import datetime

    side = dist.new_group(backend="gloo")
    meet = lambda: dist.monitored_barrier(group=side, timeout=datetime.timedelta(seconds=60))  # noqa: E731
    torch.manual_seed(0)
    experts, dim = 4, 8
    weight = torch.randn(experts, dim, dim)
    ep = ExpertParallel(experts, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, dim, generator=g, requires_grad=True)
    indices = torch.randint(0, experts, (5, 2), generator=g)
    gates = torch.rand(5, 2, generator=g)
    if rank == 1:
        meet()  # rank 0 has posted its dispatch
    handle = ep.dispatch(x, indices)
    if rank == 0:
        meet()
    d = handle.wait()
    local = weight[ep.local_logical]
    rows = d.m_indices.long()
    y_grouped = torch.einsum("md,mod->mo", d.x_grouped, local[rows.clamp_min(0)]) * (rows >= 0)[:, None]
    if rank == 1:
        meet()  # rank 0 has posted its combine
    handle = ep.combine(y_grouped, d, gates)
    if rank == 0:
        meet()
    y = handle.wait()
    y.square().sum().backward()
    with torch.no_grad():
        y_no_grad = ep.combine(y_grouped.detach(), ep.dispatch(x, indices).wait(), gates).wait()
    return dict(x=x.detach(), idx=indices, gates=gates, y=y.detach(), x_grad=x.grad,
                no_grad_has_grad_fn=y_no_grad.grad_fn is not None, y_no_grad=y_no_grad)


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_dispatch_and_combine_return_before_the_peer_joins():
    results = run_distributed(_peer_late_rank, 2, timeout=120)
    torch.manual_seed(0)
    weight = torch.randn(4, 8, 8)
    for res in results:
        x = res["x"].clone().requires_grad_()
        y = (res["gates"][..., None] * torch.einsum("td,tkod->tko", x, weight[res["idx"]])).sum(1)
        y.square().sum().backward()
        # y: an 8-long dot, then 2 experts summed; x_grad: 2 x 8 terms through y
        assert_reorder_close(res["y"], y.detach(), reduction=16, depth=2)
        assert_reorder_close(res["y_no_grad"], y.detach(), reduction=16, depth=2)
        assert_reorder_close(res["x_grad"], x.grad, reduction=16, depth=2)
        assert not res["no_grad_has_grad_fn"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_routing_weights_travel_as_row_columns_with_their_gradient(dtype):
    """``_weight_columns``: the fp32 routing weights as columns of the rows' dtype. fp32/fp64 rows carry them
    exactly; 2-byte rows carry a rounded value plus its remainder, whose sum is within one rounding of the
    remainder (<= eps^2 of the weight: 2^-14 in bf16, 2^-20 in fp16, plus fp16's subnormal spacing). The
    gradient that comes back through the columns is the received one, rounded once to the rows' dtype
    (2^-8 relative in bf16)."""
    from models.deepseek_v3.expert_parallel import _weight_columns

    g = torch.Generator().manual_seed(0)
    w = (torch.rand(257, generator=g) * 2.5).requires_grad_()
    cols = _weight_columns(w, dtype)
    assert cols.dtype == dtype and cols.shape == (257, 1 if torch.finfo(dtype).eps <= torch.finfo(w.dtype).eps else 2)
    back = cols.float().sum(1)
    eps = torch.finfo(dtype).eps
    bound = 0.0 if cols.shape[1] == 1 else eps * eps
    subnormal = torch.finfo(dtype).smallest_normal * eps  # an fp16 remainder of a small weight may be subnormal
    assert ((back - w).abs() <= bound * w.abs() + subnormal).all()
    grad = torch.randn(257, generator=g)
    back.backward(grad)
    assert ((w.grad - grad).abs() <= eps * grad.abs()).all()
