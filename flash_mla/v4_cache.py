"""FlashMLA's FP8 KV-cache layout for DeepSeek-V4 (its "MODEL1" sparse format): 584 bytes per token.

V4's one 512-wide K = V head is stored as bytes 0-447: the first 448 values (the non-RoPE part) in e4m3, in 7
tiles of 64; 448-575: the last 64 values (the RoPE part) in bf16 (its range depends on the position); 576-582:
the 7 tiles' scales in UE8M0 (a biased exponent byte: scale = 2^(byte - 127), the power of two at or above
amax / 448, so the division is exact and every value lands within e4m3's range); 583: padding. Against bf16 rows
(1024 bytes) that is 0.57x the bytes a decode step reads.

Dequantised values (e4m3 value x a power of two) are exact in bf16 and fp32, so the cache's only error is the
e4m3 rounding: per value at most 2^-4 of its magnitude (3 mantissa bits) or, below e4m3's normal range, 2^-10
times its tile's scale (``fp8_error_bound``).
"""

from __future__ import annotations

import torch

D_NOPE, D_ROPE, TILE = 448, 64, 64
TILES = D_NOPE // TILE  # 7
BYTES_PER_TOKEN = D_NOPE + 2 * D_ROPE + TILES + 1  # 584
ROPE_AT, SCALES_AT = D_NOPE, D_NOPE + 2 * D_ROPE  # byte offsets
E4M3_MAX = 448.0
_MIN_EXP, _MAX_EXP = 1, 254  # UE8M0 bytes kept normal (0 and 255 unused)


def _scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of the smallest power of two >= amax / 448 (all-zero tiles take the smallest)."""
    mant, exp = torch.frexp(amax.float() / E4M3_MAX)  # x = mant * 2^exp, mant in [0.5, 1)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)  # an exact power of two keeps its exponent
    return (ceil_log2 + 127).clamp(_MIN_EXP, _MAX_EXP).to(torch.uint8)


def scales_of(byte: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2^(byte - 127) of UE8M0 bytes."""
    return torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte.to(torch.int32) - 127)


def quantize_kv_v4(kv: torch.Tensor) -> torch.Tensor:
    """``[..., 512]`` rows (any float dtype) -> ``[..., 584]`` uint8 in FlashMLA's V4 layout (module docstring)."""
    if kv.shape[-1] != D_NOPE + D_ROPE:
        raise ValueError(f"quantize_kv_v4: kv must have last dim {D_NOPE + D_ROPE} (448 + 64 rope), got {kv.shape[-1]}")
    lead = kv.shape[:-1]
    nope = kv[..., :D_NOPE].float().reshape(*lead, TILES, TILE)
    sbytes = _scale_bytes(nope.abs().amax(-1))
    values = (nope / scales_of(sbytes).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(*lead, D_NOPE)
    out = torch.zeros(*lead, BYTES_PER_TOKEN, dtype=torch.uint8, device=kv.device)
    out[..., :D_NOPE] = values.view(torch.uint8)
    out[..., ROPE_AT:SCALES_AT] = kv[..., D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[..., SCALES_AT:SCALES_AT + TILES] = sbytes
    return out


def split_kv_v4(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a ``[..., 584]`` uint8 cache: (e4m3 ``[..., 448]``, bf16 rope ``[..., 64]``, UE8M0 bytes
    ``[..., 7]``)."""
    check_cache(cache, "cache")
    return (cache[..., :D_NOPE].view(torch.float8_e4m3fn), cache[..., ROPE_AT:SCALES_AT].view(torch.bfloat16),
            cache[..., SCALES_AT:SCALES_AT + TILES])


def dequantize_kv_v4(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., 584]`` cache -> ``[..., 512]`` rows in ``dtype`` (exact for bf16 and fp32)."""
    values, rope, sbytes = split_kv_v4(cache)
    lead = values.shape[:-1]
    nope = values.float().reshape(*lead, TILES, TILE) * scales_of(sbytes).unsqueeze(-1)
    return torch.cat([nope.reshape(*lead, D_NOPE), rope.float()], dim=-1).to(dtype)


def fp8_error_bound(kv: torch.Tensor) -> torch.Tensor:
    """Per value, the most the round trip may move it: 2^-4 |x| for the e4m3 part (2^-10 x scale below e4m3's
    normal range), bf16's 2^-8 |x| for the rope part."""
    lead = kv.shape[:-1]
    nope = kv[..., :D_NOPE].float().reshape(*lead, TILES, TILE)
    scale = scales_of(_scale_bytes(nope.abs().amax(-1))).unsqueeze(-1)
    bound = torch.maximum(nope.abs() * 2.0 ** -4, scale * 2.0 ** -10).reshape(*lead, D_NOPE)
    return torch.cat([bound, kv[..., D_NOPE:].float().abs() * 2.0 ** -8], dim=-1)


def check_cache(cache: torch.Tensor, name: str) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.shape[-1] != BYTES_PER_TOKEN:
        raise ValueError(f"{name} must be a uint8 tensor [..., {BYTES_PER_TOKEN}] in FlashMLA's V4 layout, got "
                         f"{getattr(cache, 'dtype', type(cache).__name__)} {tuple(getattr(cache, 'shape', ()))}")
