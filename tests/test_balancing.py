"""Expert balancing: losses against float64 loop references, routing limits, capacity, metrics, bias updates."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models.deepseek_v3.balancing import (
    BalanceConfig,
    ExpertBalancer,
    attach_aux_loss,
    balance_loss,
    capacity_keep_mask,
    collect_load_metrics,
    expert_counts,
    load_entropy,
    max_violation,
    node_limited_mask,
    update_expert_biases,
    z_loss,
)
from tests.dist_utils import run_distributed


def _balance_loss_loops(scores, indices, num_experts, seq_len):
    """The V3 report's formula written out token by token in float64."""
    scores = scores.double()
    tokens, top_k = indices.shape
    total = 0.0
    groups = tokens // seq_len
    for g in range(groups):
        rows = range(g * seq_len, (g + 1) * seq_len)
        f = [0.0] * num_experts
        p = [0.0] * num_experts
        for t in rows:
            norm = scores[t] / scores[t].sum()
            for i in range(num_experts):
                p[i] += float(norm[i]) / seq_len
            for k in range(top_k):
                f[int(indices[t, k])] += num_experts / (top_k * seq_len)
        total += sum(fi * pi for fi, pi in zip(f, p))
    return total / groups


@pytest.mark.parametrize("tokens,experts,top_k,seq_len", [(12, 8, 2, 4), (30, 6, 3, 10), (16, 16, 4, 16)])
def test_balance_loss_matches_report_formula(tokens, experts, top_k, seq_len):
    scores = torch.rand(tokens, experts) + 0.01
    indices = torch.rand(tokens, experts).topk(top_k, -1).indices
    got = balance_loss(scores, indices, experts, seq_len)
    # fp32 accumulation over <= 30 tokens: relative error far below 1e-5
    assert got.item() == pytest.approx(_balance_loss_loops(scores, indices, experts, seq_len), rel=1e-5)
    whole = balance_loss(scores, indices, experts, None)
    assert whole.item() == pytest.approx(_balance_loss_loops(scores, indices, experts, tokens), rel=1e-5)


def test_balance_loss_is_one_when_perfectly_balanced_and_grows_with_collapse():
    experts = 4
    indices = torch.arange(8).remainder(experts)[:, None]
    uniform = torch.full((8, experts), 0.5)
    assert balance_loss(uniform, indices, experts).item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.zeros(8, 1, dtype=torch.long)
    peaked = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).repeat(8, 1)
    assert balance_loss(peaked, collapsed, experts).item() > 3.5


def test_balance_loss_gradient_flows_only_through_probabilities():
    scores = (torch.rand(8, 4) + 0.1).requires_grad_()
    indices = torch.rand(8, 4).topk(2, -1).indices
    balance_loss(scores, indices, 4, 4).backward()
    assert torch.isfinite(scores.grad).all() and scores.grad.abs().sum() > 0


def test_balance_loss_rejects_seq_len_that_does_not_divide():
    with pytest.raises(ValueError, match="seq_len=5"):
        balance_loss(torch.rand(12, 4), torch.zeros(12, 1, dtype=torch.long), 4, 5)


def test_z_loss_matches_float64():
    logits = torch.randn(10, 7) * 3
    want = torch.logsumexp(logits.double(), -1).square().mean()
    assert z_loss(logits).item() == pytest.approx(want.item(), rel=1e-6)  # fp32 logsumexp: ~1e-7 relative


def test_attach_aux_loss_gives_the_loss_its_gradient():
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)
    aux = (w.square().sum() * 0.1)
    attach_aux_loss(x @ w, aux).sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    ((x @ w_ref).sum() + w_ref.square().sum() * 0.1).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)  # same fp32 ops, reordered sum


