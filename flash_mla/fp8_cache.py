"""FlashMLA's FP8 KV-cache layout: 656 bytes per token and KV head.

Bytes 0-511: the 512 latent values in e4m3; 512-527: four fp32 scales, one per 128-value tile
(scale = amax / 448, floored for all-zero tiles); 528-655: the 64 RoPE values in bf16 (RoPE stays
in bf16 because its dynamic range depends on position). Dequantised values are rounded to bf16,
as the kernel feeds bf16 tensor-core MMAs.
"""

from __future__ import annotations

import torch

D_NOPE, D_ROPE, TILE = 512, 64, 128
BYTES_PER_TOKEN = D_NOPE + 4 * (D_NOPE // TILE) + 2 * D_ROPE  # 656
E4M3_MAX = 448.0
_MIN_SCALE = 1e-10  # floor for all-zero tiles (any positive value works: their payload is zero)


def quantize_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """``[..., 576]`` bf16/fp32 KV cache -> ``[..., 656]`` ``float8_e4m3fn`` in FlashMLA's byte layout."""
    if kv.shape[-1] != D_NOPE + D_ROPE:
        raise ValueError(f"quantize_kv_fp8: kv must have last dim {D_NOPE + D_ROPE} (512 latent + 64 rope), "
                         f"got {kv.shape[-1]}")
    lead = kv.shape[:-1]
    nope = kv[..., :D_NOPE].float().reshape(*lead, D_NOPE // TILE, TILE)
    scale = (nope.abs().amax(-1) / E4M3_MAX).clamp_min(_MIN_SCALE)
    values = (nope / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(*lead, D_NOPE)
    out = torch.empty(*lead, BYTES_PER_TOKEN, dtype=torch.uint8, device=kv.device)
    out[..., :D_NOPE] = values.view(torch.uint8)
    out[..., D_NOPE:D_NOPE + 16] = scale.float().contiguous().view(torch.uint8)
    out[..., D_NOPE + 16:] = kv[..., D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def split_fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a ``[..., 656]`` cache (uint8 or e4m3): (e4m3 [..., 512], fp32 scales [..., 4], bf16 rope [..., 64])."""
    if cache.shape[-1] != BYTES_PER_TOKEN or cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"an FP8 KV cache must be uint8/float8_e4m3fn with last dim {BYTES_PER_TOKEN}, got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    raw = cache.view(torch.uint8)
    return (raw[..., :D_NOPE].view(torch.float8_e4m3fn), raw[..., D_NOPE:D_NOPE + 16].view(torch.float32),
            raw[..., D_NOPE + 16:].view(torch.bfloat16))


def dequantize_kv_fp8(cache: torch.Tensor) -> torch.Tensor:
    """``[..., 656]`` FP8 cache -> ``[..., 576]`` bf16 (values x tile scale, rounded to bf16)."""
    values, scales, rope = split_fp8_cache(cache)
    lead = values.shape[:-1]
    nope = values.float().reshape(*lead, D_NOPE // TILE, TILE) * scales.unsqueeze(-1)
    return torch.cat([nope.reshape(*lead, D_NOPE).to(torch.bfloat16), rope], dim=-1)
