"""The lightning indexer's FP4 + Hadamard QK option (``indexer_qk_format = "mxfp4_hadamard"``, DeepSeek-V4's QAT of
the indexer): the rotation, the cast, the scores, the straight-through gradient, both models and the CLI.

References: Sylvester's closed form of the Hadamard matrix (entry (i, j) = (-1)^popcount(i & j)) in exact float64
integers; a float64 re-implementation of V4's released activation cast (``fp4_act_quant``: amax floored at
6 x 2^-126, scale 2^ceil(log2(amax / 6)), values clamped to +-6 and rounded to the nearest E2M1 value, ties to the
even code), written from that rule with ``math.log2`` / ``math.ceil`` and an explicit nearest-grid search; float64
products of the unquantised q and k.

Score bound. With q' = qH, k' = kH (exact, float64) the rotation leaves q' . k' = q . k, and for the cast values
q^, k^: |q^ . k^ - q . k| <= sum_i |q^_i - q'_i| |k^_i| + |q'_i| |k^_i - k'_i|. Each |x^_i - x'_i| is at most the
cast's rounding, half the E2M1 spacing at |x_i| / s times the block scale s (s/4 below 2s, s/2 below 4s, s above),
plus the fp32 rotation's own rounding, <= (D + 1) u (|x| |H|)_i (Higham's gamma_D, u = 2^-24, and the fp32
rounding of the scale D^-0.5), plus float64 slack (1e-12 of sum |q| |k|). The bound is elementwise and holds for
any input; the test also checks that FP4 is visible (the scores move) so the comparison can fail.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deep_gemm.health import Fp8Health
from deep_gemm.mxfp4 import fp4_act_cast_counts, fp4_act_fake_quant
from models.deepseek_v3 import Transformer
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.indexer import Indexer, hadamard, hadamard_fp4
from models.deepseek_v4.args import ModelArgs as V4Args
from models.deepseek_v4.model import Indexer as V4Indexer
from models.deepseek_v4.model import Transformer as V4Transformer
from recipes.train import main as train_main
from training.config import load_config
from training.metrics import fp8_health_metrics

ROOT = Path(__file__).resolve().parent.parent
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes, code index 0..7 (odd index = mantissa bit 1)


def _sylvester(d: int) -> torch.Tensor:
    i = torch.arange(d)
    bits = (i[:, None] & i[None, :]).tolist()
    return torch.tensor([[(-1.0) ** bin(v).count("1") for v in row] for row in bits], dtype=torch.float64)


def _cast64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's FP4 activation cast in float64 from its rule, and each element's scale: (values, scales), both [..., K]."""
    blocks = x.double().reshape(-1, 32)
    out, scales = torch.empty_like(blocks), torch.empty_like(blocks)
    grid = torch.tensor(GRID, dtype=torch.float64)
    for r in range(blocks.shape[0]):
        amax = max(float(blocks[r].abs().max()), 6.0 * 2.0**-126)
        s = 2.0 ** math.ceil(math.log2(amax / 6.0))
        y = (blocks[r] / s).clamp(-6.0, 6.0)
        dist = (y.abs()[:, None] - grid[None, :]).abs()
        best = dist.min(dim=1, keepdim=True).values
        tied = dist == best  # one or two nearest grid values; a tie goes to the even code
        index = torch.where(tied.sum(1) > 1, (tied & (torch.arange(8) % 2 == 0)).float().argmax(1),
                            tied.float().argmax(1))
        out[r] = torch.copysign(grid[index], y) * s
        scales[r] = s
    return out.reshape(x.shape), scales.reshape(x.shape)


