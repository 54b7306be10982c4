"""The one-process model compiles whole: ``torch.compile(fullgraph=True)`` (which raises on any graph break) of the
debug model's forward and loss (dense and MoE layers, MLA, MTP; and the V3.2 indexer config), then backward through
the compiled graph, gives eager's loss and parameter gradients, with 0 graph breaks in one graph.

Backend ``aot_eager``: dynamo's capture and AOTAutograd's joint trace (fake tensors, functionalisation, the
partitioned backward) without Inductor's code generation, so the forward runs the same aten ops as eager in the same
order and the loss is bit-equal. The backward is one graph where eager runs autograd node by node: gradients of a
tensor used twice (the embedding, shared with MTP) are summed in the graph instead of by AccumulateGrad, and the
V3.2 indexer's chunked KL loss enters in another order, so weight gradients are fp32 sums reordered. Each is a sum
over at most the batch's n = 40 tokens (and a few uses) of terms no larger than the gradient's own maximum, so a
reordering moves it by at most ~n ulp of that maximum: tolerance ``n * eps32 * max|g|`` per tensor (measured: at
most 18 eps, on the indexer's head weights). A weight that gets no gradient at all (a dropped backward op) fails
the key comparison.

The MoE's grouped layout has a data-dependent row count: dynamo captures it as an unbacked size
(``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``), bounded below by the assignments (``permute``'s
``torch._check``), so the model needs no host read that breaks the graph.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.layers import swiglu
from recipes.bench_compile import next_token_loss

_SMALL = dict(n_layers=3, n_dense_layers=1, n_mtp_layers=1, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def _loss_and_grads(model: Transformer, fn, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = fn(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["debug", "debug_dsa"])
def test_model_compiles_whole_and_matches_eager(preset):
    torch.manual_seed(0)
    model = Transformer(ModelArgs.preset(preset, **_SMALL)).train()
    assert any(b.ffn.__class__.__name__ == "MoE" for b in model.layers) and len(model.mtp) == 1
    tokens = torch.randint(0, model.args.vocab_size, (2, 21))
    want_loss, want = _loss_and_grads(model, next_token_loss(model), tokens)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(next_token_loss(model), fullgraph=True, backend="aot_eager")
        got_loss, got = _loss_and_grads(model, compiled, tokens)
        if preset == "debug":  # a second step reuses the graph: no Python counter in the forward forces a recompile
            _loss_and_grads(model, compiled, torch.randint(0, model.args.vocab_size, (2, 21)))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert torch.isfinite(want_loss) and torch.equal(got_loss, want_loss)
    assert sorted(got) == sorted(want), sorted(set(want) ^ set(got))
    tol = 40 * torch.finfo(torch.float32).eps
    for name, g in want.items():
        assert torch.isfinite(g).all() and g.abs().max() > 0, name
        assert (got[name] - g).abs().max() <= tol * g.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_compiles_to_eager_gradients(dtype):
    """The MoE's routing-weighted SwiGLU (``layers.swiglu`` with fp32 weights): the compiled backward gives eager's
    input and weight gradients. Its output was once a no-op ``.to`` of an intermediate in fp32, which torch 2.11's
    compiled backward turned into input gradients of 0 (every MoE gradient of the compiled model was then wrong).
    The backward is elementwise but for the weights' gradient, a sum over the row's 2 x 16 products: at most 32
    roundings of the dtype apart, relative to the gradient's largest element."""
    torch.manual_seed(0)
    gate_up, weights = torch.randn(24, 32, dtype=dtype), torch.rand(24)
    probe = torch.randn(24, 16, dtype=dtype)
    grads = []
    for fn in (swiglu, torch.compile(swiglu, fullgraph=True, backend="aot_eager")):
        x, w = gate_up.clone().requires_grad_(), weights.clone().requires_grad_()
        (fn(x, w) * probe).sum().backward()
        grads.append((x.grad, w.grad))
    for want, got in zip(*grads):
        assert torch.isfinite(want).all() and want.abs().max() > 0
        assert (got - want).abs().max() <= 32 * torch.finfo(want.dtype).eps * want.abs().max()
