"""Round-to-nearest-even helpers for Triton kernels that keep values in fp32, so a final cast is exact.

Why: Triton's CPU interpreter casts fp32 -> e4m3 wrongly when rounding carries into the exponent
(124.3 -> 64) and truncates fp32 -> bf16; rounding first in fp32 makes every backend agree with torch.
Shared by every kernel package (deep_gemm, fused_ops): FP8 casts must agree bit for bit across them.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3_grid(y):
    """Round fp32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, staying in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of 23 mantissa bits; the carry may correctly bump the exponent.
    keep_lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + keep_lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    # Subnormal range (|y| < 2^-6): multiples of 2^-9; adding 2^14 makes fp32's ulp 2^-9. Negated as sub * -1.0,
    # not -sub: Triton 3.6 compiles (and interprets) a float's unary minus as 0 - x, which turns a negative that
    # rounds to zero into +0.0 where torch's cast gives -0.0 (3.9 emits a true negation; its code is unchanged).
    mag = tl.abs(y)
    sub = (mag + 16384.0) - 16384.0
    sub = tl.where(y < 0, sub * -1.0, sub)
    out = tl.where(mag < 0.015625, sub, normal)
    return tl.minimum(tl.maximum(out, -448.0), 448.0)


@triton.jit
def round_to_bf16(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), staying in fp32 (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = ~0xFFFF
    return bits.to(tl.float32, bitcast=True)