def _node_mask_loops(scores, num_nodes, max_nodes, top_k):
    tokens, experts = scores.shape
    per = experts // num_nodes
    best = max(1, top_k // max_nodes)
    mask = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        node_scores = [sorted(scores[t, n * per:(n + 1) * per].tolist(), reverse=True)[:best] for n in range(num_nodes)]
        ranked = sorted(range(num_nodes), key=lambda n: -sum(node_scores[n]))[:max_nodes]
        for n in ranked:
            mask[t, n * per:(n + 1) * per] = True
    return mask


@pytest.mark.parametrize("tokens,experts,nodes,max_nodes,top_k", [(9, 16, 4, 2, 4), (5, 12, 6, 3, 6), (7, 8, 2, 1, 3)])
def test_node_limited_mask_matches_loops_and_limits_nodes(tokens, experts, nodes, max_nodes, top_k):
    scores = torch.rand(tokens, experts)
    mask = node_limited_mask(scores, nodes, max_nodes, top_k)
    assert torch.equal(mask, _node_mask_loops(scores, nodes, max_nodes, top_k))
    chosen = scores.masked_fill(~mask, float("-inf")).topk(top_k, -1).indices
    per = experts // nodes
    assert all(len(set((row // per).tolist())) <= max_nodes for row in chosen)


def test_node_limit_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="top-k=5 is larger than the 4 experts reachable"):
        ExpertBalancer(8, 5, BalanceConfig(num_nodes=4, max_nodes=2))
    with pytest.raises(ValueError, match="num_nodes=3 must divide"):
        ExpertBalancer(8, 2, BalanceConfig(num_nodes=3, max_nodes=1))


def _capacity_loops(indices, weights, experts, cf, policy):
    tokens, top_k = indices.shape
    cap = math.ceil(cf * tokens * top_k / experts)
    keep = torch.zeros_like(indices, dtype=torch.bool)
    for e in range(experts):
        slots = [(t, k) for t in range(tokens) for k in range(top_k) if indices[t, k] == e]
        if policy == "probs":
            slots.sort(key=lambda s: (-float(weights[s]), s[0] * top_k + s[1]))
        for s in slots[:cap]:
            keep[s] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("tokens,experts,top_k,cf", [(20, 4, 2, 1.0), (13, 5, 3, 0.5), (8, 8, 1, 2.0)])
def test_capacity_keep_mask_matches_loops(policy, tokens, experts, top_k, cf):
    skewed = torch.rand(tokens, experts) * torch.linspace(2.0, 0.1, experts)
    indices = skewed.topk(top_k, -1).indices
    weights = torch.rand(tokens, top_k)
    keep = capacity_keep_mask(indices, weights, experts, cf, policy)
    assert torch.equal(keep, _capacity_loops(indices, weights, experts, cf, policy))
    kept_counts = expert_counts(torch.where(keep, indices, -1), experts)
    assert kept_counts.max() <= math.ceil(cf * tokens * top_k / experts)


def test_load_metrics_on_known_counts():
    counts = torch.tensor([4.0, 2.0, 1.0, 1.0])
    assert max_violation(counts).item() == pytest.approx(4 / 2 - 1)
    p = counts / 8
    assert load_entropy(counts).item() == pytest.approx(float(-(p * p.log()).sum() / math.log(4)))
    assert load_entropy(torch.ones(6)).item() == pytest.approx(1.0)
    assert torch.equal(expert_counts(torch.tensor([[0, 2], [2, -1]]), 3), torch.tensor([1.0, 0.0, 2.0]))


def test_config_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="unknown part"):
        BalanceConfig(strategy="aux_free+magic")
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        BalanceConfig(strategy="none+aux")
    with pytest.raises(ValueError, match="capacity_factor"):
        BalanceConfig(capacity_factor=0.0)
    with pytest.raises(ValueError, match="gamma"):
        BalanceConfig(gamma=-1.0)


class _Gate(nn.Module):
    def __init__(self, experts, with_bias):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False) if with_bias else None


class _FakeMoE(nn.Module):
    """Just the two things the trainer hooks look for: a gate with a bias and an ExpertBalancer."""

    def __init__(self, experts=6, top_k=2, strategy="aux_free", with_bias=True, **kw):
        super().__init__()
        self.gate = _Gate(experts, with_bias)
        self.balancer = ExpertBalancer(experts, top_k, BalanceConfig(strategy=strategy, **kw))


def test_balancer_applies_capacity_losses_and_records_load():
    moe = _FakeMoE(experts=4, top_k=2, strategy="aux_free+seq_aux+z_loss", capacity_factor=0.5, alpha=0.1)
    logits = torch.randn(8, 4, requires_grad=True)
    scores = logits.sigmoid()
    indices = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 2)
    weights = torch.gather(scores, 1, indices)
    new_idx, new_w = moe.balancer(scores, logits, indices, weights, seq_len=4)
    # capacity = ceil(0.5 * 8 * 2 / 4) = 2 per expert: experts 0 and 1 keep 2 of 6
    assert (new_idx == -1).sum() == 8 and torch.all(new_w[new_idx < 0] == 0)
    new_w.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    m = collect_load_metrics(moe)
    assert m["moe/root/dropped"] == 8.0 and m["moe/drop_frac"] == 0.5
    assert m["moe/load"] == [[2.0, 2.0, 2.0, 2.0]] and m["moe/max_vio"] == 0.0
    assert m["moe/loss_seq_aux"] > 0 and m["moe/loss_z_loss"] > 0
    assert collect_load_metrics(moe)["moe/load"] == [[0.0] * 4]  # reset after collection


def test_balancer_counts_nothing_in_eval_mode():
    moe = _FakeMoE().eval()
    moe.balancer(torch.rand(4, 6), None, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2))
    assert moe.balancer.counts_total.sum() == 0


