"""FP8 health counters (deep_gemm.health) against hand-computed casts, and through the FP8 Linear's three GEMMs."""

import math

import pytest
import torch

from deep_gemm import per_block_cast_to_fp8, per_channel_cast_to_fp8, per_token_cast_to_fp8
from deep_gemm.health import Fp8Health, cast_counts, merge_counts, rows
from deep_gemm.linear import Fp8Linear, grouped_linear
from training.metrics import fp8_health_metrics


def hand_tensor() -> torch.Tensor:
    """Three 1x128 tiles whose e4m3 fate is known by hand (e4m3: smallest normal 2^-6, smallest subnormal 2^-9,
    round to nearest even):
      row 0, amax 448 so scale 1: 448 and 2^-6 stay normal; 2^-7 and 2^-9 become subnormals; 2^-10 (half the
             smallest subnormal, a tie, to the even 0) and 0.6 * 2^-10 become 0; the 0s are not counted
      row 1, amax 3e-11 < DeepGEMM's floor 1e-4, so scale = 1e-4 / 448: 3e-11 * 448 / 1e-4 = 1.3e-4 < 2^-10, all
             three values become 0 although amax / 448 would have kept them (hidden underflow)
      row 2, amax 1e-6 also floored, but 1e-6 * 448 / 1e-4 = 4.48 is normal: floored, nothing lost"""
    x = torch.zeros(3, 128)
    x[0, :6] = torch.tensor([448.0, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 0.6 * 2.0 ** -10])
    x[1, 10:13] = torch.tensor([1e-11, 2e-11, -3e-11])
    x[2, 127] = -1e-6
    return x


def test_cast_counts_match_the_hand_count():
    x = hand_tensor()
    values, under, sub, tiles, floored, hidden, log2_sum, lo, hi = cast_counts(x, *per_token_cast_to_fp8(x)).tolist()
    assert (values, under, sub, tiles, floored, hidden) == (10, 5, 2, 3, 2, 3)
    assert hi == pytest.approx(math.log2(448), abs=1e-6)
    assert lo == pytest.approx(math.log2(1e-4), abs=1e-5)  # the floored tiles report the floor, not 3e-11
    assert log2_sum == pytest.approx(math.log2(448) + 2 * math.log2(1e-4), abs=1e-5)


def test_cast_counts_find_the_tile_shape_and_fold_groups():
    x = hand_tensor()
    # the same values as one 128x1 column tile each (per-channel): transposing changes nothing but the tiles
    xt = torch.zeros(128, 3)
    xt[:, :] = x.T
    values, under, sub, tiles, *_ = cast_counts(xt, *per_channel_cast_to_fp8(xt)).tolist()
    assert (values, under, sub, tiles) == (10, 5, 2, 3)
    # one 128x128 block holding all three rows: amax 448 for every value, so rows 1 and 2 underflow too
    block = torch.zeros(2, 128, 128)  # two groups; the second is all zero: no live tile, no values
    block[0, :3] = x
    values, under, sub, tiles, floored, hidden, *_ = cast_counts(block, *per_block_cast_to_fp8(block)).tolist()
    assert (values, under, sub, tiles, floored, hidden) == (10, 5 + 1, 2, 1, 0, 0)


def test_linear_reports_each_gemm_only_while_active():
    torch.manual_seed(3)
    layer = Fp8Linear(200, 136, bias=False)  # odd sizes: K and N padded to 256 and 256
    health = Fp8Health()
    assert health.attach([layer]) == 1 and layer.health is health
    x = torch.randn(5, 200, requires_grad=True)
    layer(x).sum().backward()
    assert health.counts() == {}  # inactive: nothing counted
    health.active = True
    x = torch.randn(5, 200) * torch.logspace(-12, 0, 200)  # a wide range: some columns underflow
    x.requires_grad_(True)
    layer(x).square().sum().backward()
    layer(torch.randn(7, 200)).sum().backward()  # a second micro-batch: a report samples the first cast only
    got = {(r.gemm, r.operand): r for r in rows(health.counts())}
    assert set(got) == {("fwd", "w"), ("fwd", "x"), ("dgrad", "dy"), ("wgrad", "dy"), ("wgrad", "x")}
    assert {r.layer for r in got.values()} == {"weight"}  # named by its parameter (the root's own: 'weight')
    fx = got[("fwd", "x")]
    assert fx.values == 5 * 200
    # independent count: per 1x128 tile (K padded to 256) amax floored at 1e-4, each value divided by amax / 448
    # and cast by torch (the first tile of a row holds values of 1e-12 .. ~1e-4: mostly floored)
    tiles = torch.nn.functional.pad(x.detach(), (0, 56)).view(5, 2, 128)
    scale = tiles.abs().amax(dim=2, keepdim=True).clamp_min(1e-4) / 448
    q = (tiles / scale).to(torch.float8_e4m3fn).float().view(5, 256)[:, :200]
    assert fx.underflow == pytest.approx(float((q == 0).double().mean()), abs=1e-12)
    floored = (tiles.abs().amax(dim=2, keepdim=True) < 1e-4).expand(5, 2, 128).reshape(5, 256)[:, :200]
    assert floored.any()
    assert fx.hidden == pytest.approx(float(((q == 0) & floored).double().sum() / 1000), abs=1e-12)
    assert 0 < fx.underflow < 1
    assert health.counts() == {}  # read once, then reset


