"""Recompute policies that really drop what they recompute, and FP8 activation caching (issue 14), applied to the
plain model from outside (``training.memory_policy.MemoryPolicy``) as the trainer applies them.

Gradients: a policy changes what backward reads, not the graph it runs. The saved-tensor hooks remake a value
with the same ops on the same inputs, and whole-block recompute replays the layer's forward with the same ops,
its backward running through the same nodes in the same order, so every policy gives the gradients of no
recompute bit for bit (``torch.equal``). A remade tensor that came out different by one rounding would show.
"""

from __future__ import annotations

import pytest
import torch

import accel.wgrad
from deep_gemm import calc_diff
from models.deepseek_v3 import ModelArgs, Transformer, lm_losses, lm_losses_from_hidden
from models.deepseek_v3.layers import Linear, RMSNorm
from models.deepseek_v3.mtp import mtp_logits
from recipes.bench_memory import saved_bytes
from tests.test_model import randomize
from training.memory_policy import MemoryPolicy

POLICIES = [("norm",), ("mla_up",), ("v3",), ("swiglu",), ("v3", "swiglu"), ("block",), ("v3", "block")]


def _grads(recompute, tokens, segmented: bool = False, **overrides):
    """Parameter gradients of the debug_tiny model (MTP on) on ``tokens``. ``segmented``: backward the way
    the overlapped pipeline schedule runs it: loss part, then block by block with ``inputs=`` restricted
    to that block's parameters and its input, weight gradients deferred and run afterwards. The trunk
    starts from a leaf (as a stage's received input), so the loss part's embedding gradient (MTP) does
    not reach back through the trunk."""
    torch.manual_seed(1)
    args = ModelArgs.preset("debug_tiny", recompute=recompute, **overrides)
    model = randomize(Transformer(args))
    policy = MemoryPolicy(model, args)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if not segmented:
        with policy.applied():  # as a stage runs it: whole-block recompute is the policy's wrapper
            h = model.run_layers(model.embed_tokens(inputs), wrap=policy.recomputed)
            logits, mtp = model.final(h), mtp_logits(args, model.mtp, model.embed, model.head, h, inputs,
                                                      policy.recomputed)
        lm_losses(args, logits, mtp, labels)["loss"].backward()
    else:
        closures = []
        with accel.wgrad.collect_into(closures.append), policy.applied():
            emb = model.embed_tokens(inputs)
            bounds = [emb.detach().requires_grad_()]
            for i in range(args.n_layers):
                bounds.append(model.run_layers(bounds[-1], i, i + 1, wrap=policy.recomputed))
            h = bounds[-1]
            mtp = mtp_logits(args, model.mtp, model.embed, model.head, h, inputs, policy.recomputed)
            loss = lm_losses(args, model.final(h), mtp, labels)["loss"]
            head = [*model.norm.parameters(), *model.head.parameters(), *model.mtp.parameters(),
                    *model.embed.parameters()]
            torch.autograd.backward(loss, inputs=[h, *head])
            grad = h.grad
            for i in reversed(range(args.n_layers)):
                prev = bounds[i]
                torch.autograd.backward(bounds[i + 1], grad, inputs=[*model.layers[i].parameters(), prev])
                grad, prev.grad = prev.grad, None
            emb.backward(grad)
        assert closures, "the Linears' weight gradients were not deferred"
        for run in closures:
            run()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segmented+deferred"])
def test_every_policy_gives_the_gradients_of_no_recompute(segmented):
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    base = _grads((), tokens)
    for policy in POLICIES:
        got = _grads(policy, tokens, segmented)
        assert got.keys() == base.keys(), policy
        for n in base:
            assert torch.equal(got[n], base[n]), (policy, n)


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segmented+deferred"])
def test_fp8_recompute_gives_the_gradients_of_fp8_without_recompute(segmented):
    """With FP8 (activation caching on, as in V3) a policy changes what is kept, not the numbers: a recomputed
    norm or up-projection output feeds its GEMM's weight gradient through the same 1x128 e4m3 cast the
    cached input would have been (``deep_gemm.linear``). The remake is the same ops on the same inputs, so the
    gradients are equal bit for bit (reading x unrounded where the cache rounds it, as before this was fixed,
    gave calc_diff ~1e-3). Whole-block recompute is not covered: its
    replay keeps the SwiGLU output exact where the FP8 stash refills it from the e4m3 input (calc_diff ~2e-3;
    docs/memory.md)."""
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    base = _grads((), tokens, fp8=True)
    for policy in [p for p in POLICIES if "block" not in p]:
        got = _grads(policy, tokens, segmented, fp8=True)
        assert got.keys() == base.keys(), policy
        for n in base:
            assert torch.equal(got[n], base[n]), (policy, n, calc_diff(got[n], base[n]))


