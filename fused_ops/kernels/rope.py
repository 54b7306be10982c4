"""Rotary embedding applied to ``x [batch, seq, heads, d]`` (any strides, unit last stride).

Two layouts, one kernel each around the same rotation: DeepSeek-V3's MLA rotates interleaved pairs
``(x0, x1), (x2, x3), ...``; V3.2's indexer rotates the halves ``(x_i, x_{i + d/2})``. ``cos``/``sin``
``[seq, d/2]`` or ``[batch, seq, d/2]`` (fp32, YaRN's frequencies and scale already in them) are read once per
token for all its heads. The backward is the inverse rotation (``sign = -1``: ``sin`` negated) of the gradient,
in place as well. In place means ``out`` is ``x``: each element is read and written by the same
program, so no other reads it after it is overwritten; otherwise ``out`` may have its own strides. Math in fp32, one
rounding to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry
from fused_ops.kernels.common import on_grid

BLOCK_H = 16


@triton.jit
def _rotate(x0, x1, c, s):
    return x0 * c - x1 * s, x1 * c + x0 * s


@triton.jit
def _token(S, stride_b, stride_s, stride_ob, stride_os, stride_cb, stride_cs):
    """Offsets of this program's token in x, out and cos/sin."""
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    t = (pid % S).to(tl.int64)
    return b * stride_b + t * stride_s, b * stride_ob + t * stride_os, b * stride_cb + t * stride_cs


@triton.jit
def _rope_interleaved_kernel(X, OUT, COS, SIN, S, H, stride_b, stride_s, stride_h, stride_ob, stride_os, stride_oh,
                             stride_cb, stride_cs, sign, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    x_off, o_off, c_off = _token(S, stride_b, stride_s, stride_ob, stride_os, stride_cb, stride_cs)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, HALF)
    c = tl.load(COS + c_off + pairs)[None, :]
    s = tl.load(SIN + c_off + pairs)[None, :] * sign
    cols = tl.arange(0, 2 * HALF)
    at = x_off + heads[:, None].to(tl.int64) * stride_h + cols[None, :]
    to = o_off + heads[:, None].to(tl.int64) * stride_oh + cols[None, :]
    ok = heads[:, None] < H
    x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_H, HALF, 2)))
    y0, y1 = _rotate(x0, x1, c, s)
    y = tl.reshape(tl.join(y0, y1), (BLOCK_H, 2 * HALF))
    tl.store(OUT + to, on_grid(y, X.dtype.element_ty).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_half_kernel(X, OUT, COS, SIN, S, H, stride_b, stride_s, stride_h, stride_ob, stride_os, stride_oh,
                      stride_cb, stride_cs, sign,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    x_off, o_off, c_off = _token(S, stride_b, stride_s, stride_ob, stride_os, stride_cb, stride_cs)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    c = tl.load(COS + c_off + cols)[None, :]
    s = tl.load(SIN + c_off + cols)[None, :] * sign
    at = x_off + heads[:, None].to(tl.int64) * stride_h + cols[None, :]
    to = o_off + heads[:, None].to(tl.int64) * stride_oh + cols[None, :]
    ok = heads[:, None] < H
    x0 = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(X + at + HALF, mask=ok, other=0.0).to(tl.float32)
    y0, y1 = _rotate(x0, x1, c, s)
    dtype = X.dtype.element_ty
    tl.store(OUT + to, on_grid(y0, dtype).to(dtype), mask=ok)
    tl.store(OUT + to + HALF, on_grid(y1, dtype).to(dtype), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleaved: bool = True,
         inverse: bool = False) -> torch.Tensor:
    """Write ``x`` rotated (``inverse``: by the opposite angles, the backward) into ``out`` (``x`` itself for
    in place) and return it."""
    batch, seq, heads, d = x.shape
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise registry.Unsupported("out must have x's shape and dtype and a unit last stride")
    half = d // 2
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1 or half & (half - 1):
        raise registry.Unsupported(f"x must be float32/bfloat16 with a unit last stride and a power-of-two rotary "
                                   f"dim, got {x.dtype} strides {x.stride()} d={d}")
    if cos.dtype != torch.float32 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise registry.Unsupported("cos and sin must be float32 with the same strides and a unit last stride")
    c3, s3 = (cos, sin) if cos.dim() == 3 else (cos.unsqueeze(0), sin.unsqueeze(0))
    stride_cb = 0 if c3.shape[0] == 1 else c3.stride(0)
    kernel = _rope_interleaved_kernel if interleaved else _rope_half_kernel
    if x.numel():
        registry.wrap_triton(kernel)[(batch * seq, triton.cdiv(heads, BLOCK_H))](
            x, out, c3, s3, seq, heads, *x.stride()[:3], *out.stride()[:3], stride_cb, c3.stride(1),
            -1.0 if inverse else 1.0, HALF=half, BLOCK_H=BLOCK_H)
    return out
