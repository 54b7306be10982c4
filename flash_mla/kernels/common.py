"""Small helpers shared by flash_mla's Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl

import accel


def interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter (then bf16 ``tl.dot`` must be upcast to fp32)."""
    return accel.triton_interpreted()


def cuda_capability() -> tuple[int, int] | None:
    """This device's CUDA capability, which picks the per-architecture autotune lists; None on MUSA and the CPU."""
    return accel.device_capability() if accel.backend() == "cuda" else None


def pipeline_stages(stages: int) -> int:
    """Software-pipelining depth for a config: Moore Threads' Triton builds want ``num_stages=1``."""
    return 1 if accel.backend() == "musa" else stages


def split_head_dim(d: int) -> tuple[int, int]:
    """Cover a head dim with two power-of-two tiles (192 -> 128 + 64, 48 -> 32 + 16, 64 -> 64 + 0).

    Padding 192 to 256 would waste a third of the QK^T work; the second tile is masked past ``d``.
    """
    first = max(16, 1 << (d.bit_length() - 1))
    rest = d - first
    return first, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


@triton.jit
def round_to_bf16_grid(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32.

    Why: the interpreter's fp32 -> bf16 cast truncates; rounding first makes the cast exact.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_out(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest for bf16 under the interpreter too."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            x = round_to_bf16_grid(x)
    return x.to(dtype)
