"""MXFP4 (``deep_gemm.mxfp4``): the cast against a float64 reference of the OCP MX v1.0 rules, the released V4 packing
against transformers' loader, quantisation-aware training of the routed experts (``model.expert_weight_format =
"mxfp4_qat"``) against the same model given the FP4 weights.

The reference is written from the spec, not from the implementation: the shared exponent from ``math.frexp`` of
each block's amax (exact), the elements by nearest-value search over the eight E2M1 magnitudes in float64 with ties
to the even code (mantissa bit 0), saturating at 6. Every MXFP4 value is a float32 (and bfloat16) number, so the
comparison is bit-exact: any tolerance would hide a rounding-mode error."""

from __future__ import annotations

import math

import pytest
import torch

from deep_gemm import per_token_cast_to_fp8
from deep_gemm.health import Fp8Health, rows
from deep_gemm.linear import grouped_linear
from deep_gemm.mxfp4 import (
    E2M1_VALUES,
    NAN_EXPONENT,
    dequantize_mxfp4,
    mxfp4_fake_quant,
    mxfp4_health,
    pack_mxfp4,
    quantize_mxfp4,
    unpack_mxfp4,
)
from deep_gemm.reference import dequantize
from models.deepseek_v3 import ModelArgs, Transformer
from tests.test_muon_dist import DUALPIPEV, LOSS_ATOL, ONE, _close, _train
from training.config import load_config


