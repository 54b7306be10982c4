"""flash_mla.reference_attention.blocked_attention (the CPU training path of mla_attention): forward and
backward against float64 softmax attention written out by hand, at block sizes that do and do not divide
the sequence, and the causal skipping checked by poisoning what a query block must never read."""

import math

import pytest
import torch

import flash_mla
from flash_mla.reference_attention import blocked_attention


def _float64_attention(q, k, v, causal, scale):
    """[b, s, h, d] float64 softmax(q k^T * scale) v with an explicit [s, s] mask; independent of the blocking."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)


def _out_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# (batch, seq, heads, dqk, dv, causal, block): blocks that divide seq, blocks that leave a short last block,
# one block longer than seq, block 1 (every row its own block), MLA's 48/32 debug dims, non-causal.
SHAPES = [
    (2, 21, 2, 48, 32, True, 8),
    (1, 64, 3, 40, 24, True, 16),
    (2, 9, 1, 16, 8, True, 4),
    (1, 13, 2, 16, 16, True, 1),
    (1, 7, 2, 24, 8, True, 64),
    (2, 19, 2, 48, 32, False, 4),
]


@pytest.mark.parametrize("b,s,h,dqk,dv,causal,block", SHAPES)
def test_forward_backward_match_float64(b, s, h, dqk, dv, causal, block):
    g = torch.Generator().manual_seed(s * 100 + block)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for d in (dqk, dqk, dv))
    dout = torch.randn(b, s, h, dv, generator=g)
    scale = dqk ** -0.5 * 1.3  # not the default, to catch a scale applied twice or not at all
    got = _out_and_grads(lambda *t: blocked_attention(*t, causal, scale, block=block), q, k, v, dout)
    want = _out_and_grads(lambda *t: _float64_attention(*t, causal, scale), q.double(), k.double(), v.double(),
                          dout.double())
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == w.shape, name
        # fp32 GEMMs and softmax against float64: summation rounding only (~1e-7 relative at these sizes);
        # 2e-6 leaves room for the longest rows, while a wrong mask or scale is off by > 1e-2
        assert _rel_err(a, w) < 2e-6, (name, _rel_err(a, w))


@pytest.mark.parametrize("block", [4, 5, 16])
def test_causal_skipped_blocks_are_never_read(block):
    """Queries < m give bit-identical outputs and dq when every key and value past the end of m's query block
    is NaN: a causal query block never reads the key blocks after its own (any read would spread the NaN).
    Within the diagonal block keys are read and masked (a NaN key there would still reach dq via 0 * NaN,
    as in any GEMM-based attention), so the poison starts at the block's end."""
    s, m = 23, 11  # m inside a block for every block size above
    end = -(-m // block) * block
    g = torch.Generator().manual_seed(block)
    q, k = torch.randn(1, s, 2, 12, generator=g), torch.randn(1, s, 2, 12, generator=g)
    v, dout = torch.randn(1, s, 2, 8, generator=g), torch.randn(1, s, 2, 8, generator=g)

    def run(k_in, v_in):
        return _out_and_grads(lambda *t: blocked_attention(*t, True, 0.25, block=block), q, k_in, v_in, dout)

    clean = run(k, v)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, end:] = float("nan")
    v_poisoned[:, end:] = float("nan")
    poisoned = run(k_poisoned, v_poisoned)
    for name, a, w in zip(("out", "dq"), poisoned, clean):
        assert torch.equal(a[:, :m], w[:, :m]), name  # same ops on the same numbers: bit-identical
    assert poisoned[0][:, end:].isnan().all()  # the poison did reach the later queries: the test can fail


def test_bf16_inputs_compute_in_fp32():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 10, 2, 16, generator=g).bfloat16() for _ in range(3))
    out = blocked_attention(q, k, v, True, 0.25, block=4)
    assert out.dtype == torch.float32
    # the bf16 inputs are exact in float64: fp32 rounding only
    assert _rel_err(out, _float64_attention(q, k, v, True, 0.25)) < 2e-6


def test_empty_sequence():
    q, k, v = torch.randn(2, 0, 2, 8, requires_grad=True), torch.randn(2, 0, 2, 8), torch.randn(2, 0, 2, 4)
    out = blocked_attention(q, k, v, True, 0.5)
    assert out.shape == (2, 0, 2, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_bad_block_size():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="block must be >= 1"):
        blocked_attention(q, q, q, True, 0.5, block=0)


def test_mla_attention_varlen_reference_with_several_blocks_per_sequence():
    """mla_attention's CPU path on a varlen batch whose sequences span several default-size (64-row) blocks,
    one of them not a multiple of 64, and an empty one: out and grads per sequence against float64."""
    lens = [70, 0, 130]
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(200, 2, d, generator=g) for d in (24, 24, 16, 16))
    got = _out_and_grads(lambda *t: flash_mla.mla_attention(*t, cu_seqlens=cu, max_seqlen=130), q, k, v, dout)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        want = _out_and_grads(lambda *t: _float64_attention(*t, True, 24 ** -0.5)[0],
                              *(t[None, sl].double() for t in (q, k, v)), dout[sl].double())
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            if n:  # same fp32-vs-float64 bound as above
                assert _rel_err(a[sl], w.reshape(a[sl].shape)) < 2e-6, (name, n)
        start += n
