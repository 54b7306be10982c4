"""EPLB: the published example reproduced exactly, plan invariants, the load tracker, plan application."""

import pytest
import torch
import torch.distributed as dist

from models.deepseek_v3.eplb import (
    EplbPlan,
    ExpertLoadEMA,
    local_physical_experts,
    rebalance_experts,
    redistribute_expert_weights,
    sync_replica_grads,
)
from models.deepseek_v3.expert_parallel import ExpertParallel
from tests.dist_utils import run_distributed
from tests.tolerances import assert_reorder_close

# The EP runs and the one-process references add the same fp32 terms in another order (GEMMs of other
# sizes, rows split over ranks): tests/tolerances.py bounds that from the magnitudes and reduction lengths.

# /work/shared/golden/README.md: deepseek-ai/EPLB README example
GOLDEN_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
GOLDEN_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def _check_plan(weight, phy2log, log2phy, logcnt, num_gpus):
    layers, experts = weight.shape
    for layer in range(layers):
        counts = torch.bincount(phy2log[layer], minlength=experts)
        assert torch.equal(counts, logcnt[layer]) and counts.min() >= 1
        for e in range(experts):
            slots = log2phy[layer, e]
            real = slots[slots >= 0]
            assert real.numel() == logcnt[layer, e]
            assert torch.all(phy2log[layer, real] == e)
    assert phy2log.shape[1] % num_gpus == 0


def _gpu_max_load(weight, phy2log, logcnt, num_gpus):
    per_copy = weight.double() / logcnt.double()
    load = per_copy.gather(1, phy2log)
    return load.view(weight.shape[0], num_gpus, -1).sum(-1).amax(-1)


def test_reproduces_the_published_hierarchical_example():
    weight = torch.tensor(GOLDEN_WEIGHT)
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == GOLDEN_PHY2LOG
    _check_plan(weight, phy2log, log2phy, logcnt, 8)


def test_hierarchical_plan_keeps_each_group_on_one_node():
    torch.manual_seed(1)
    weight = torch.randint(1, 500, (3, 32)).float()
    groups, nodes, gpus = 8, 4, 8
    phy2log, log2phy, logcnt = rebalance_experts(weight, 48, groups, nodes, gpus)
    _check_plan(weight, phy2log, log2phy, logcnt, gpus)
    node_of_slot = torch.arange(48) // (48 // nodes)
    for layer in range(3):
        for g in range(groups):
            in_group = (phy2log[layer] // (32 // groups)) == g
            assert node_of_slot[in_group].unique().numel() == 1


@pytest.mark.parametrize("experts,replicas,groups,nodes,gpus",
                         [(12, 16, 3, 2, 8), (16, 24, 1, 1, 4), (10, 10, 5, 2, 2)])
def test_global_policy_plans_are_valid_and_beat_no_redundancy(experts, replicas, groups, nodes, gpus):
    torch.manual_seed(experts)
    weight = (torch.rand(4, experts) ** 3 * 1000).round() + 1  # skewed loads
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    _check_plan(weight, phy2log, log2phy, logcnt, gpus)
    naive = weight.view(4, gpus, -1).sum(-1).amax(-1) if experts % gpus == 0 else None
    got = _gpu_max_load(weight, phy2log, logcnt, gpus)
    assert torch.all(got >= weight.sum(-1) / gpus - 1e-6)  # never better than perfect balance
    if naive is not None:
        assert torch.all(got <= naive + 1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_replicas=8), "num_replicas=8 < 12"),
    (dict(num_groups=5), "num_groups=5 must divide"),
    (dict(num_gpus=6), "num_gpus=6 must divide num_replicas=16"),
    (dict(num_nodes=3), "num_nodes=3 must divide num_gpus=8"),
    (dict(num_gpus=0), "num_gpus must be >= 1"),
])
def test_arguments_that_do_not_divide_are_value_errors(kwargs, match):
    args = dict(num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8) | kwargs
    with pytest.raises(ValueError, match=match):
        rebalance_experts(torch.tensor(GOLDEN_WEIGHT), **args)