def _reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, exponents, values in float64) of ``w`` by the OCP MX rules, block by block in float64."""
    x = w.double().reshape(-1, w.shape[-1])
    k = x.shape[1]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    even = torch.arange(8) % 2 == 0
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    values = torch.zeros(x.shape, dtype=torch.float64)
    exps = torch.zeros(x.shape[0], -(-k // 32), dtype=torch.int16)
    for r in range(x.shape[0]):
        for b in range(exps.shape[1]):
            block = x[r, 32 * b:32 * b + 32]
            amax = float(block.abs().max())
            if not math.isfinite(amax):
                exps[r, b] = NAN_EXPONENT
                values[r, 32 * b:32 * b + 32] = float("nan")
                continue
            e = -127 if amax == 0 else min(127, max(-127, math.frexp(amax)[1] - 1 - 2))
            exps[r, b] = e
            y = block / 2.0**e
            d = (y.abs().unsqueeze(1) - table).abs()
            cand = d == d.min(dim=1, keepdim=True).values
            pick = torch.where((cand & even).any(1), (cand & even).int().argmax(1), cand.int().argmax(1))
            sign = (block < 0) & (pick > 0)
            codes[r, 32 * b:32 * b + 32] = (pick | sign.long() << 3).to(torch.uint8)
            values[r, 32 * b:32 * b + 32] = torch.where(sign, -table[pick], table[pick]) * 2.0**e
    return codes.reshape(w.shape), exps.reshape(*w.shape[:-1], -1), values.reshape(w.shape)


def _inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of every magnitude (1e-42 .. 1e37, per row), exact ties of the E2M1 grid, zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    rows = x.reshape(-1, shape[-1])
    scale = 10.0 ** torch.empty(rows.shape[0], 1, dtype=torch.float64).uniform_(-42, 37, generator=g)
    rows.mul_(scale)
    if rows.shape[0] > 2:
        rows[1] = torch.randint(-24, 25, (shape[-1],), generator=g).double() * 0.25 * 2.0**-3  # ties: k/4 x 2^e
        rows[2] = 0.0
    return rows.reshape(shape).to(dtype)


@pytest.mark.parametrize("shape", [(5, 64), (4, 45), (3, 1), (2, 3, 33), (6, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_is_the_ocp_rule_bit_for_bit(shape, dtype):
    for seed in (0, 1):
        w = _inputs(shape, seed, dtype)
        codes, exps = quantize_mxfp4(w)
        ref_codes, ref_exps, ref_values = _reference(w)
        assert torch.equal(exps, ref_exps) and torch.equal(codes, ref_codes)
        values = dequantize_mxfp4(codes, exps, torch.float64)
        assert torch.equal(values, ref_values)
        fake = mxfp4_fake_quant(w)
        assert fake.dtype == dtype and torch.equal(fake.double(), ref_values)  # exact in the input's dtype


def test_nan_and_inf_poison_their_block_only():
    w = torch.randn(2, 96)
    w[0, 40] = float("nan")
    w[1, 70] = float("inf")
    out = mxfp4_fake_quant(w)
    nan = torch.isnan(out)
    assert nan[0, 32:64].all() and nan[1, 64:96].all() and nan.sum() == 64
    assert torch.equal(out[~nan], mxfp4_fake_quant(torch.where(nan, 0.0, w))[~nan])
    health = mxfp4_health(w)
    assert health["nan_blocks"] == 2


def test_health_counts_underflow_and_blocks_at_the_scale_floor():
    """A block whose amax is 2^-140 sits at E8M0's floor (its exponent wants -142, clamps to -127) and every value
    flushes to 0; a block with one outlier 2^10 times its other values flushes those (they fall below 0.25 of the
    outlier's scale)."""
    w = torch.randn(3, 64) * 0.1
    w[0, :32] = torch.full((32,), 2.0**-140)
    w[1, 32:64] = 1e-4
    w[1, 32] = 1.0
    health = mxfp4_health(w)
    assert health["floor_blocks"] == pytest.approx(1 / 6)
    nonzero = int((w != 0).sum())
    assert health["underflow"] >= (32 + 31) / nonzero
    assert (mxfp4_fake_quant(w)[0, :32] == 0).all() and (mxfp4_fake_quant(w)[1, 33:64] == 0).all()


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 96), (5, 45)])
def test_pack_round_trip_and_transformers_reads_the_released_layout(shape):
    """Two codes per byte, element 2i in the low nibble, one E8M0 byte per 32: ``unpack_mxfp4`` gives back the cast's
    values, and transformers' own DeepSeek-V4 FP4 loader (``Fp8Dequantize``) reads our export to the same values."""
    w = _inputs(shape, 3, torch.float32)
    packed, scale = pack_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape[-1] == -(-shape[-1] // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape[-1] == -(-shape[-1] // 32)
    want = mxfp4_fake_quant(w)
    assert torch.equal(unpack_mxfp4(packed, scale, shape[-1], torch.float32), want)
    if shape[-1] % 32 == 0:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # slow import: this case only

        hf = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
        assert torch.equal(hf, want)


def test_bad_inputs_are_one_line_errors():
    for bad in (torch.ones(4, 32, dtype=torch.int32), torch.ones(4, 32, dtype=torch.float8_e4m3fn), "w"):
        with pytest.raises(ValueError, match="MXFP4 takes a float16/bfloat16/float32/float64 tensor") as err:
            mxfp4_fake_quant(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unpack_mxfp4: expected int8 packed codes"):
        unpack_mxfp4(torch.zeros(2, 16, dtype=torch.float32), torch.zeros(2, 1, dtype=torch.uint8))
    x, w, m = torch.randn(128, 64), torch.randn(2, 32, 64), torch.zeros(128, dtype=torch.int32)
    with pytest.raises(ValueError, match="weight_format must be one of bf16, fp8, mxfp4_qat"):
        grouped_linear(x, w, m, weight_format="nvfp4")
    with pytest.raises(ValueError, match="model.expert_weight_format must be one of bf16, fp8, mxfp4_qat"):
        load_config(None, ['model.expert_weight_format="fp4"'])


def test_fake_quant_op_passes_the_gradient_straight_through():
    w = torch.randn(3, 70, requires_grad=True)
    g = torch.randn(3, 70)
    mxfp4_fake_quant(w).backward(g)
    assert torch.equal(w.grad, g)
    torch.library.opcheck(torch.ops.dsv3.mxfp4_fake_quant.default, (torch.randn(4, 64, requires_grad=True),))


def test_grouped_linear_qat_is_the_gemm_of_the_fp4_weight_with_the_gradient_to_the_master():
    """Forward and input gradient equal the plain grouped GEMM given the MXFP4 weight, bit for bit; the weight
    gradient is the plain GEMM's (straight through), landing on the master parameter."""
    torch.manual_seed(0)
    x = torch.randn(256, 64, requires_grad=True)
    m = torch.cat([torch.zeros(100), torch.full((28,), -1), torch.ones(120), torch.full((8,), -1)]).int()
    master = torch.nn.Parameter(torch.randn(2, 48, 64) * 0.05)
    fp4 = torch.nn.Parameter(mxfp4_fake_quant(master.detach()))
    dy = torch.randn(256, 48)
    out = grouped_linear(x, master, m, weight_format="mxfp4_qat")
    (out * dy).sum().backward()
    gx, x.grad = x.grad, None
    ref = grouped_linear(x, fp4, m)
    (ref * dy).sum().backward()
    assert torch.equal(out, ref) and torch.equal(gx, x.grad) and torch.equal(master.grad, fp4.grad)
    assert not torch.equal(out, grouped_linear(x, master, m))  # the quantisation is visible


def test_model_with_mxfp4_experts_equals_the_model_given_fp4_expert_weights():
    """``expert_weight_format = "mxfp4_qat"``: the model's loss is the bf16-format model's with every routed expert
    weight replaced by its MXFP4 value (same bits), the expert gradients reach the master weights, and nothing but
    the routed experts changes (dense FFN and shared experts see their own weights)."""
    torch.manual_seed(0)
    args = ModelArgs.preset("debug", n_layers=2, n_dense_layers=1, n_mtp_layers=0)
    qat = Transformer(ModelArgs.preset("debug", n_layers=2, n_dense_layers=1, n_mtp_layers=0,
                                       expert_weight_format="mxfp4_qat"))
    plain = Transformer(args)
    plain.load_state_dict(qat.state_dict())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if ".experts." in name:
                p.copy_(mxfp4_fake_quant(p))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    losses = []
    for model in (qat, plain):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten())
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    named = dict(plain.named_parameters())
    for name, p in qat.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, named[name].grad), name


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mxfp4_qat_dualpipev_ep_zero1_equals_one_process(tmp_path):
    """MXFP4 QAT experts with AdamW on DualPipeV x EP2 x ZeRO-1 (4 gloo ranks, ``recipes.train``) against one process.
    Step 1 quantises identical weights (the reordering's 1e-5); later steps may flip an FP4 rounding where the
    master weights differ by the reordering's ~1e-7, which test_muon_dist's LOSS_ATOL (1e-4) bounds as it does
    for Muon's bf16 rounding (one element of a 64-wide matrix moved by one grid step of <= 25% of its block's
    scale)."""
    fp4 = ['model.expert_weight_format="mxfp4_qat"', 'optim.name="adamw"']
    four = _train(tmp_path / "four", DUALPIPEV, 3, extra=fp4)
    _close(four, _train(tmp_path / "one", ONE, 3, extra=fp4))
    plain = _train(tmp_path / "plain", ONE, 3, extra=['optim.name="adamw"'])
    assert max(abs(plain[s] - four[s]) for s in four) > 5 * LOSS_ATOL  # QAT changes the forward: this can fail


