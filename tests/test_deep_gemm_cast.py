"""deep_gemm casts: e4m3 rounding, scale shapes, the Triton kernel against torch's own cast."""

import pytest
import torch

import deep_gemm
from accel import registry
from deep_gemm import reference

E4M3_MAX = 448.0


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, decoded from its bit pattern by torch."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])


def _nearest_even_on_grid(y: torch.Tensor) -> torch.Tensor:
    """Independent float64 round-to-nearest-even onto the e4m3 grid (no torch fp8 cast involved)."""
    grid = _e4m3_grid().double()
    mag = y.double().abs().clamp(max=E4M3_MAX)
    idx = torch.searchsorted(grid, mag).clamp(1, grid.numel() - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (hi - mag < mag - lo) | ((hi - mag == mag - lo) & (((idx) % 2) == 0))  # even mantissa = even index
    out = torch.where(pick_hi, hi, lo)
    out = torch.where(mag == lo, lo, out)
    return out * y.double().sign()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_rounding_carries_into_exponent(impl):
    # 124.3 lies between 120 and 128 (closer to 128): rounding carries into the exponent. Triton's
    # interpreter casts it to 64; our kernel must round onto the grid itself and give 128.
    row = torch.zeros(1, 128)
    row[0, :6] = torch.tensor([448.0, 124.3, -124.3, 15.9, 0.0049, 239.9])  # amax 448 -> scale 1
    with registry.force(impl):
        q, sf = deep_gemm.per_token_cast_to_fp8(row)
    assert sf.item() == 1.0
    assert q.float()[0, :6].tolist() == [448.0, 128.0, -128.0, 16.0, 0.005859375, 240.0]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_every_value_rounds_to_nearest_even(impl):
    # Values spread over the whole e4m3 range, subnormals included, plus exact ties between grid points.
    grid = _e4m3_grid()
    ties = (grid[1:] + grid[:-1]) / 2
    y = torch.cat([ties, -ties, torch.rand(2000) * 448, -torch.rand(1000) * 0.02, torch.randn(1000) * 3])
    y = y[: (y.numel() // 128) * 128].view(-1, 128)
    y[:, 0] = 448.0  # pin every row's scale to exactly 1
    with registry.force(impl):
        q, sf = deep_gemm.per_token_cast_to_fp8(y)
    assert torch.all(sf == 1.0)
    torch.testing.assert_close(q.double(), _nearest_even_on_grid(y), rtol=0, atol=0)


@pytest.mark.parametrize("kind,tile", [("per_token", (1, 128)), ("per_channel", (128, 1)),
                                       ("per_block", (128, 128))])
@pytest.mark.parametrize("shape", [(1, 128), (129, 256), (256, 200), (2, 130, 256)])
def test_triton_cast_matches_reference_bitwise(kind, tile, shape):
    x = torch.randn(*shape) * torch.exp(torch.randn(*shape[:-1], 1) * 2)
    x[..., 0, :4] = torch.tensor([124.3, -1e-3, 0.0, -1e-6])  # -1e-6 rounds to -0.0 (+0.0 if negated as 0 - x)
    x = x.to(torch.bfloat16)
    fn = getattr(deep_gemm, f"{kind}_cast_to_fp8")
    with registry.poisoned_outputs(), registry.force("triton"):
        q, sf = fn(x)
    q_ref, sf_ref = fn(x)  # the suite defaults to the reference
    rows, cols = shape[-2:]
    assert sf.shape == (*shape[:-2], -(-rows // tile[0]), -(-cols // tile[1]))
    assert torch.equal(sf, sf_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_scale_is_amax_over_448_with_a_floor():
    x = torch.randn(4, 256)
    x[1, :128] = 0.0  # an all-zero tile must not divide by zero
    q, sf = deep_gemm.per_token_cast_to_fp8(x)
    want = x.view(4, 2, 128).abs().amax(-1).clamp_min(1e-4) / E4M3_MAX
    torch.testing.assert_close(sf, want, rtol=0, atol=0)
    assert torch.all(q.float()[1, :128] == 0)
    # Dequantized values are within half an e4m3 step (2^-4 relative) of the input.
    deq = reference.dequantize(q, sf)
    assert torch.all((deq - x).abs() <= x.abs() * 2.0**-4 + sf.repeat_interleave(128, 1) * 2.0**-10)


def test_block_scales_cover_128x128_tiles_with_partial_edges():
    w = torch.randn(200, 300)
    q, sf = deep_gemm.per_block_cast_to_fp8(w)
    assert q.shape == (200, 300) and sf.shape == (2, 3)
    assert sf[1, 2] == w[128:, 256:].abs().max() / E4M3_MAX
    rel = (reference.dequantize(q, sf) - w).norm() / w.norm()
    assert rel < 0.03  # e4m3 keeps 3 mantissa bits: ~2-3% relative rms error


def test_ue8m0_scales_are_powers_of_two():
    _, sf = deep_gemm.per_token_cast_to_fp8(torch.randn(8, 256) * 7, use_ue8m0=True)
    assert torch.equal(sf, torch.exp2(torch.round(torch.log2(sf))))


def test_cast_rejects_integer_input():
    with pytest.raises(ValueError, match="x must be a float32/bfloat16/float16"):
        deep_gemm.per_token_cast_to_fp8(torch.ones(4, 128, dtype=torch.int32))