def test_recomputed_forward_is_not_counted_twice():
    """Whole-block recompute is applied from outside (``training.recompute.checkpointed``): its replay in backward
    leaves the balancer's counts and loss sums as the one forward made them (the model itself counts every
    forward), and the gradient is that of no recompute."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from training.recompute import checkpointed

    results = []
    for recompute in (False, True):
        moe = _FakeMoE(experts=4, top_k=1, strategy="aux_free+seq_aux")
        logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()

        def routed(lg, moe=moe):
            scores = lg.sigmoid()
            idx = scores.topk(1, -1).indices
            return moe.balancer(scores, lg, idx, scores.gather(1, idx), seq_len=4)[1] * 2

        with set_checkpoint_early_stop(False):  # the whole forward re-runs in backward, the balancer included
            out = checkpointed(routed, moe, logits) if recompute else routed(logits)
            out.sum().backward()
        b = moe.balancer
        results.append((b.counts_total.clone(), b.counts_for_update.clone(), int(b.loss_calls),
                        {k: v.clone() for k, v in b.loss_sums.items()}, logits.grad))
    (counts, update, calls, sums, grad), again = results
    assert counts.sum() == 8 and calls == 1
    assert torch.equal(again[0], counts) and torch.equal(again[1], update) and again[2] == calls
    assert again[3].keys() == sums.keys() and all(torch.equal(again[3][k], sums[k]) for k in sums)
    assert torch.isfinite(grad).all() and torch.equal(again[4], grad)  # the replay computes the same ops


def test_moe_rejects_aux_free_on_a_gate_without_bias_before_training():
    from models.deepseek_v3.args import PRESETS, ModelArgs
    from models.deepseek_v3.moe import MoE

    softmax = ModelArgs(**{**PRESETS["debug_tiny"], "score_func": "softmax"})
    assert MoE(softmax).balancer.config.strategy == "none"  # default follows the gate
    with pytest.raises(ValueError, match="needs the gate's aux-loss-free bias"):
        MoE(softmax, balance=BalanceConfig(strategy="aux_free+seq_aux"))
    assert MoE(ModelArgs(**PRESETS["debug_tiny"])).balancer.config.uses_bias


def test_update_expert_biases_sign_rule_and_recenter():
    moe = _FakeMoE(experts=4, top_k=1)
    moe.balancer.record(torch.tensor([[0], [0], [0], [1], [2], [2]]))  # counts 3,1,2,0 mean 1.5
    assert update_expert_biases(moe, gamma=0.01) == 1
    torch.testing.assert_close(moe.gate.bias.data, torch.tensor([-0.01, 0.01, -0.01, 0.01]))
    assert moe.balancer.counts_for_update.sum() == 0  # cleared
    moe.balancer.record(torch.tensor([[0], [0]]))  # counts 2,0,0,0
    update_expert_biases(moe, gamma=0.01, recenter=True)
    assert abs(moe.gate.bias.sum().item()) < 1e-7
    assert moe.gate.bias.dtype == torch.float32


def test_update_expert_biases_bad_input():
    with pytest.raises(ValueError, match="has no aux-loss-free bias"):
        update_expert_biases(_FakeMoE(strategy="seq_aux"), gamma=0.001)
    with pytest.raises(ValueError, match="needs the gate's aux-loss-free bias, but the gate has none"):
        update_expert_biases(_FakeMoE(with_bias=False), gamma=0.001)
    with pytest.raises(ValueError, match="no MoE layer"):
        update_expert_biases(nn.Linear(2, 2), gamma=0.001)


def _bias_update_rank(rank, world_size):
    torch.manual_seed(rank)
    moe = _FakeMoE(experts=5, top_k=2)
    idx = torch.randint(0, 5, (16, 2))
    moe.balancer.record(idx)
    local = expert_counts(idx, 5)
    update_expert_biases(moe, gamma=0.5, group=dist.group.WORLD)
    return local, moe.gate.bias.detach().clone()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_update_expert_biases_uses_the_global_batch():
    results = run_distributed(_bias_update_rank, 2, timeout=90)
    total = results[0][0] + results[1][0]
    want = 0.5 * torch.sign(total.mean() - total)
    for _, bias in results:
        torch.testing.assert_close(bias, want)
