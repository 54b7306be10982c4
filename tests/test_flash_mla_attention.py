"""flash_mla.mla_attention: Triton forward/backward (interpreter) against the fp32 reference, and the
reference against float64 softmax attention written out by hand."""

import pytest
import torch

import flash_mla
from accel import registry
from flash_mla.attention import mla_attention_reference
from flash_mla.kernels.attention import DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS
from verifier.verify import calc_diff


def _float64_attention(q, k, v, causal, scale):
    """[b, s, h, d] float64 softmax(q k^T * scale) v, row by row mask; independent of SDPA."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_float64(causal):
    q, k, v = torch.randn(2, 9, 3, 40), torch.randn(2, 9, 3, 40), torch.randn(2, 9, 3, 24)
    out = mla_attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    # fp32 SDPA vs float64: accumulation rounding only
    assert calc_diff(out.double(), _float64_attention(q, k, v, causal, 0.3)) < 1e-12


def test_reference_varlen_equals_per_sequence():
    lens = [5, 0, 12, 3]
    cu = torch.tensor([0, 5, 5, 17, 20], dtype=torch.int32)
    q, k, v = torch.randn(20, 2, 32), torch.randn(20, 2, 32), torch.randn(20, 2, 16)
    out = flash_mla.mla_attention(q, k, v, cu_seqlens=cu, max_seqlen=12)
    start = 0
    for n in lens:
        if n:
            sl = slice(start, start + n)
            want = _float64_attention(q[None, sl], k[None, sl], v[None, sl], True, 32 ** -0.5)[0]
            assert calc_diff(out[sl].double(), want) < 1e-12
        start += n


def _grads(fn, q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# (layout, shape or seqlens, heads, dqk, dv, causal, dtype): the debug model's non-power-of-two 48/32,
# DeepSeek-V3's 192/128, a head dim needing a padded second tile (80 = 64 + 16), varlen with an empty sequence,
# power-of-two head dims that need no second tile (64; debug_tiny's 16 with dv 8).
CASES = [
    ("dense", (2, 21), 2, 48, 32, True, torch.float32),
    ("dense", (1, 19), 2, 64, 64, True, torch.float32),
    ("dense", (2, 11), 1, 16, 8, True, torch.float32),
    ("dense", (1, 33), 2, 192, 128, False, torch.bfloat16),
    ("varlen", [9, 0, 30, 17], 2, 80, 64, True, torch.bfloat16),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,size,heads,dqk,dv,causal,dtype", CASES)
def test_triton_forward_backward_matches_reference(layout, size, heads, dqk, dv, causal, dtype):
    if layout == "dense":
        lead, kw = size, {}
    else:
        lead = (sum(size),)
        cu = torch.tensor([0] + size, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kw = {"cu_seqlens": cu, "max_seqlen": max(size)}
    q, k = torch.randn(*lead, heads, dqk, dtype=dtype), torch.randn(*lead, heads, dqk, dtype=dtype)
    v, dout = torch.randn(*lead, heads, dv, dtype=dtype), torch.randn(*lead, heads, dv, dtype=dtype)
    with registry.force("triton"), registry.poisoned_outputs():
        got = _grads(flash_mla.mla_attention, q, k, v, dout, causal=causal, **kw)
    assert registry.get("flash_mla.mla_attention").last_impl == "triton"
    want = _grads(mla_attention_reference, q, k, v, dout, causal=causal, **kw)
    # fp32: same math, other summation order -> 1e-10. bf16: outputs/grads rounded to bf16 (cos diff ~1e-6),
    # and the backward's delta = rowsum(dO * O) uses the bf16 O as every flash kernel does (short sequences:
    # up to ~1e-5 seen over seeds) -> 5e-5; masking or indexing bugs give > 1e-2.
    tol = 1e-10 if dtype == torch.float32 else 5e-5
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        assert calc_diff(g, w) < tol, f"{name}: {calc_diff(g, w)}"


@pytest.mark.parametrize("capability", [90, 100])
def test_every_gpu_tile_keeps_the_causal_diagonal_whole(capability):
    """The forward and dQ walk key blocks inside a query block (BLOCK_M % BLOCK_N == 0), dK/dV query blocks
    inside a key block (BLOCK_N % BLOCK_M == 0): a tile breaking this masks the diagonal wrongly, and the
    compile gates cannot see it (tiles as (BLOCK_M, BLOCK_N, warps, stages))."""
    for block_m, block_n, _, _ in FWD_CONFIGS[capability] + DQ_CONFIGS[capability]:
        assert block_m % block_n == 0, (capability, block_m, block_n)
    for block_m, block_n, _, _ in DKDV_CONFIGS[capability]:
        assert block_n % block_m == 0, (capability, block_m, block_n)