def _half_spacing(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    a = x.double().abs() / s
    return s * torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def _inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values at block scales from 2^-30 to 2^30, with the rule's edge cases planted: an amax of exactly 6
    x 2^k and one just above, ties between grid values, an all-zero block and one below the scale floor."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-30, 30, (*shape[:-1], shape[-1] // 32), generator=g).repeat_interleave(32, dim=-1)
    x = torch.randn(shape, generator=g) * 2.0**exponents
    flat = x.view(-1, 32)
    flat[0] = torch.tensor([6.0, 2.5, 5.0, 0.25, 1.75, 3.5, -2.5, -0.75] * 4)  # amax 6: scale 1, every tie planted
    flat[1] = torch.tensor([6.0 * (1 + 2.0**-23), 2.5, 5.0, 0.25] * 8)  # amax just above 6: scale 2
    flat[2] = 0.0
    flat[3] = torch.full((32,), 1e-39) * torch.randn(32, generator=g)  # below the floor: every value flushes to 0
    return x.to(dtype)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_hadamard_is_orthonormal_sylvester(d):
    """``hadamard(d)`` is Sylvester's matrix times d^-0.5: symmetric, and H H^T = I to float64 rounding of the fp32
    scale (<= d x 2^-24 relative, its one rounding squared and summed)."""
    h = hadamard(d).double()
    scale = float(h[0, 0])
    assert scale == pytest.approx(d**-0.5, rel=2.0**-24)
    assert torch.equal(h / scale, _sylvester(d))
    assert torch.equal(h, h.T)
    assert (h @ h.T - torch.eye(d, dtype=torch.float64)).abs().max() <= d * 2.0**-23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 64), (3, 5, 128)])