def test_the_consumer_keeps_the_producer_input_not_its_output():
    """norm -> Linear: without recompute both x and norm(x) are kept; with the policy's norm recompute only x (the
    Linear's saved view of norm(x) is kept as a recipe, remade from x before the Linear's backward): the same
    gradients bit for bit (the same norm on the same x)."""
    norm, lin = RMSNorm(64), Linear(64, 32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    modules = torch.nn.ModuleDict({"norm": norm, "lin": lin})
    x = torch.randn(10, 64, requires_grad=True)
    grads, kept = [], []
    for recompute in ((), ("norm",)):
        x.grad = lin.weight.grad = norm.weight.grad = None
        policy = MemoryPolicy(modules, ModelArgs.preset("debug_tiny", recompute=recompute))
        nbytes, y = saved_bytes(lambda: lin(norm(x)), modules, policy)
        policy.remove()
        y.square().sum().backward()
        kept.append(nbytes)
        grads.append([x.grad, lin.weight.grad, norm.weight.grad])
    assert kept == [2 * x.numel() * 4, x.numel() * 4]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_policy_leaves_the_model_as_it_was():
    """The policy is applied from outside: the model's parameters, their names and its outputs are the same with
    and without it, and ``remove()`` takes its hooks off (then both x and norm(x) are kept again)."""
    args = ModelArgs.preset("debug_tiny", recompute=("v3", "swiglu"))
    torch.manual_seed(1)
    model = randomize(Transformer(args))
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    plain = model(tokens)
    policy = MemoryPolicy(model, args)
    with policy.applied():
        ruled = model(tokens)
    assert torch.equal(plain, ruled) and [n for n, _ in model.named_parameters()] == names
    norm, lin = model.layers[0].attn_norm, model.layers[0].attn.wq_a
    x = torch.randn(5, args.dim, requires_grad=True)
    kept = [saved_bytes(lambda: lin(norm(x)), model, policy)[0]]
    policy.remove()
    kept.append(saved_bytes(lambda: lin(norm(x)), model, policy)[0])
    assert kept == [x.numel() * 4, 2 * x.numel() * 4]  # x only; then x and norm(x)


def test_fp8_cache_default_and_bad_input():
    assert ModelArgs.preset("debug_tiny", fp8=True).fp8_cache
    assert not ModelArgs.preset("debug_tiny").fp8_cache
    assert not ModelArgs.preset("debug_tiny", fp8=True, fp8_cache_activations=False).fp8_cache
    with pytest.raises(ValueError, match="fp8_cache_activations=True needs fp8=True"):
        ModelArgs.preset("debug_tiny", fp8_cache_activations=True)


@pytest.mark.timeout(120)
def test_fp8_cached_model_matches_the_uncached_fp8_model():
    """FP8 caching changes only what backward reads: the wgrads see x rounded to e4m3 a second time (the
    cached 1x128 cast re-tiled to 128x1) and SwiGLU's backward its input rounded to e4m3 once. Both are
    e4m3 roundings (relative error <= 2^-4 per element, calc_diff ~3e-4 per rounded operand, see
    test_deep_gemm_linear). Tolerances per parameter gradient, calc_diff: cached vs uncached FP8 < 5e-3
    (measured <= 3e-3: a few extra roundings along the gradient's path); cached vs fp32 < 1e-2 (the
    uncached FP8 run itself is at up to 5e-3 from fp32 here, each of the GEMMs a gradient passes being
    at ~2e-3). A lost or doubled contribution moves a gradient by calc_diff > 0.1."""
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    fp32 = _grads((), tokens)
    uncached = _grads((), tokens, fp8=True, fp8_cache_activations=False)
    cached = _grads((), tokens, fp8=True)
    for n in fp32:
        assert calc_diff(cached[n], uncached[n]) < 5e-3, n
        assert calc_diff(cached[n], fp32[n]) < 1e-2, n


@pytest.mark.parametrize("recompute", [(), ("v3",)])
def test_losses_from_hidden_equal_lm_losses_of_the_logits(recompute):
    """Training's loss path (fused_ce, no logits kept; with v3 the final and MTP norms recomputed too) gives
    lm_losses of the logits and the same gradients: fp32, the logits' rows computed in chunks (GEMM
    rounding may differ per row) and the log-sum-exp by the reference op: rtol 1e-5 on fp32 values of
    magnitude ~1 with reductions of <= 64 terms (64 * 2^-24 ~ 4e-6), atol 1e-7 for entries that cancel to ~0."""
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (False, True):
        torch.manual_seed(1)
        args = ModelArgs.preset("debug_tiny", recompute=recompute)
        model = randomize(Transformer(args))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with MemoryPolicy(model, args).applied():
            h = model.run_layers(model.embed_tokens(inputs))
            if fused:
                parts = lm_losses_from_hidden(args, model.norm, model.head, model.mtp, model.embed, h, inputs,
                                              labels)
        if not fused:
            parts = lm_losses(args, model.final(h), model.mtp_logits(h, inputs), labels)
        parts["loss"].backward()
        results.append((parts, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain, g0), (fused, g1) = results
    for key in ("loss", "main"):
        torch.testing.assert_close(fused[key], plain[key], rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.stack(fused["mtp"]), torch.stack(plain["mtp"]), rtol=1e-6, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def _ep_ffn_rank(rank, world):
    """On each of 2 expert-parallel ranks: a MoE block as the overlapped pipeline runs it (its plan pieces,
    ``plan.layer_pieces``: each piece's backward on its own, the reverse all-to-alls posted by the plan) and
    as its plain forward and ``backward()``, without recompute, with v3 + swiglu recompute and with
    whole-block recompute (the plan recomputes each compute piece; the plain forward the whole block, its
    all-to-alls included); returns the gradients of each."""
    import torch.distributed as dist

    from models.deepseek_v3 import Block
    from models.deepseek_v3.expert_parallel import ExpertParallel
    from models.deepseek_v3.moe import MoE
    from models.deepseek_v3.plan import Exchange, Run, layer_pieces
    from models.deepseek_v3.rope import rope_cos_sin
    from training.stages import expert_range

    out = {}
    for recompute in ((), ("v3", "swiglu"), ("block",)):
        for path in ("stage", "block"):
            torch.manual_seed(0)
            args = ModelArgs.preset("debug_tiny", recompute=recompute)
            block = Block(args, layer_id=1)
            block.ffn = MoE(args, 1, expert_range(args, rank, world))
            block.ffn.ep = ExpertParallel(args.n_routed_experts, dist.group.WORLD)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in block.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            g = torch.Generator().manual_seed(10 + rank)
            h = torch.randn(2, 6, args.dim, generator=g).requires_grad_()
            cos, sin = rope_cos_sin(args, torch.arange(6))
            policy = MemoryPolicy(block, args)
            if path == "stage":
                run = Run(layer_pieces(block, cos, sin, wrap=policy.recomputed), h=h)
                with policy.applied():
                    y = run.forward()["h"]
                assert sum(isinstance(p, Exchange) for p in run.pieces) == 2  # dispatch and combine
                run.backward(h=torch.randn(y.shape, generator=g))
            else:
                with policy.applied():
                    y = policy.recomputed(block, block)(h, cos, sin)
                (y * torch.randn(y.shape, generator=g)).sum().backward()
            grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
            out[(recompute, path)] = (y.detach(), h.grad, grads)
    return out


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_recompute_with_expert_parallel_all_to_alls():
    from tests.dist_utils import run_distributed

    for rank_out in run_distributed(_ep_ffn_rank, 2, timeout=150):
        base = rank_out[((), "block")]
        for key, (y, gh, grads) in rank_out.items():
            torch.testing.assert_close(y, base[0], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k} y: {m}")
            torch.testing.assert_close(gh, base[1], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k} dh: {m}")
            assert grads.keys() == base[2].keys(), key
            for n in grads:
                torch.testing.assert_close(grads[n], base[2][n], rtol=1e-5, atol=1e-7,
                                           msg=lambda m, k=key, n=n: f"{k} {n}: {m}")


def test_router_keeps_its_bf16_input_not_an_fp32_copy():
    """The gate's fp32 logits keep x (bf16) for backward, not x.float(): half the bytes; gradients are
    autograd's of F.linear(x.float(), w.float()) exactly (same ops in the same order)."""
    from models.deepseek_v3.moe import Gate

    gate = Gate(ModelArgs.preset("debug_tiny", dim=512))  # wide rows: x dominates the per-token routing tensors
    torch.nn.init.normal_(gate.weight, std=0.3)
    x = torch.randn(10, gate.dim).to(torch.bfloat16).requires_grad_()
    nbytes, routing = saved_bytes(lambda: gate(x), gate)
    g = torch.randn_like(routing.logits)
    routing.logits.backward(g)
    x2, w2 = x.detach().requires_grad_(), gate.weight.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2.float(), w2.float()).backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(gate.weight.grad, w2.grad)
    assert x.numel() * 2 <= nbytes < x.numel() * 3  # x in bf16 plus the routing tensors (an fp32 copy: +4 B each)