def test_ue8m0_scales_and_their_power_of_two_floor():
    """UE8M0 (power-of-two) scales: the floor's scale is 1e-4 / 448 rounded up to 2^-22, so a floored tile reports
    amax 2^-22 x 448 > 1e-4; the hand tensor's floored rows must still count as floored (3e-11 still goes to 0, 1e-6
    still stays), and row 0 (scale 1, a power of two already) is unchanged."""
    x = hand_tensor()
    values, under, sub, tiles, floored, hidden, *_ = cast_counts(x, *per_token_cast_to_fp8(x, use_ue8m0=True)).tolist()
    assert (values, under, sub, tiles, floored, hidden) == (10, 5, 2, 3, 2, 3)


def test_mxfp8_tiles():
    """MXFP8's 1x32 tiles (UE8M0 scales): the same hand counts, the tile shape found from the scales' shape (row 0's
    values all sit in its first 32 columns, rows 1 and 2 in one tile each)."""
    x = hand_tensor()
    q, sf = per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32)
    assert sf.shape == (3, 4)
    values, under, sub, tiles, floored, hidden, *_ = cast_counts(x, q, sf).tolist()
    assert (values, under, sub, tiles, floored, hidden) == (10, 5, 2, 3, 2, 3)


def test_grouped_experts_and_merge():
    torch.manual_seed(4)
    w = torch.randn(2, 64, 96, requires_grad=True)
    m_indices = torch.tensor([0] * 128 + [1] * 100 + [-1] * 28)
    health = Fp8Health()
    health._names[id(w)] = "experts.w13"
    health.active = True
    x = torch.randn(256, 96, requires_grad=True)
    grouped_linear(x, w, m_indices, fp8=True, health=health).sum().backward()
    counts = health.counts()
    assert {k.split("|")[1] for k in counts} == {"fwd", "dgrad", "wgrad"}
    assert counts["experts.w13|fwd|x"][0] == 228 * 96  # padding rows are zeroed, not counted
    both = merge_counts([counts, counts])
    assert both["experts.w13|fwd|x"][0] == 2 * 228 * 96
    assert both["experts.w13|fwd|x"][7:] == counts["experts.w13|fwd|x"][7:]


def test_report_warns_naming_layer_and_gemm_once_then_when_doubled():
    def counts(under: float) -> dict:
        # 1000 values of which `under` round to 0 (all in floored tiles); a healthy second layer
        return {"layers.2.ffn.experts.w2|wgrad|dy": [1000, under, 50, 10, 10, under, -140.0, -14.0, -13.0],
                "layers.2.attn.wq_b|fwd|x": [1000, 0, 0, 10, 0, 0, 10.0, 0.5, 1.5]}

    warned: dict[str, float] = {}
    metrics, lines = fp8_health_metrics(counts(20), 10, 0.01, warned)
    assert metrics["fp8_wgrad_underflow_max"] == 0.02 and metrics["fp8_fwd_underflow_max"] == 0.0
    assert metrics["fp8_health"]["layers.2.ffn.experts.w2"]["wgrad.dy"]["hidden_underflow"] == 0.02
    assert metrics["fp8_log2_amax_min"] == -14.0 and metrics["fp8_log2_amax_max"] == 1.5
    assert len(lines) == 1 and "step 10: layers.2.ffn.experts.w2 wgrad dy: 2.00% of nonzero values" in lines[0]
    assert fp8_health_metrics(counts(30), 20, 0.01, warned)[1] == []  # worse, but not yet doubled
    assert len(fp8_health_metrics(counts(40), 30, 0.01, warned)[1]) == 1
    assert fp8_health_metrics(counts(5), 40, 0.01, {})[1] == []  # under the threshold