def test_load_ema_tracks_and_plans():
    ema = ExpertLoadEMA(2, 12, decay=0.5)
    with pytest.raises(ValueError, match="no load measured"):
        ema.plan(16, 4, 2, 8)
    ema.update(torch.tensor(GOLDEN_WEIGHT))
    ema.update(torch.tensor(GOLDEN_WEIGHT) * 3)
    torch.testing.assert_close(ema.load, torch.tensor(GOLDEN_WEIGHT, dtype=torch.float64) * 2)
    plan = ema.plan(16, 4, 2, 8)
    assert plan.phy2log.tolist() == GOLDEN_PHY2LOG  # scaling loads by 2 does not change the plan
    with pytest.raises(ValueError, match="counts shape"):
        ema.update(torch.zeros(3, 12))
    ident = EplbPlan.identity(2, 5)
    assert ident.phy2log.tolist() == [list(range(5))] * 2 and ident.logcnt.sum() == 10


def _redundant_dispatch(rank):
    torch.manual_seed(0)
    experts, dim, k = 6, 16, 2
    weight = torch.randn(experts, dim, dim)
    phy2log = torch.tensor([0, 1, 2, 0, 5, 3, 4, 5, 0, 1])  # expert 0 three copies, 1 and 5 two
    ep = ExpertParallel(experts, dist.group.WORLD, phy2log=phy2log)
    w = weight.clone().requires_grad_()
    local = w[ep.local_logical]  # this rank's physical experts, views of the logical weights
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10, dim, generator=g, requires_grad=True)
    indices = torch.stack([torch.zeros(10, dtype=torch.long), torch.randint(1, experts, (10,), generator=g)], 1)
    gates = torch.rand(10, k, generator=g)
    handle = ep.dispatch(x, indices)
    d = handle.wait()
    rows = d.m_indices.long()
    y_grouped = torch.einsum("md,mod->mo", d.x_grouped, local[rows.clamp_min(0)]) * (rows >= 0)[:, None]
    y = ep.combine(y_grouped, d, gates).wait()
    y.square().sum().backward()
    return dict(x=x.detach(), idx=indices, gates=gates, y=y.detach(), w_grad=w.grad, x_grad=x.grad,
                rows_per_slot=d.tokens_per_expert, local_logical=ep.local_logical)


def _empty_rank_dispatch(rank):
    """All tokens choose rank 0's experts: rank 1 receives nothing yet joins every exchange, forward and back."""
    from models.deepseek_v3.args import PRESETS, ModelArgs
    from models.deepseek_v3.moe import Experts

    args = ModelArgs(**{**PRESETS["debug_tiny"], "n_routed_experts": 4, "n_expert_groups": 2, "n_limited_groups": 1})
    torch.manual_seed(0)
    full = Experts(args)
    full.reset_parameters(0.1)
    experts = Experts(args, range(2 * rank, 2 * rank + 2))
    with torch.no_grad():
        experts.w13.copy_(full.w13[2 * rank:2 * rank + 2])
        experts.w2.copy_(full.w2[2 * rank:2 * rank + 2])
    ep = ExpertParallel(4, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, args.dim, generator=g, requires_grad=True)
    indices = torch.tensor([[0, 1]] * 6)
    d = ep.dispatch(x, indices).wait()
    y = ep.combine(experts(d.x_grouped, d.m_indices), d, torch.full((6, 2), 0.5)).wait()
    y.square().sum().backward()
    return dict(x=x.detach(), y=y.detach(), x_grad=x.grad, received=d.x_grouped.shape[0])


