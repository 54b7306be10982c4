"""Rotary embedding with YaRN context extension, applied to interleaved pairs as in DeepSeek's reference.

DeepSeek's checkpoints rotate pairs ``(x0, x1), (x2, x3), ...`` (``torch.view_as_complex`` of the
last dim), not the two halves used by Llama-style ``rotate_half``; transformers calls this
``rope_interleave=True``. YaRN blends interpolated and extrapolated frequencies with a linear ramp
between the ``beta_fast`` / ``beta_slow`` correction dims, and scales cos/sin by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (1 for V3); the softmax-scale
correction lives in ``ModelArgs.softmax_scale``.
"""

from __future__ import annotations

import math

import torch

import fused_ops
from models.deepseek_v3.args import ModelArgs


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies ``[qk_rope_head_dim / 2]`` (fp32), YaRN-corrected when enabled."""
    return yarn_inv_freq(args, args.qk_rope_head_dim, args.rope_theta, args.yarn, device)


def yarn_inv_freq(args, dim: int, base: float, yarn: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """``1 / base^(2i / dim)`` for the ``dim / 2`` pairs, with YaRN's ramp between ``args.beta_fast`` and
    ``args.beta_slow`` rotations over ``args.original_seq_len`` (frequencies divided by ``args.rope_factor``)
    when ``yarn``. ``args``: any arguments object with those fields (V3's and V4's ``ModelArgs``)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if not yarn:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return freqs / args.rope_factor * ramp + freqs * (1 - ramp)


def rope_cos_sin(args: ModelArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*positions.shape, qk_rope_head_dim / 2]`` in fp32 for integer ``positions``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq(args, positions.device)
    scale = attention_factor(args)
    return angles.cos() * scale, angles.sin() * scale


def attention_factor(args: ModelArgs) -> float:
    """YaRN's cos/sin scale as transformers computes it (1 for V3, whose mscale == mscale_all_dim)."""
    if not args.yarn:
        return 1.0
    if args.mscale and args.mscale_all_dim:
        return _yarn_mscale(args.rope_factor, args.mscale) / _yarn_mscale(args.rope_factor, args.mscale_all_dim)
    return _yarn_mscale(args.rope_factor, 1.0)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [b, s, h, d]`` by ``cos/sin [s, d/2]`` (or ``[b, s, d/2]``); fp32 math.

    The output keeps DeepSeek's pair layout ``(y0, y1), (y2, y3), ...`` (transformers de-interleaves
    into halves instead; attention scores are the same because q and k are permuted alike).
    ``fused``: one ``fused_ops.apply_rope`` kernel each way where it runs (one rounding, as the torch path: one
    complex multiply; ``fused_ops.rotary`` decides).
    """
    return fused_ops.rotary(x, cos, sin, fused=fused)


def apply_rotary_emb_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Rotate ``x [b, s, h, d]`` as two halves, ``(x[:d/2], x[d/2:])`` paired element by element (Llama's
    ``rotate_half``; transformers' ``rope_interleave=False``), by ``cos/sin [s, d/2]``; fp32 math. V3.2's
    lightning indexer lays its RoPE dims out this way, unlike the main MLA's interleaved pairs. ``fused``: one
    ``fused_ops.apply_rope`` kernel each way where it runs (one rounding, as here)."""
    return fused_ops.rotary(x, cos, sin, interleaved=False, fused=fused)
