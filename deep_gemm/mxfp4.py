"""MXFP4 (OCP Microscaling v1.0): E2M1 values with one E8M0 (power-of-two) scale per 32 elements along K.

DeepSeek-V4 trains its routed experts quantisation-aware in FP4 and releases them in this format. Here:

- ``quantize_mxfp4(w)``: ``(codes, exponents)``: the E2M1 code of every element (uint8, 0..15: sign bit 3,
  magnitude index 0..7 of 0, 0.5, 1, 1.5, 2, 3, 4, 6) and each 32-block's scale exponent (int16 in [-127, 127];
  ``NAN_EXPONENT`` for a block holding a NaN or an infinity). The OCP rules: shared exponent
  ``floor(log2(amax)) - 2`` (E2M1's largest exponent), clamped to E8M0's [-127, 127] (an all-zero block takes the
  floor -127); each element ``x / 2^e`` rounded to nearest-even on the E2M1 grid, saturating at +-6. A K that is
  not a multiple of 32 ends in a shorter last block.
- ``dequantize_mxfp4(codes, exponents)``: the values ``code x 2^e`` (NaN for a NaN block).
- ``mxfp4_fake_quant(w)``: ``torch.ops.dsv3.mxfp4_fake_quant``, the round trip in ``w``'s dtype with a
  straight-through gradient (identity): quantisation-aware training of the expert weights (every value on the
  MXFP4 grid is exact in bfloat16 and float32, so the fake weight is the FP4 weight).
- ``pack_mxfp4`` / ``unpack_mxfp4``: the released V4 layout: ``int8 [..., ceil(K/2)]`` two codes per byte (element
  ``2i`` in the low nibble, ``2i + 1`` in the high one) and ``float8_e8m0fnu [..., ceil(K/32)]`` scales (byte =
  exponent + 127; 0xFF = NaN).
- ``mxfp4_health(w)``: what the FP8 health metrics report for a cast: underflow (nonzero elements that became 0)
  and blocks at the scale floor (exponent -127 with a nonzero amax, whose small values flush).
- ``fp4_act_fake_quant(x)``: ``torch.ops.dsv3.fp4_act_fake_quant``, DeepSeek-V4's activation cast (its indexer's q
  and k after the Hadamard rotation), straight-through. Same E2M1 grid and 32-blocks, but V4's scale rule, not
  OCP's: ``2^ceil(log2(amax / 6))`` with amax floored at ``6 x 2^-126``, so the block's largest value lands in
  (3, 6] and nothing saturates (OCP's ``2^(floor(log2 amax) - 2)`` clamps amax/scale in (6, 8) to 6). K must be a
  multiple of 32; a block holding a NaN or an infinity comes back NaN. ``fp4_act_cast_counts(x)``: the FP8 health
  counts of that cast (the indexer's q and k).
"""

from __future__ import annotations

import torch

from accel import registry
from deep_gemm.utils import MX_BLOCK, cast_count_row

E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of E2M1's largest normal, 1.5 x 2^2
E8M0_MIN, E8M0_MAX = -127, 127
NAN_EXPONENT = 128  # a block with a NaN or an infinity: E8M0's NaN (0xFF)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; code | 8 is the negative


def _check(w: object, name: str = "w") -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dtype.itemsize < 2 or w.ndim < 1:
        what = f"{w.dtype} tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: MXFP4 takes a float16/bfloat16/float32/float64 tensor with K as its last dim, "
                         f"got {what}")
    return w


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``w`` as float32 ``[..., nb, 32]`` blocks (the last one zero-padded), and the padding."""
    k = w.shape[-1]
    pad = (-k) % MX_BLOCK
    x = torch.nn.functional.pad(w.float(), (0, pad)) if pad else w.float()
    return x.reshape(*w.shape[:-1], -1, MX_BLOCK), pad


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [..., K], exponents int16 [..., ceil(K / 32)])`` of ``w`` under the OCP MX rules (module
    docstring)."""
    w = _check(w)
    x, pad = _blocks(w)
    amax = x.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)  # a NaN or an infinity anywhere in the block
    mantissa, exponent = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    shared = (exponent.to(torch.int32) - 1 - E2M1_EMAX).clamp(E8M0_MIN, E8M0_MAX)
    shared = torch.where(amax == 0, E8M0_MIN, shared)
    y = torch.ldexp(x, -shared.unsqueeze(-1).to(x.dtype)).abs()  # exact: a power-of-two division
    y = y.clamp(max=E2M1_MAX)
    q = round_e2m1(y)
    index = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)  # 0..7
    negative = torch.signbit(x) & (index > 0)  # -0 is stored as +0
    codes = (index | (negative.to(torch.uint8) << 3)).reshape(*w.shape[:-1], -1)
    if pad:
        codes = codes[..., :w.shape[-1]]
    exponents = torch.where(bad, NAN_EXPONENT, shared).to(torch.int16)
    return codes.contiguous(), exponents