def test_fp4_act_cast_bit_equal_to_float64_rule(shape, dtype):
    x = _inputs(shape, seed=shape[-1] + len(shape), dtype=dtype)
    got = fp4_act_fake_quant(x)
    want, _ = _cast64(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.double(), want)
    flat = got.view(-1, 32).float()
    assert flat[0].tolist() == [6.0, 2.0, 4.0, 0.0, 2.0, 4.0, -2.0, -1.0] * 4  # ties to even codes
    assert flat[1, 0] == 6.0 and (flat[1, 1:4] == torch.tensor([2.0, 4.0, 0.0])).all()  # scale 2: 2.5 -> 2 (1.25)
    assert (flat[2:4] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_act_cast_poisons_a_non_finite_block_only(dtype):
    """A NaN or an infinity makes its 32-block NaN (an infinity must not clamp to a finite 6 x 2^e, nor a NaN
    block's other values take a meaningless scale); every other block is the finite tensor's cast, bit for bit.
    Through ``hadamard_fp4`` an infinity in q reaches every block of its head, so the scores see NaN. The health
    counts leave those blocks out."""
    x = _inputs((3, 128), seed=5, dtype=dtype)
    bad = x.clone()
    bad[1, 40], bad[2, 100], bad[2, 101] = float("nan"), float("inf"), -float("inf")
    out = fp4_act_fake_quant(bad)
    nan = torch.isnan(out)
    assert nan[1, 32:64].all() and nan[2, 96:128].all() and int(nan.sum()) == 64
    assert torch.equal(out[~nan], fp4_act_fake_quant(x)[~nan])
    q = torch.randn(2, 64, dtype=dtype)
    q[0, 5] = float("inf")
    rotated = hadamard_fp4(q)
    assert torch.isnan(rotated[0]).all() and torch.isfinite(rotated[1]).all()
    clean = x.clone()
    clean[1, 32:64], clean[2, 96:128] = 0.0, 0.0  # the poisoned blocks, gone
    assert fp4_act_cast_counts(bad).tolist()[:6] == _counts64(clean)[:6]


def test_fp4_act_cast_straight_through_and_errors():
    x = torch.randn(4, 64, requires_grad=True)
    g = torch.randn(4, 64)
    fp4_act_fake_quant(x).backward(g)
    assert torch.equal(x.grad, g)
    torch.library.opcheck(torch.ops.dsv3.fp4_act_fake_quant.default, (torch.randn(3, 96, requires_grad=True),))
    with pytest.raises(ValueError, match="blocks of 32 along the last dim, got a last dim of 48") as err:
        fp4_act_fake_quant(torch.randn(2, 48))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="MXFP4 takes a float16/bfloat16/float32/float64 tensor"):
        fp4_act_fake_quant(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.parametrize("seed,d", [(0, 128), (1, 64)])
def test_rotated_fp4_scores_within_the_derived_bound(seed, d):
    """``hadamard_fp4(q) . hadamard_fp4(k)`` against the float64 ``q . k`` (module docstring's bound), with an
    outlier dim in q and k; the cast equals the float64 rule on the fp32 rotation's output bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(40, 4, d, generator=g), torch.randn(50, d, generator=g)
    q[..., 3] *= 30.0
    k[..., 3] *= 30.0
    h = hadamard(d)
    q_hat, k_hat = hadamard_fp4(q), hadamard_fp4(k)
    (q_ref, q_s), (k_ref, k_s) = _cast64(q @ h), _cast64(k @ h)
    assert torch.equal(q_hat.double(), q_ref) and torch.equal(k_hat.double(), k_ref)
    h64 = _sylvester(d) / math.sqrt(d)  # the exact rotation (float64); the model's has its scale rounded to fp32
    rot = (d + 1) * 2.0**-24  # gamma_d of the fp32 product, plus the fp32 scale's one rounding
    err_q = _half_spacing(q @ h, q_s) + rot * (q.double().abs() @ h64.abs())
    err_k = _half_spacing(k @ h, k_s) + rot * (k.double().abs() @ h64.abs())
    scores = torch.einsum("thd,nd->thn", q_hat.double(), k_hat.double())
    ref = torch.einsum("thd,nd->thn", q.double(), k.double())
    bound = (torch.einsum("thd,nd->thn", err_q, k_hat.double().abs())
             + torch.einsum("thd,nd->thn", (q.double() @ h64).abs(), err_k)
             + 1e-12 * torch.einsum("thd,nd->thn", q.double().abs(), k.double().abs()))
    assert ((scores - ref).abs() <= bound).all()
    assert float((scores - ref).abs().max()) > 1e-3 * float(ref.abs().max())  # FP4 is visible: this can fail
    # the rotation's purpose: with the outlier dim, the unrotated cast loses far more of the scores
    plain = torch.einsum("thd,nd->thn", fp4_act_fake_quant(q).double(), fp4_act_fake_quant(k).double())
    assert float((scores - ref).norm()) < 0.5 * float((plain - ref).norm())


def test_hadamard_fp4_gradient_is_straight_through_the_cast():
    """d(hadamard_fp4(x))/dx = H^T (= H): the cast passes the gradient, the rotation transposes it."""
    x = torch.randn(5, 3, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, 64, dtype=torch.float64)
    (grad,) = torch.autograd.grad(hadamard_fp4(x), x, g)
    assert torch.allclose(grad, g @ hadamard(64).double().T, rtol=0, atol=1e-12)


def _v32(fmt: str) -> ModelArgs:
    return ModelArgs.preset("debug_dsa", index_head_dim=32, indexer_qk_format=fmt)


def test_v32_and_v4_indexers_score_the_rotated_fp4_values():
    """V3.2's ``Indexer.queries`` / ``keys`` and V4's ``Indexer.parts`` with the option give ``hadamard_fp4`` of the
    bf16-format indexer's values (same weights); the loss's gradient reaches the indexer's weights."""
    torch.manual_seed(0)
    fp4, plain = Indexer(_v32("mxfp4_hadamard")), Indexer(_v32("bf16"))
    plain.load_state_dict(fp4.state_dict())
    args = _v32("bf16")
    q_resid, x = torch.randn(2, 9, args.q_lora_rank), torch.randn(2, 9, args.dim)
    cos, sin = torch.randn(9, args.qk_rope_head_dim // 2), torch.randn(9, args.qk_rope_head_dim // 2)
    q, k = fp4.queries(q_resid, cos, sin), fp4.keys(x, cos, sin)
    assert torch.equal(q, hadamard_fp4(plain.queries(q_resid, cos, sin)))
    assert torch.equal(k, hadamard_fp4(plain.keys(x, cos, sin)))
    torch.einsum("bshd,bnd->bshn", q, k).relu().sum().backward()
    assert fp4.wq_b.weight.grad is not None and fp4.wk.weight.grad.abs().sum() > 0

    v4 = V4Args.preset("debug_v4", index_head_dim=32)
    fp4_4, plain_4 = V4Indexer(v4.replace(indexer_qk_format="mxfp4_hadamard")), V4Indexer(v4)
    plain_4.load_state_dict(fp4_4.state_dict())
    x, qr = torch.randn(2, 16, v4.dim), torch.randn(2, 16, v4.q_lora_rank)
    angles = torch.randn(16, v4.rope_head_dim // 2)
    (q4, k4, w4), (pq, pk, pw) = fp4_4.parts(x, qr, angles), plain_4.parts(x, qr, angles)
    assert torch.equal(q4, hadamard_fp4(pq)) and torch.equal(k4, hadamard_fp4(pk)) and torch.equal(w4, pw)
    assert not torch.equal(fp4_4.scores(q4, k4, w4), plain_4.scores(pq, pk, pw))


def test_bad_indexer_qk_formats_are_one_line_errors():
    cases = [
        (lambda: ModelArgs.preset("debug_dsa", indexer_qk_format="fp4"), "indexer_qk_format must be one of auto"),
        (lambda: ModelArgs.preset("debug_dsa", indexer_qk_format="mxfp4_hadamard"),
         "casts q and k to FP4 in blocks of 32: index_head_dim must be a multiple of 32, got 16"),
        (lambda: ModelArgs.preset("debug_dsa", index_head_dim=96, indexer_qk_format="mxfp4_hadamard"),
         "index_head_dim must be a power of two, got 96"),
        (lambda: ModelArgs.preset("debug", indexer_qk_format="mxfp4_hadamard"), "needs a model with a lightning"),
        (lambda: ModelArgs.preset("debug_dsa", index_head_dim=256, indexer_qk_format="fp8"), "must be <= 128"),
        (lambda: V4Args.preset("debug_v4", indexer_qk_format="fp8"), "bf16, mxfp4_hadamard for V4"),
        (lambda: V4Args.preset("debug_v4", index_head_dim=32, compress_ratios=(0, 128, 0, 128, 0),
                               indexer_qk_format="mxfp4_hadamard"), "needs a model with a lightning"),
        (lambda: load_config(None, ['model.indexer_qk_format="nvfp4"']), "model.indexer_qk_format must be one of"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            make()
        assert "\n" not in str(err.value)
    assert ModelArgs.preset("debug_dsa", fp8=True).indexer_qk == "fp8"  # auto follows the GEMMs, as before
    assert ModelArgs.preset("debug_dsa").indexer_qk == "bf16"


FLOOR = 6.0 * 2.0**-126  # V4's amax floor: a block below it takes the scale 2^-126, not its own


def _counts64(x: torch.Tensor) -> list[float]:
    """The FP8 health fields of V4's FP4 cast of ``x``, counted in float64 from ``_cast64`` (the rule's values and
    scales): nonzero values, those cast to 0, those cast to E2M1's subnormal (0.5 x scale), blocks holding a nonzero
    value, those whose amax is below the floor, the zeros in those, and sum / min / max of the blocks' log2 amax
    (``math.log2``)."""
    cast, scale = _cast64(x)
    xb, cb, sb = x.double().reshape(-1, 32), cast.reshape(-1, 32), scale.reshape(-1, 32)
    nonzero = xb != 0
    flushed = nonzero & (cb == 0)
    amax = xb.abs().amax(1)
    live = amax > 0
    floored = live & (amax < FLOOR)
    logs = [math.log2(a) for a in amax[live].tolist()]
    return [float(nonzero.sum()), float(flushed.sum()), float((nonzero & (cb.abs() == 0.5 * sb)).sum()),
            float(live.sum()), float(floored.sum()), float((flushed.sum(1) * floored).sum()), math.fsum(logs),
            min(logs, default=math.inf), max(logs, default=-math.inf)]


def _assert_counts(got: list[float], want: list[float]) -> None:
    """Counts exactly; the log2 fields to 1e-12 relative (torch's and math's log2 may differ by an ulp, and the sums
    run in different orders over at most a few thousand terms of |log2| <= 150: far below 1e-12 of the sum)."""
    assert got[:6] == want[:6]
    assert got[6:] == pytest.approx(want[6:], rel=1e-12, abs=1e-12)


def _planted(tokens: int, seed: int) -> torch.Tensor:
    """Rotated q values ``[tokens, 4 heads, 64]`` (float64) with known FP4 health counts in heads 0-2 (per token:
    64 + 64 nonzero values, 23 cast to 0, 45 to the subnormal, 4 live blocks, 2 at the scale floor hiding 8 zeros):

    * head 0: all zero, two blocks without a nonzero value;
    * head 1: block [6, 15 x 0.125, 16 x 1] (scale 1: the 0.125s round to 0) and [4, 31 x 0.5] (scale 1: the 0.5s
      land on the subnormal);
    * head 2: k x 2^-130 for k = 1..32 and its negation: amax 2^-125 < 6 x 2^-126, so the scale is the floor's
      2^-126 and each value is k / 16 of it: k <= 4 round to 0 (k = 4 is the tie 0.25, to the even 0), k = 5..11
      to 0.5 (k = 12 is the tie 0.75, to 1);
    * head 3: random multiples of 1/64 in [-4, 4).
    Every value has few significant bits, so x = R H and x H (H's entries +-1/8 at D = 64) are exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    r = torch.zeros(tokens, 4, 64, dtype=torch.float64)
    r[:, 1, :32] = torch.tensor([6.0] + [0.125] * 15 + [1.0] * 16, dtype=torch.float64)
    r[:, 1, 32:] = torch.tensor([4.0] + [0.5] * 31, dtype=torch.float64)
    k = torch.arange(1, 33, dtype=torch.float64) * 2.0**-130
    r[:, 2] = torch.cat([k, -k])
    r[:, 3] = torch.randint(-256, 256, (tokens, 64), generator=g).double() / 64
    return r


PLANTED = [128.0, 23.0, 45.0, 4.0, 2.0, 8.0]  # heads 0-2 of one token of _planted: the first six fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 64), (3, 5, 128), (4, 32)])
def test_fp4_cast_counts_equal_a_float64_count(shape, dtype):
    """``fp4_act_cast_counts`` (what the FP8 health report records for the indexer's q and k) against the float64
    count of the rule's own cast, on inputs with every edge case planted (all-zero block, a block below the floor
    whose values all flush, ties, amax at 6 x 2^k); and against hand counts of a constructed tensor."""
    x = _inputs(shape, seed=len(shape) + shape[-1], dtype=dtype)
    want = _counts64(x)
    _assert_counts(fp4_act_cast_counts(x).tolist(), want)
    assert want[1] > 0 and want[4] >= 1 and want[5] > 0  # underflow, a floored block and its zeros: planted
    hand = torch.zeros(2, 64, dtype=torch.float64)
    hand[0, :32] = torch.tensor([6.0] + [0.2] * 15 + [0.5] * 8 + [1.0] * 8)  # scale 1: 15 flush, 8 subnormal
    hand[1, :32] = torch.tensor([2.0**-125] + [2.0**-129] * 10 + [2.0**-127] * 5 + [2.0**-126] * 16)  # floored
    hand[1, 32:] = torch.tensor([3 * 2.0**-125] + [2.0**-126] * 31)  # amax exactly 6 x 2^-126: not floored
    hand = hand.to(dtype)  # every value is exact in bfloat16 and float32
    got = fp4_act_cast_counts(hand).tolist()
    assert got[:6] == [96.0, 25.0, 13.0, 3.0, 1.0, 10.0]
    _assert_counts(got, _counts64(hand))


def test_fp4_cast_counts_refuse_a_ragged_block():
    with pytest.raises(ValueError, match="x: the FP4 activation cast takes blocks of 32") as err:
        fp4_act_cast_counts(torch.ones(2, 48))
    assert "\n" not in str(err.value)


def _rows(health: Fp8Health) -> dict[tuple[str, str, str], list[float]]:
    return {tuple(k.split("|")): v for k, v in health.counts().items()}


def test_fp8_health_counts_the_v32_indexer_fp4_casts():
    """A V3.2 model with ``mxfp4_hadamard``: ``Fp8Health.attach`` reaches every indexer, and while active each
    indexer reports its first q and k cast (``fwd.q``, ``fwd.k`` of ``layers.N.attn.indexer``) with counts equal to
    the float64 count of the rotated tensor it casts (planted q: known fractions; k: the bias of a zeroed
    LayerNorm, i.e. planted too). Not active: nothing; without the option: no indexer entries at all."""
    torch.manual_seed(0)
    args = ModelArgs.preset("debug_dsa", index_head_dim=64, q_lora_rank=256, n_layers=2, n_mtp_layers=0,
                            indexer_qk_format="mxfp4_hadamard")
    model = Transformer(args)
    health = Fp8Health()
    assert health.attach([model]) == 2  # the two layers' indexers (no FP8 GEMM, no FP4 expert)
    ind = model.layers[0].attn.indexer
    assert ind.health is health
    h = hadamard(64).double()
    r_q, r_k = _planted(3, 1), _planted(1, 2)[0, 3]
    with torch.no_grad():
        ind.wq_b.weight.copy_(torch.eye(256))
        ind.k_norm.weight.zero_()
        ind.k_norm.bias.copy_((r_k @ h).float())  # every token's k (before the rotation)
    cos, sin = torch.ones(3, args.qk_rope_head_dim // 2), torch.zeros(3, args.qk_rope_head_dim // 2)
    q_resid = (r_q @ h).float().reshape(1, 3, 256)
    ind.queries(q_resid, cos, sin)  # inactive: not counted
    assert health.counts() == {}
    health.active = True
    q = ind.queries(q_resid, cos, sin)
    ind.keys(torch.randn(1, 3, args.dim), cos, sin)
    ind.queries(q_resid * 0, cos, sin)  # a second cast in the same report: the first is the sample
    assert torch.equal((q_resid.reshape(1, 3, 4, 64) @ hadamard(64)).double(), r_q.reshape(1, 3, 4, 64))  # exact
    assert torch.equal(q, hadamard_fp4(q_resid.reshape(1, 3, 4, 64)))
    got = _rows(health)
    assert set(got) == {("layers.0.attn.indexer", "fwd", "q"), ("layers.0.attn.indexer", "fwd", "k")}
    _assert_counts(got[("layers.0.attn.indexer", "fwd", "q")], _counts64(r_q))
    _assert_counts(got[("layers.0.attn.indexer", "fwd", "k")], _counts64(r_k.expand(3, 64)))
    assert _counts64(r_q[0, :3])[:6] == PLANTED  # the planted heads' known fractions
    # the trainer's path: a forward, the counts, the metrics record; both layers' q and k, nothing else
    health.active = True
    model(torch.randint(0, 256, (2, 40)))
    metrics, _ = fp8_health_metrics(health.counts(), 1, 0.5, {})
    assert set(metrics["fp8_health"]) == {"layers.0.attn.indexer", "layers.1.attn.indexer"}
    assert all(set(v) == {"fwd.q", "fwd.k"} for v in metrics["fp8_health"].values())
    assert 0 < metrics["fp8_fwd_underflow_max"] < 1  # FP4 flushes values under a 24th of the block's amax
    plain = Fp8Health()
    assert plain.attach([Transformer(args.replace(indexer_qk_format="bf16"))]) == 0


def test_fp8_health_counts_the_v4_indexer_fp4_casts():
    """V4's CSA indexers with ``mxfp4_hadamard``: the same report from ``Indexer.parts`` (planted q through an
    identity ``wq_b`` at angle 0; k from the compressor, checked against the float64 count of the bf16-format
    twin's k rotated), and from a training forward of the whole model."""
    torch.manual_seed(0)
    args = V4Args.preset("debug_v4", index_n_heads=4, index_head_dim=64, q_lora_rank=256,
                         indexer_qk_format="mxfp4_hadamard")
    model = V4Transformer(args)
    health = Fp8Health()
    assert health.attach([model]) == 2  # layers 1 and 3 are CSA (compress ratio 4)
    ind = model.layers[1].attn.indexer
    plain = V4Indexer(args.replace(indexer_qk_format="bf16"))
    with torch.no_grad():
        ind.wq_b.weight.copy_(torch.eye(256))
    plain.load_state_dict(ind.state_dict())
    r_q = _planted(16, 3)
    qr, x = (r_q @ hadamard(64).double()).float().reshape(1, 16, 256), torch.randn(1, 16, args.dim)
    angles = torch.zeros(16, args.rope_head_dim // 2)
    health.active = True
    ind.parts(x, qr, angles)
    got = _rows(health)
    _assert_counts(got[("layers.1.attn.indexer", "fwd", "q")], _counts64(r_q))
    with torch.no_grad():
        _, k, _ = plain.parts(x, qr, angles)
        rotated = k @ hadamard(64).to(k.dtype)
    _assert_counts(got[("layers.1.attn.indexer", "fwd", "k")], _counts64(rotated))
    assert _counts64(rotated)[0] > 0
    health.active = True
    model.train()
    model(torch.randint(0, 512, (2, 64)))
    metrics, _ = fp8_health_metrics(health.counts(), 1, 0.5, {})
    assert set(metrics["fp8_health"]) == {"layers.1.attn.indexer", "layers.3.attn.indexer"}
    assert all(set(v) == {"fwd.q", "fwd.k"} for v in metrics["fp8_health"].values())
    assert Fp8Health().attach([V4Transformer(args.replace(indexer_qk_format="bf16"))]) == 0


def _train(run_dir: Path, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recipes.train", "--config", "recipes/configs/dsa_sparse_cpu.toml", "--run-dir",
           str(run_dir)]
    for o in ["run.steps=2", "data.seq_len=32", "data.global_batch=4", "data.micro_batch=2", "logging.eval_batches=0",
              "logging.progress=false", "run.threads=1", "run.sample_tokens=0", "checkpoint.final=false",
              "model.overrides.index_topk=8", "model.overrides.n_layers=2", "model.overrides.n_mtp_layers=0",
              *extra]:
        cmd += ["--set", o]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)


@pytest.mark.slow
@pytest.mark.timeout(900)  # three short CLI runs: ~30-70 s here, far longer on a loaded 2-core machine
def test_cli_trains_a_dsa_model_with_the_fp4_indexer(tmp_path):
    """``recipes.train`` on the sparse DSA config at V4's precision (Muon, MXFP4 QAT experts) with
    ``model.indexer_qk_format="mxfp4_hadamard"``: it trains (the indexer KL logged and finite) and differs from the
    bf16 indexer's run from the same seed, where the FP4 scores feed the KL; metrics.jsonl carries the FP8 health
    report of the indexers' FP4 casts beside the experts' (the bf16 indexer's run: the experts' only); a head dim FP4
    cannot take is refused in one line, exit 2, before any run folder exists."""
    head = ["model.overrides.index_head_dim=32", "logging.fp8_health_every=1", 'optim.name="muon"',
            'model.expert_weight_format="mxfp4_qat"']
    runs = {}
    for fmt in ("mxfp4_hadamard", "bf16"):
        proc = _train(tmp_path / fmt, head + [f'model.indexer_qk_format="{fmt}"'])
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        rows = [json.loads(line) for line in (tmp_path / fmt / "metrics.jsonl").read_text().splitlines()]
        runs[fmt] = [r for r in rows if "indexer_kl" in r]
    assert len(runs["mxfp4_hadamard"]) == 2 and all(math.isfinite(r["indexer_kl"]) for r in runs["mxfp4_hadamard"])
    assert runs["mxfp4_hadamard"][0]["indexer_kl"] != runs["bf16"][0]["indexer_kl"]
    # the FP8 health report (every step here) covers the indexers' FP4 q and k casts; without the option: none
    experts = {"layers.1.ffn.experts.w13", "layers.1.ffn.experts.w2"}  # layer 0 is dense
    for r in runs["mxfp4_hadamard"]:
        assert set(r["fp8_health"]) == {"layers.0.attn.indexer", "layers.1.attn.indexer"} | experts, r["fp8_health"]
        for layer, casts in r["fp8_health"].items():
            assert set(casts) == ({"fwd.w"} if layer in experts else {"fwd.q", "fwd.k"})
            assert all(0 < c["underflow"] < 1 for c in casts.values())
    assert all(set(r["fp8_health"]) == experts for r in runs["bf16"])
    bad = _train(tmp_path / "bad", ['model.indexer_qk_format="mxfp4_hadamard"'])  # the preset's head dim 16
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and lines[-1].startswith("error: ") and "multiple of 32, got 16" in lines[-1]
    assert not (tmp_path / "bad").exists()


def test_v4_dry_run_plans_the_fp4_indexer(capsys, monkeypatch):
    """``--dry-run`` of the V4 demo with ``mxfp4_hadamard`` plans its memory: the planner measures each layer kind
    with the indexer's format only where the kind has an indexer (a window-only or HCA kind has none, and the
    format alone there is refused), and prints the plan, exit 0."""
    monkeypatch.setattr("recipes.train.relaunch", lambda *a, **k: pytest.fail("a process started"))
    argv = ["--config", "recipes/configs/v4_tiny_cpu.toml", "--dry-run", "--set", "model.overrides.index_head_dim=32",
            "--set", 'model.indexer_qk_format="mxfp4_hadamard"']
    assert train_main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "CSA layer" in out and "HCA layer" in out and "window layer" in out
