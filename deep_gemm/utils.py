"""Helpers with DeepGEMM's names, and the argument checks every op shares.

The checks turn what DeepGEMM would assert in C++ (or silently compute wrong) into a
``ValueError`` that names the argument and what was expected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

import accel
from accel.verify import calc_diff  # noqa: F401 - DeepGEMM public helper, one definition toolkit-wide

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128  # scale granularity along K (and along N for 128x128 weight blocks)
M_ALIGNMENT = 128  # rows per group in the contiguous grouped layout
CHECK_SCALES_ENV = "DSV3_DEEP_GEMM_CHECK_SCALES"

_num_sms: int | None = None
_scale_values_unchecked = 0  # > 0 inside unchecked_scale_values()


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y




def get_m_alignment_for_contiguous_layout() -> int:
    """Rows per group must be padded to this multiple in the contiguous grouped layout."""
    return M_ALIGNMENT


get_mk_alignment_for_contiguous_layout = get_m_alignment_for_contiguous_layout  # DeepGEMM v2 name


def set_num_sms(num_sms: int) -> None:
    """Cap the streaming multiprocessors the kernels plan for (as DeepGEMM's ``set_num_sms``)."""
    global _num_sms
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    device_sms = _device_sms()
    if device_sms is not None and num_sms > device_sms:
        raise ValueError(f"num_sms={num_sms} exceeds the device's {device_sms} multiprocessors")
    _num_sms = num_sms


def get_num_sms() -> int:
    """The SM count set by ``set_num_sms``, else the device's (1 on the cpu)."""
    if _num_sms is not None:
        return _num_sms
    return _device_sms() or 1


def _device_sms() -> int | None:
    module = accel.device_module()
    if module is None or accel.backend() == "cpu":
        return None
    return int(module.get_device_properties(accel.default_device()).multi_processor_count)


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """Scale factors in MN-major layout (stride 1 along M/N), as DeepGEMM's SM90 kernels want.

    Our Triton kernels read scales through their strides, so any layout works; we still return
    the MN-major layout DeepGEMM returns (padding the MN stride to 16 bytes) so code that inspects
    strides sees the same thing. 2-D ``[mn, k]`` or 3-D ``[g, mn, k]``.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D [mn, k] or 3-D [g, mn, k], got shape {tuple(x.shape)}")
    mn, k = x.shape[-2:]
    aligned_mn = align(mn, max(1, 16 // x.element_size()))
    if x.stride(-2) == 1 and x.stride(-1) == aligned_mn and (x.dim() == 2 or x.stride(0) == aligned_mn * k):
        return x
    out = torch.empty((*x.shape[:-2], k, aligned_mn), dtype=x.dtype, device=x.device)
    out[..., :mn].copy_(x.transpose(-1, -2))
    return out[..., :mn].transpose(-1, -2)


# ---------------------------------------------------------------- argument checks


def check_tensor(name: str, t: object, dtypes: Sequence[torch.dtype], shape: Sequence[int | None],
                 contiguous: bool = True) -> torch.Tensor:
    """``t`` must be a tensor of one of ``dtypes`` with ``shape`` (None = any size in that dim)."""
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    dts = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {dts} tensor of shape {want}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {dts}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major {want}); call .contiguous() first")
    return t


def check_scale(name: str, sf: object, shapes: Sequence[Sequence[int | None]]) -> torch.Tensor:
    """Scale factors: float32, one of ``shapes`` (any strides), every value finite and positive."""
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32:
        got = str(sf.dtype) if isinstance(sf, torch.Tensor) else type(sf).__name__
        raise ValueError(f"{name} must be a float32 scale tensor, got {got}")
    if not any(sf.dim() == len(s) and all(a is None or a == b for a, b in zip(s, sf.shape)) for s in shapes):
        wants = " or ".join("[" + ", ".join("*" if a is None else str(a) for a in s) + "]" for s in shapes)
        raise ValueError(f"{name} must have shape {wants}, got {list(sf.shape)}")
    if sf.numel() and scale_values_checked(sf) and not bool(torch.isfinite(sf).all() & (sf > 0).all()):
        raise ValueError(f"{name} holds NaN, Inf or non-positive scales; every scale must be finite and > 0")
    return sf


def scale_values_checked(sf: torch.Tensor) -> bool:
    """Whether to look at scale values (one host sync per call on a GPU).

    On unless ``DSV3_DEEP_GEMM_CHECK_SCALES=0`` (for latency-critical serving), and skipped while a
    CUDA graph is being captured, where a sync is illegal.
    """
    if _scale_values_unchecked or os.environ.get(CHECK_SCALES_ENV, "1") == "0":
        return False
    return not (sf.is_cuda and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def unchecked_scale_values() -> Iterator[None]:
    """Skip the scale value check inside this block (process-wide, so autograd's backward threads too).

    For a training step, whose scales all come from its own casts of its own tensors: there a NaN or Inf
    scale means NaN or Inf data, which must flow to the loss and the gradient norm, where the fault guard
    (``training/fault.py``) sees it and rolls back, as DeepGEMM's kernels would let it flow, instead of
    stopping the run with an argument error (and a host sync per GEMM on a GPU)."""
    global _scale_values_unchecked
    _scale_values_unchecked += 1
    try:
        yield
    finally:
        _scale_values_unchecked -= 1


def unpack_pair(name: str, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"{name} must be a (fp8 tensor, float32 scales) pair, got {type(pair).__name__}")
    return pair[0], pair[1]


def check_k(name: str, k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"{name}: K={k} must be a multiple of {BLOCK} (the scale block along K)")


def check_out(d: object, shape: Sequence[int], c: torch.Tensor | None, dtypes=(torch.bfloat16, torch.float32)):
    """The output ``d`` (and the optional accumulator ``c``): same shape, same dtype, contiguous."""
    check_tensor("d", d, dtypes, shape)
    if c is not None:
        check_tensor("c", c, (d.dtype,), shape)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{k}: {v}" for k, v in devices.items()))
