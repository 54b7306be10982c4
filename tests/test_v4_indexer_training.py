"""V4's lightning indexer in training (issue 37 item 5): a CSA layer's forward in training mode ties its
indexer's KL loss to the attention output, V3.2's warm-up (``dsa_warmup``: attention over every visible entry,
KL over all of them) and sparse stage (KL over the indexer's top-k); the loss and the indexer's gradient equal a
float64 query-by-query evaluation, every other parameter's gradient is the LM loss's alone, and the metrics
stream gets the KL (and the warm-up's top-k recall). Pipeline runs through the CLI: ``test_v4_training_slow.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_v4 import ModelArgs
from tests.test_v4_hf_parity import CONFIGS, _model, _reference_indexer_loss, _rel
from training.loss import freeze_all_but_indexers


def _args(warmup: bool) -> ModelArgs:
    return ModelArgs(**CONFIGS["csa_hca_window"], hc_mult=4, max_seq_len=1024, original_seq_len=64, rope_factor=4.0,
                     n_mtp_layers=0, init_std=0.1, dsa_warmup=warmup)


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warmup", [True, False], ids=["warmup", "sparse"])
def test_training_attaches_the_indexer_loss_equal_to_float64(warmup):
    args = _args(warmup)
    model = _model(args, seed=3 + warmup)
    s = 97 + 8 * (not warmup)  # 24-26 entries per CSA layer, top-3 of them in the sparse stage
    tokens = torch.randint(0, args.vocab_size, (1, s), generator=torch.Generator().manual_seed(5))
    csa = [layer.attn for layer in model.layers if layer.attn.indexer is not None]
    assert len(csa) == 2
    inputs = {}
    hooks = [a.register_forward_hook(lambda m, inp, out: inputs.__setitem__(m, inp[0].detach())) for a in csa]
    evaluated = copy.deepcopy(model).eval()  # the same model without the indexer's loss: the LM loss alone
    model.train()
    loss = _lm_loss(model, tokens)
    for h in hooks:
        h.remove()
    loss.backward()
    _lm_loss(evaluated, tokens).backward()
    # the LM loss is the same; every parameter outside the indexers gets the LM loss's gradient only (the
    # indexer's inputs are detached, so the two runs are the same operations on the same values)
    assert loss.item() == _lm_loss(evaluated, tokens).item()
    theirs = dict(evaluated.named_parameters())
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert theirs[name].grad is None, name
        elif theirs[name].grad is None:  # HCA's compressor: no window closes within the sequence
            assert p.grad is None, name
        else:
            assert p.grad is not None and _rel(p.grad, theirs[name].grad) < 1e-6, name
    # the indexers' gradients are their KL losses' (one per CSA layer, each a mean over its queries), in float64;
    # fp32 against float64: short reductions (<= 128 terms) of O(1) values, ~1e-6 relative, 1e-4 with margin
    for attn in csa:
        ref_attn = copy.deepcopy(attn).double()
        for p in ref_attn.parameters():
            p.grad = None
        ref = _reference_indexer_loss(ref_attn, inputs[attn][0].double(), args, sparse=not warmup)
        ref.backward()
        ours = dict(attn.named_parameters())
        for n, p in ref_attn.named_parameters():
            if n.startswith("indexer."):
                assert _rel(ours[n].grad, p.grad) < 1e-4, (n, _rel(ours[n].grad, p.grad))
        stats = attn.indexer.stats.metrics(reset=True)
        assert stats["kl"] == pytest.approx(ref.item(), rel=1e-4) and ref.item() > 0
        if warmup:  # the last chunk's queries see up to 24 entries, more than the top-3: recall is measured
            assert 0.0 <= stats["recall"] <= 1.0
        else:  # the candidates are the top-k itself: nothing to recall
            assert "recall" not in stats


def test_warmup_freezes_all_but_the_indexers():
    model = _model(_args(True), seed=9)
    assert freeze_all_but_indexers([model]) == sum(1 for n, _ in model.named_parameters() if ".indexer." in n)
    assert all(p.requires_grad == (".indexer." in n) for n, p in model.named_parameters())


@pytest.mark.parametrize("sparse", [False, True], ids=["warmup", "sparse"])
def test_target_made_in_chunks_equals_it_made_at_once(sparse):
    """Chunks of 7 queries (crossing window and entry boundaries; the last one short) against one chunk."""
    args = _args(not sparse)
    model = _model(args, seed=12)
    attn = model.layers[1].attn
    x = torch.randn(2, 80, args.dim, generator=torch.Generator().manual_seed(2))
    angles = model.angles(80, "cpu")[True]
    results = []
    for chunk in (None, 7):
        attn.zero_grad()
        loss = attn.indexer_loss(x, angles, sparse, chunk=chunk)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in attn.indexer.parameters()]))
    # the same sums split differently: fp32 rounding of <= 80-term reductions, well under 1e-5 relative
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert _rel(a, b) < 1e-5