def test_fp8_health_reports_the_mxfp4_expert_casts():
    """The FP8 health collector attaches to MXFP4 QAT experts and reports each expert weight's cast with the FP8
    fields: values, underflow, blocks at the scale floor (and the zeros they hide), E2M1 subnormals, log2 amax;
    checked against ``mxfp4_health`` and a direct count."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.preset("debug", n_layers=2, n_dense_layers=1, n_mtp_layers=0,
                                         expert_weight_format="mxfp4_qat"))
    experts = model.layers[1].ffn.experts
    with torch.no_grad():
        experts.w2[0, :, :32] = 2.0**-140  # blocks at the floor, every value flushed
    health = Fp8Health()
    assert health.attach([model]) == 1  # the one MoE layer's GroupedExperts (no FP8 layer elsewhere)
    health.active = True
    model(torch.randint(0, 256, (2, 16)))
    got = {(r.layer, r.gemm, r.operand): r for r in rows(health.counts())}
    row = got[("layers.1.ffn.experts.w2", "fwd", "w")]
    w2 = experts.w2.detach()
    assert row.values == int((w2 != 0).sum())
    assert row.underflow == pytest.approx(mxfp4_health(w2)["underflow"], rel=1e-12)
    assert row.floored == pytest.approx(mxfp4_health(w2)["floor_blocks"], rel=1e-12) and row.floored > 0
    assert row.hidden >= 32 * w2.shape[1] / row.values
    assert row.log2_amax_min == pytest.approx(-140.0)


def test_qat_under_mxfp8_feeds_the_fp4_weight_to_the_fp8_gemms_exactly():
    """With ``fp8="mxfp8"`` the expert GEMMs run in FP8 on the MXFP4 weight: its 1x32 E8M0 blocks are MXFP8's
    blocks, so the FP8 cast holds every FP4 value exactly (e2m1 x 2^e rescaled by a power of two lands on e4m3's
    normal grid); forward, input gradient and weight gradient equal the plain MXFP8 layer given the FP4 weight."""
    torch.manual_seed(1)
    master = torch.nn.Parameter(torch.randn(2, 48, 128) * 0.05)
    fp4_value = mxfp4_fake_quant(master.detach())
    q = per_token_cast_to_fp8(fp4_value.reshape(-1, 128), True, 32)
    assert torch.equal(dequantize(*q), fp4_value.reshape(-1, 128))
    fp4 = torch.nn.Parameter(fp4_value.clone())
    x = torch.randn(256, 128, requires_grad=True)
    m = torch.cat([torch.zeros(128), torch.ones(100), torch.full((28,), -1)]).int()
    dy = torch.randn(256, 48)
    out = grouped_linear(x, master, m, fp8="mxfp8", weight_format="mxfp4_qat")
    (out * dy).sum().backward()
    gx, x.grad = x.grad, None
    ref = grouped_linear(x, fp4, m, fp8="mxfp8")
    (ref * dy).sum().backward()
    assert torch.equal(out, ref) and torch.equal(gx, x.grad) and torch.equal(master.grad, fp4.grad)
    load_config(None, ['model.expert_weight_format="mxfp4_qat"', "model.fp8=true", 'model.fp8_recipe="mxfp8"'])