def _redistribute_rank(rank, world_size):
    torch.manual_seed(0)
    logical = torch.randn(6, 3, 2)  # 6 logical experts' weights, same on every rank
    old = torch.tensor([0, 1, 2, 3, 4, 5, 0, 5])  # 4 slots per rank
    new = torch.tensor([5, 5, 3, 1, 0, 2, 4, 1])
    local = logical[local_physical_experts(old, rank, world_size)]
    moved = redistribute_expert_weights(local, old, new)
    grads = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(rank + 10))
    synced = sync_replica_grads(grads, new, 6)
    return moved, grads, synced, _redundant_dispatch(rank), _empty_rank_dispatch(rank)


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_plan_application_and_redundant_experts_in_the_ep_runtime():
    """One 2-rank run: moving weights to a new plan, syncing replica grads, dispatching to replicas."""
    results = run_distributed(_redistribute_rank, 2, timeout=120)
    _check_redundant_dispatch([res[3] for res in results])
    _check_empty_rank([res[4] for res in results])
    torch.manual_seed(0)
    logical = torch.randn(6, 3, 2)
    new = torch.tensor([5, 5, 3, 1, 0, 2, 4, 1])
    for rank, (moved, _, _, _, _) in enumerate(results):
        assert torch.equal(moved, logical[local_physical_experts(new, rank, 2)])  # exact copies
    all_grads = torch.cat([g for _, g, _, _, _ in results])
    want = torch.zeros(6, 3, 2).index_add_(0, new, all_grads)
    for rank, (_, _, synced, _, _) in enumerate(results):
        # each synced row sums at most 3 replicas' rows (new has expert 5 twice, 1 twice), in another order
        assert_reorder_close(synced, want[local_physical_experts(new, rank, 2)], reduction=3)


def _check_redundant_dispatch(results):
    torch.manual_seed(0)
    weight = torch.randn(6, 16, 16).requires_grad_()
    for res in results:
        x = res["x"].clone().requires_grad_()
        y = (res["gates"][..., None] * torch.einsum("td,tkod->tko", x, weight[res["idx"]])).sum(1)
        y.square().sum().backward()
        # y: a 16-long dot then a sum over 2 experts; x_grad: 2 x 16 terms through y; w_grad: 6 tokens a rank
        assert_reorder_close(res["y"], y.detach(), reduction=32, depth=2)
        assert_reorder_close(res["x_grad"], x.grad, reduction=32, depth=2)
    assert_reorder_close(results[0]["w_grad"] + results[1]["w_grad"], weight.grad, reduction=32, depth=3)
    # every token picks expert 0: each of its three replicas (slots 0, 3, 8) must receive rows
    slots0 = [res["rows_per_slot"][res["local_logical"] == 0] for res in results]
    assert sum(int((s > 0).sum()) for s in slots0) == 3


def _check_empty_rank(results):
    from models.deepseek_v3.args import PRESETS, ModelArgs
    from models.deepseek_v3.moe import Experts

    assert results[1]["received"] == 0 and results[0]["received"] > 0
    args = ModelArgs(**{**PRESETS["debug_tiny"], "n_routed_experts": 4, "n_expert_groups": 2, "n_limited_groups": 1})
    torch.manual_seed(0)
    full = Experts(args)
    full.reset_parameters(0.1)
    for res in results:
        x = res["x"].clone().requires_grad_()
        rows = torch.cat([x, x])  # each token once per chosen expert (0 then 1), as one group each
        m = torch.tensor([0] * 6 + [1] * 6, dtype=torch.int32)
        pad = torch.full((128 - 6,), -1, dtype=torch.int32)
        zeros = x.new_zeros(128 - 6, x.shape[1])
        out = full(torch.cat([rows[:6], zeros, rows[6:], zeros]), torch.cat([m[:6], pad, m[6:], pad]))
        y = 0.5 * (out[:6] + out[128:134])
        y.square().sum().backward()
        # w13 (K = dim 32), w2 (K = 16), the 2-expert average; x_grad back through w2 and w13 (K <= 32)
        assert_reorder_close(res["y"], y.detach(), reduction=args.dim, depth=3)
        assert_reorder_close(res["x_grad"], x.grad, reduction=2 * args.moe_inter_dim, depth=5)