def dequantize_mxfp4(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code x 2^exponent`` in ``dtype`` (NaN where the block's exponent is ``NAN_EXPONENT``)."""
    k = codes.shape[-1]
    blocks = -(-k // MX_BLOCK)
    if codes.dtype != torch.uint8 or exponents.shape[-1] != blocks or exponents.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"dequantize_mxfp4: expected uint8 codes [..., K] and exponents [..., ceil(K/32)], got "
                         f"{codes.dtype} {tuple(codes.shape)} and {tuple(exponents.shape)}")
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    values = table[codes.long()]
    e = exponents.to(torch.int32).repeat_interleave(MX_BLOCK, dim=-1)[..., :k]
    out = torch.ldexp(values, e.clamp(E8M0_MIN, E8M0_MAX).to(torch.float32))
    out = torch.where(e == NAN_EXPONENT, float("nan"), out)
    return out.to(dtype)


@registry.library_op("dsv3::mxfp4_fake_quant")
def _fake_quant(w: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """``y`` (|y| <= 6) rounded to nearest-even on the E2M1 grid, sign kept: spacing 0.5 below 2, 1 in [2, 4), 2 in
    [4, 6]; at each spacing the even multiples are the codes with mantissa bit 0, so torch.round's half-to-even is
    E2M1's."""
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, y)


@_fake_quant.register_fake
def _(w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(w)


def _straight_through(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad


_fake_quant.register_autograd(_straight_through)


def mxfp4_fake_quant(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to MXFP4 (32-blocks along the last dim) in its own dtype, gradient passed straight through."""
    return _fake_quant(_check(w))


FP4_ACT_FLOOR = 6.0 * 2.0**-126  # V4's amax floor: the smallest scale is 2^-126


def fp4_act_scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """V4's activation scale exponent per 32-block of ``x [..., K]`` (K a multiple of 32), int32 ``[..., K/32]``:
    ``ceil(log2(max(amax, 6 x 2^-126) / 6))``, exactly. With ``amax = m 2^p`` (m in [0.5, 1)): amax <= 6 x 2^(p-3)
    iff m <= 0.75, and amax > 6 x 2^(p-4) always, so the exponent is p - 3 when m <= 0.75, else p - 2. (V4's kernel
    takes ceil(log2) of fl(amax x fl(1/6)) from its bits; that product rounds onto a power of two only when amax / 6
    is one, so the two agree on every float32 amax.)"""
    amax = x.float().unflatten(-1, (-1, MX_BLOCK)).abs().amax(dim=-1).clamp_min(FP4_ACT_FLOOR)
    mantissa, exponent = torch.frexp(amax)
    return torch.where(mantissa <= 0.75, exponent - 3, exponent - 2).to(torch.int32)


@registry.library_op("dsv3::fp4_act_fake_quant")
def _fp4_act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    e = fp4_act_scale_exponents(x).unsqueeze(-1).float()
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    y = round_e2m1(torch.ldexp(blocks, -e).clamp(-E2M1_MAX, E2M1_MAX))  # exact: a power-of-two division
    # a block holding a NaN or an infinity is NaN whole (as MXFP4's NaN scale): the clamp would make an
    # infinity +-6 x 2^e, finite, and the NaN block's exponent (frexp's 0) scales its other values wrongly
    finite = torch.isfinite(blocks.abs().amax(dim=-1, keepdim=True))
    return torch.where(finite, torch.ldexp(y, e), float("nan")).flatten(-2).to(x.dtype)


@_fp4_act_fake_quant.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_fp4_act_fake_quant.register_autograd(_straight_through)


def fp4_act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` through DeepSeek-V4's FP4 activation cast (E2M1, a power-of-two scale per 32 along the last dim by V4's
    rule, module docstring) and back, in ``x``'s dtype; gradient straight through. A block holding a NaN or an
    infinity comes back NaN (a non-finite value never turns finite), the others are unaffected."""
    x = _check(x, "x")
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"x: the FP4 activation cast takes blocks of {MX_BLOCK} along the last dim, got a last dim "
                         f"of {x.shape[-1]}")
    return _fp4_act_fake_quant(x)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in the released V4 layout: ``(int8 [..., ceil(K/2)] two codes per byte, low nibble first;
    float8_e8m0fnu [..., ceil(K/32)] scales)``."""
    codes, exponents = quantize_mxfp4(w)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    scale = (exponents + 127).clamp(0, 255).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor, k: int | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values of a packed MXFP4 tensor (``pack_mxfp4``'s layout) in ``dtype``; ``k``: the logical K (default
    twice the packed width)."""
    if packed.dtype not in (torch.int8, torch.uint8) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"unpack_mxfp4: expected int8 packed codes and float8_e8m0fnu (or uint8) scales, got "
                         f"{packed.dtype} and {scale.dtype}")
    k = 2 * packed.shape[-1] if k is None else k
    if not 2 * packed.shape[-1] - 1 <= k <= 2 * packed.shape[-1]:
        raise ValueError(f"unpack_mxfp4: k={k} does not fit a packed width of {packed.shape[-1]} bytes")
    u8 = packed.view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).reshape(*u8.shape[:-1], -1)[..., :k]
    exponents = scale.view(torch.uint8).to(torch.int16) - 127
    return dequantize_mxfp4(codes.contiguous(), exponents, dtype)


def mxfp4_health(w: torch.Tensor) -> dict[str, float]:
    """``underflow``: share of ``w``'s nonzero finite elements that the cast turns into 0; ``floor_blocks``: share of
    blocks with a nonzero amax whose exponent sits at E8M0's floor (-127); ``nan_blocks``: blocks holding a NaN
    or an infinity."""
    codes, exponents = quantize_mxfp4(w)
    nonzero = (w != 0) & torch.isfinite(w)
    flushed = nonzero & ((codes & 7) == 0)
    x, _ = _blocks(w)
    amax = x.abs().amax(dim=-1)
    live = amax > 0
    return {"underflow": float(flushed.sum() / nonzero.sum().clamp(min=1)),
            "floor_blocks": float(((exponents == E8M0_MIN) & live).sum() / live.sum().clamp(min=1)),
            "nan_blocks": float((exponents == NAN_EXPONENT).sum())}


def mxfp4_cast_counts(x: torch.Tensor) -> torch.Tensor:
    """``deep_gemm.health.cast_counts``'s float64 ``[values, underflow, subnormal, blocks, floored, hidden, sum log2
    amax, min, max]`` for the MXFP4 cast of ``x`` (leading dims folded): nonzero values, those that became 0,
    those left on E2M1's one subnormal (0.5 x 2^e: one bit of precision), 32-blocks holding a nonzero value,
    blocks at E8M0's floor (exponent -127 while the amax wants less), the zeros among those, and the blocks'
    log2 amax."""
    codes, exponents = quantize_mxfp4(x)
    blocks, _ = _blocks(x)
    nonzero = (x != 0).reshape(-1)
    magnitude = (codes & 7).reshape(-1)
    flushed = nonzero & (magnitude == 0)
    amax = blocks.abs().amax(dim=-1).reshape(-1).double()
    live = amax > 0
    # at the floor when the shared exponent floor(log2 amax) - 2 would be below -127
    floored = live & (torch.frexp(amax)[1] - 1 - E2M1_EMAX < E8M0_MIN)
    pad = blocks.shape[-1] * blocks.shape[-2] - x.shape[-1]
    per_block = torch.nn.functional.pad(flushed.reshape(*x.shape), (0, pad)).reshape(-1, MX_BLOCK).sum(-1)
    return cast_count_row(nonzero.sum(), flushed.sum(), (nonzero & (magnitude == 1)).sum(), live.sum(),
                          floored.sum(), (per_block * floored).sum(), torch.log2(amax[live]))


def fp4_act_cast_counts(x: torch.Tensor) -> torch.Tensor:
    """``mxfp4_cast_counts`` for V4's activation cast of ``x`` (``fp4_act_fake_quant``: the indexer's q and k after
    the Hadamard rotation), the same nine float64 fields: nonzero values, those that became 0, those left on E2M1's
    subnormal (0.5 x the block's scale), 32-blocks holding a nonzero value, blocks at the scale floor (amax below
    ``FP4_ACT_FLOOR`` = 6 x 2^-126: the scale is the floor's 2^-126, not the amax's, so small values flush), the
    zeros among those, and the blocks' log2 amax. K must be a multiple of 32 (the cast's own rule). A block holding a
    NaN or an infinity (NaN after the cast) is left out of every count."""
    x = _check(x, "x")
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"x: the FP4 activation cast takes blocks of {MX_BLOCK} along the last dim, got a last dim "
                         f"of {x.shape[-1]}")
    blocks = x.float().reshape(-1, MX_BLOCK)
    e = fp4_act_scale_exponents(blocks).float()  # [nb, 1]
    magnitude = round_e2m1(torch.ldexp(blocks, -e).clamp(-E2M1_MAX, E2M1_MAX)).abs()
    amax = blocks.abs().amax(dim=-1).double()
    finite = torch.isfinite(amax)
    nonzero = (blocks != 0) & finite.unsqueeze(-1)
    flushed = nonzero & (magnitude == 0)
    live = (amax > 0) & finite
    floored = live & (amax < FP4_ACT_FLOOR)
    return cast_count_row(nonzero.sum(), flushed.sum(), (nonzero & (magnitude == 0.5)).sum(), live.sum(),
                          floored.sum(), (flushed.sum(-1) * floored).sum(), torch.log2(amax[live]))
